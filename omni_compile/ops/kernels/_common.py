"""Shared pieces of the Triton kernels: rounding helpers, layout helpers and input checks.

Rounding: every kernel computes in fp32 and rounds where the op's native implementation rounds. On a
GPU `x.to(tl.bfloat16)` rounds to nearest even, like torch. The Triton interpreter (TRITON_INTERPRET=1,
used by the CPU tests) truncates fp32 -> bf16 instead, so under the interpreter the kernels round bf16
with integer arithmetic (`EMULATE_RTNE`, a constexpr that is False on GPUs and costs nothing there).

The JIT helpers are imported by name (never through a module attribute) so that Inductor, which
copies a user kernel's source and the JIT functions it calls into its generated code, finds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # TRITON_INTERPRET=1 at import time makes @triton.jit return an InterpretedFunction.
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - every Triton we support has the interpreter
    InterpretedFunction = ()

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest row (or token) a kernel holds in registers in one program.
MAX_BLOCK = 65536
# Elements of one program's tile for the row kernels: several short rows share a program.
TILE = 4096
PLATFORMS = ("cuda", "rocm")


@triton.jit
def _probe():
    pass


EMULATE_RTNE = isinstance(_probe, InterpretedFunction)


def launcher(kernel):
    """`kernel[grid]` callable through `torch.library.wrap_triton`, so triton_op tracing sees the launch.

    torch releases older than 2.13 reject an InterpretedFunction in wrap_triton; under the interpreter
    (CPU tests) the kernel is launched directly, which is what wrap_triton does there anyway in eager,
    except on fake tensors: Inductor propagates shapes through a triton_op by running it on fake tensors,
    and then the launch is skipped (the launchers allocate their outputs before launching).
    """
    if isinstance(kernel, InterpretedFunction):
        return _InterpretedLauncher(kernel)
    return torch.library.wrap_triton(kernel)


class _InterpretedLauncher:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            from torch._subclasses.fake_tensor import is_fake

            if any(isinstance(a, torch.Tensor) and is_fake(a) for a in (*args, *kwargs.values())):
                return None
            return run(*args, **kwargs)

        return launch


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 `x` rounded (to nearest even) to DTYPE, returned as fp32 (torch's `.to(dtype).float()`)."""
    if DTYPE == tl.float32:
        y = x
    elif EMULATE_RTNE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def cast_to(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 `x` converted (to nearest even) to DTYPE, for a store."""
    if EMULATE_RTNE and DTYPE == tl.bfloat16:
        y = round_to(x, DTYPE, EMULATE_RTNE).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def cast_fp8(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 `x` (|x| <= 448) converted to the e4m3 DTYPE, rounded to nearest even, for a store. The Triton
    interpreter's own conversion is wrong where rounding carries into the exponent (124.3 -> 64, not 128),
    so there the value is first rounded to e4m3's grid in fp32: 3 mantissa bits for normals, steps of
    2^-9 below 2^-6 (subnormals); the conversion of a value on the grid is exact."""
    if EMULATE_RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
        y = tl.where(tl.abs(x) < 0.015625, subnormal, normal).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def e4m3_rows(y, mask, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """(rows of fp32 `y` in the e4m3 DTYPE, fp32 scales): one scale per row, max|row| / 448 (at least 1e-12 / 448),
    the quotient saturated at ±448; masked elements count as 0. `omni_compile.ops.quant_rows`'s contract."""
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(y / scale[:, None], -448.0), 448.0)
    return cast_fp8(q, DTYPE, EMULATE_RTNE), scale


@triton.jit
def row_offsets(rows, n1, n2, s0, s1, s2, LEAD: tl.constexpr):
    """int64 element offsets of flat row indices `rows` in a [n0, n1, n2] grid of rows with strides s0..s2.

    LEAD is how many leading dims the rows span (1, 2 or 3) after merging the ones that collapse.
    """
    if LEAD == 1:
        off = rows.to(tl.int64) * s0
    elif LEAD == 2:
        off = (rows // n1).to(tl.int64) * s0 + (rows % n1).to(tl.int64) * s1
    else:
        outer = rows // n2
        off = (outer // n1).to(tl.int64) * s0 + (outer % n1).to(tl.int64) * s1 + (rows % n2).to(tl.int64) * s2
    return off


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def collapse(sizes, strides) -> list[tuple[int, int]]:
    """(size, stride) pairs of a row-major traversal of `sizes`, with size-1 dims dropped and adjacent
    dims merged where their strides allow (so a contiguous [B, S, H] grid of rows becomes one dim)."""
    merged: list[tuple[int, int]] = []
    for n, st in zip(sizes, strides):
        if n == 1:
            continue
        if merged and merged[-1][1] == st * n:
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    return merged or [(1, 0)]


def lead_args(dims: list[tuple[int, int]]) -> tuple[int, int, int, int, int, int]:
    """(n1, n2, s0, s1, s2, LEAD) for `row_offsets` from at most three collapsed dims."""
    lead = len(dims)
    sizes = [n for n, _ in dims] + [1] * (3 - lead)
    strides = [s for _, s in dims] + [0] * (3 - lead)
    return sizes[1], sizes[2], strides[0], strides[1], strides[2], lead


def unused(like: torch.Tensor) -> torch.Tensor:
    """A one-element tensor of `like`'s dtype and device for a pointer argument the launch never reads or writes
    (a missing weight, mask or second output; the kernel's constexpr flags skip it).

    Not `like` itself: Inductor realizes each tensor argument of a user kernel on its own, so a value it has not
    stored yet (a view of a pointwise result) passed as several arguments is written once per argument. On
    LTX-Video the adaln kernel's input, the residual sum, was stored five times: 56 us a call instead of 15.
    One spare per argument: `lower_fused_ops` tells a spare from an output by its users (an output is read after
    the launch) and clones neither; before it did, a spare shared by several arguments was taken for an output and
    copied once per argument (run 23: nine 1-element copy kernels per LTX-Video block).
    """
    return like.new_empty(1)


def bcast_stride(t: torch.Tensor, dim: int) -> int:
    """Stride of `dim` for broadcasting: 0 where the dim has size 1."""
    return 0 if t.shape[dim] == 1 else t.stride(dim)


def row_tiling(block_d: int) -> tuple[int, int]:
    """(rows per program, num_warps) for a row kernel with a BLOCK_D-wide row: TILE elements a program,
    with 4 warps up to 4096 elements (32 a thread: measured best on the H200 at the FLUX and Wan
    shapes, against 8 or 16 warps), more for longer rows."""
    rows = max(1, TILE // block_d)
    num_warps = min(16, max(4, rows * block_d // 1024))
    return rows, num_warps


def dtype_reason(name: str, t: torch.Tensor | None) -> str | None:
    if t is not None and t.dtype not in FLOAT_DTYPES:
        return f"{name} has dtype {t.dtype}; the Triton kernel takes float32, bfloat16 or float16"
    return None


def device_reason(name: str, t: torch.Tensor | None, x: torch.Tensor) -> str | None:
    if t is not None and t.device != x.device:
        return f"{name} is on {t.device} but x is on {x.device}"
    return None


def width_reason(what: str, n: int) -> str | None:
    if n > MAX_BLOCK:
        return f"{what} is {n}, more than the {MAX_BLOCK} elements one program of the Triton kernel holds"
    if n < 1:
        return f"{what} is {n}"
    return None


def bcast_reason(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> str | None:
    """Why `t` cannot broadcast as [B or 1, S or 1, D] against `shape` = (B, S, D), or None."""
    if t.dim() != 3:
        return f"{name} has shape {tuple(t.shape)}; the Triton kernel takes [B or 1, S or 1, D]"
    if t.shape[2] != shape[2] or any(t.shape[i] not in (1, shape[i]) for i in (0, 1)):
        return f"{name} has shape {tuple(t.shape)}, which does not broadcast to x's {tuple(shape)} as [B|1, S|1, D]"
    return None


def first(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r), None)


__all__ = [
    "EMULATE_RTNE",
    "FLOAT_DTYPES",
    "MAX_BLOCK",
    "PLATFORMS",
    "bcast_reason",
    "bcast_stride",
    "cast_fp8",
    "cast_to",
    "collapse",
    "device_reason",
    "dtype_reason",
    "e4m3_rows",
    "first",
    "launcher",
    "lead_args",
    "next_pow2",
    "round_to",
    "row_offsets",
    "row_tiling",
    "width_reason",
]
