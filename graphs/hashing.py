"""Stable hashes and readable dumps of captured region graphs.

`graph_hash` covers the Dynamo graph's code and the metadata of its inputs (shape, stride, dtype,
device type). Both are deterministic across processes for the same model, bucket and torch version.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def input_signature(example_inputs) -> list:
    sig = []
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            sig.append(["tensor", list(t.shape), list(t.stride()), str(t.dtype), t.device.type])
        else:
            sig.append([type(t).__name__, repr(t)])
    return sig


def graph_hash(gm: torch.fx.GraphModule, example_inputs) -> str:
    h = hashlib.sha256()
    h.update(gm.code.encode())
    h.update(repr(input_signature(example_inputs)).encode())
    return h.hexdigest()


def dump_graph(gm: torch.fx.GraphModule, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gm.print_readable(print_output=False, include_stride=True, include_device=True))
