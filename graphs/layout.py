"""One layout per region call: what a block receives is given the layout its compiled graph was made for."""

from __future__ import annotations

import weakref
from typing import Any

import torch

# CPU tensor -> (its version, the device it was moved to, the moved tensor): what `on_device` moved already
_MOVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def on_device(t: Any, device: torch.device | None) -> Any:
    """`t` with its CPU tensors on `device` (a block's, when it is not the CPU), each moved once while it lives.

    Some models compute what every block reads on the host (CogView4 makes its rotary tables on the CPU each step,
    and each attention moves them with `.to(x.device)`): inside a compiled region that is a host-to-device copy
    per block and per table, and a `device_put` between the tables and the rotation the passes look for. Moving
    them at the region's door gives the same values on the device, copied once per step (the blocks share the
    tensors: the copy is kept for as long as the CPU tensor lives and is not written). Tuples and lists are
    handled one level deep, as in `canonical_layout`."""
    if device is None or device.type in ("cpu", "meta"):
        return t
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            return t
        hit = _MOVED.get(t)
        if hit is not None and hit[0] == t._version and hit[1] == device:
            return hit[2]
        moved = t.to(device)
        _MOVED[t] = (t._version, device, moved)
        return moved
    if type(t) in (tuple, list):
        return type(t)(on_device(x, device) for x in t)
    return t


def region_call(args: tuple, kwargs: dict, device: torch.device | None, canonicalize: bool = True) -> tuple[tuple, dict]:
    """What a region receives for one call, as the JIT path and artifacts both give it: CPU tensors moved to the
    block's `device` (`on_device`), then, with `canonicalize`, size-1 dims given canonical strides
    (`canonical_layout`: one signature per layout)."""
    args = tuple(on_device(a, device) for a in args)
    kwargs = {k: on_device(v, device) for k, v in kwargs.items()}
    if canonicalize:
        args = tuple(canonical_layout(a) for a in args)
        kwargs = {k: canonical_layout(v) for k, v in kwargs.items()}
    return args, kwargs


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of `module`'s first parameter or buffer (None for a module without tensors)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


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
