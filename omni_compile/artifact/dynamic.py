"""Regions compiled once for a range of sizes (`build --dynamic`): which calls share a file, which of their
dimensions are symbolic, and which calls a file serves.

The build records each region's calls at the range's two probe sizes (`config.DynamicRange.probes`). Calls of
one region that differ only in tensor sizes and strides form a family (`families`): the same tree structure,
the same non-tensor values, and per tensor the same rank, dtype and device. A family's dimensions that differ
between its calls are what `DynamicSpec` records; the file is exported with those dimensions as `Dim.AUTO`
(torch.export infers how they relate, e.g. rotary tables of text + image tokens), and a call is served by it
when it has the family's structure, the family's static sizes, and its layout (`DynamicSpec.matches`).
A family of one call (the timestep embedder, which sees no size) stays a static file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from omni_compile.errors import OmniCompileError

_TENSOR = 4  # a tensor leaf of a call key: (shape, stride, dtype, device); other leaves are (type, repr)


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(tuple(shape)):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def _is_contiguous(leaf) -> bool:
    shape, stride = leaf[0], leaf[1]
    return all(d == 1 or s == c for d, s, c in zip(shape, stride, _contiguous_strides(shape)))


def family_key(key: tuple) -> tuple:
    """What calls of one family share: structure, non-tensor values, and per tensor rank, dtype and device."""
    out = [key[0]]
    for leaf in key[1:]:
        out.append(("tensor", len(leaf[0]), leaf[2], leaf[3]) if len(leaf) == _TENSOR else leaf)
    return tuple(out)


def families(keys: dict[str, tuple]) -> list[list[str]]:
    """The signature ids of `keys` (signature id -> call key) grouped into families, in first-seen order."""
    groups: dict[tuple, list[str]] = {}
    for sig, key in keys.items():
        groups.setdefault(family_key(key), []).append(sig)
    return list(groups.values())


@dataclass(frozen=True)
class DynamicSpec:
    """The symbolic dimensions of one compiled file: (leaf, dim) pairs of the call key's leaves (0-based, after
    the structure), for sizes and for strides, and the leaves that are contiguous in every recorded call."""

    shape: list[tuple[int, int]] = field(default_factory=list)
    stride: list[tuple[int, int]] = field(default_factory=list)
    contiguous: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, keys: list[tuple]) -> DynamicSpec | None:
        """What varies between the calls `keys` of one family; None when nothing does (a static file)."""
        first, shape, stride = keys[0], set(), set()
        for key in keys[1:]:
            for i, (a, b) in enumerate(zip(first[1:], key[1:])):
                if len(a) != _TENSOR:
                    continue
                shape.update((i, d) for d, (x, y) in enumerate(zip(a[0], b[0])) if x != y)
                stride.update((i, d) for d, (x, y) in enumerate(zip(a[1], b[1])) if x != y)
        if not shape:
            return None
        contiguous = [i for i, leaf in enumerate(first[1:])
                      if len(leaf) == _TENSOR and all(_is_contiguous(k[1 + i]) for k in keys)]  # fmt: skip
        return cls(sorted(shape), sorted(stride), contiguous)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> DynamicSpec | None:
        if not data:
            return None
        return cls([tuple(p) for p in data["shape"]], [tuple(p) for p in data["stride"]], list(data["contiguous"]))

    def to_json(self) -> dict[str, Any]:
        return {"shape": [list(p) for p in self.shape], "stride": [list(p) for p in self.stride],
                "contiguous": list(self.contiguous)}  # fmt: skip

    def matches(self, example: tuple, key: tuple) -> bool:
        """Whether the call `key` runs the file compiled at `example` (a key of its family)."""
        if len(key) != len(example) or family_key(key) != family_key(example):
            return False
        shape, stride, contiguous = set(self.shape), set(self.stride), set(self.contiguous)
        for i, (a, b) in enumerate(zip(example[1:], key[1:])):
            if len(a) != _TENSOR:
                continue
            if any(x != y and (i, d) not in shape for d, (x, y) in enumerate(zip(a[0], b[0]))):
                return False
            if i in contiguous:
                if not _is_contiguous(b):
                    return False
            elif any(x != y and (i, d) not in stride for d, (x, y) in enumerate(zip(a[1], b[1]))):
                return False
        return True

    def export_shapes(self, key: tuple) -> list[dict[int, Any] | None]:
        """`dynamic_shapes` for the call's tensor leaves (in order): Dim.AUTO for each symbolic dimension."""
        by_leaf: dict[int, dict[int, Any]] = {}
        for i, d in self.shape:
            by_leaf.setdefault(i, {})[d] = torch.export.Dim.AUTO
        return [by_leaf.get(i) for i, leaf in enumerate(key[1:]) if len(leaf) == _TENSOR]


def check_symbolic(program, spec: DynamicSpec, key: tuple, region: str) -> None:
    """Every dimension `spec` calls symbolic is symbolic in the exported `program`: export specializes a size the
    model computes with as a constant (a size-dependent Python branch, an int() of a size), and that file would
    serve one size only. Raises OmniCompileError naming the dimensions."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    tensor_leaves = [i for i, leaf in enumerate(key[1:]) if len(leaf) == _TENSOR]
    vals = [n.meta.get("val") for n in placeholders[len(placeholders) - len(tensor_leaves):]]
    position = {leaf: j for j, leaf in enumerate(tensor_leaves)}
    fixed = []
    for i, d in spec.shape:
        v = vals[position[i]]
        if isinstance(v, torch.Tensor) and not isinstance(v.shape[d], torch.SymInt):
            fixed.append(f"input {position[i]} dim {d} (= {v.shape[d]})")
    if fixed:
        raise OmniCompileError(
            f"region {region}: exporting it with symbolic sizes fixed {', '.join(fixed)}: the region computes with "
            "that size as a number, so one file cannot serve the --dynamic range. Build static buckets (--shapes, "
            "no --dynamic) for this model"
        )
