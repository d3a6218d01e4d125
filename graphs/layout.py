"""One layout per region call: what a block receives is given the layout its compiled graph was made for."""

from __future__ import annotations

from typing import Any

import torch


def canonical_layout(t: Any) -> Any:
    """Give size-1 dims the stride a contiguous layout would have: a free view, same values.

    Dynamo guards on strides, including those of size-1 dims, which carry no meaning. FLUX feeds its
    first single-stream block a fresh tensor and the others a slice of a concatenation; at batch 1
    the two differ only in the batch stride, and without this they compile twice. A permuted input (many
    models feed their first block the patch embedding's `flatten(2).transpose(1, 2)`, the others a
    contiguous block output) is copied to the contiguous layout, one copy per step instead of a second
    graph; an expanded one (a stride 0) is left as it is. Tuples and lists (FLUX's rotary embedding pair)
    are handled one level deep; this runs on every block call, so it stays cheap.
    """
    if isinstance(t, torch.Tensor):
        shape = t.shape
        if not t.is_contiguous() and all(st != 0 for st, size in zip(t.stride(), shape) if size > 1):
            return t.contiguous()
        if 1 not in shape:
            return t
        strides = t.stride()
        canon = [
            1 if size == 1 and i == len(shape) - 1 else (strides[i + 1] * shape[i + 1] if size == 1 else strides[i])
            for i, size in enumerate(shape)
        ]
        return t if tuple(canon) == strides else t.as_strided(shape, canon, t.storage_offset())
    if type(t) in (tuple, list):
        return type(t)(canonical_layout(x) for x in t)
    return t
