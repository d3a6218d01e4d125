"""Triton kernel for `omni_compile::rms_norm`.

Tiling: the rows (every leading index of x) are cut into tiles of ROWS rows x BLOCK_D columns
(BLOCK_D = next power of two of D, masked; ROWS = TILE // BLOCK_D, so one long row or many short ones
a program, e.g. 32 heads of 128 per program for per-head norms; see `row_tiling` for the warps). Each program loads its tile once
(vectorised when the last dim is contiguous), reduces sum(x^2) per row in fp32 and writes the
contiguous output. Leading dims are merged where their strides allow; up to three non-mergeable
ones are decomposed from the flat row index, so strided views (q sliced out of a fused qkv) work.

Rounding (see `omni_compile.ops.rms_norm`): y = x * rsqrt(mean(x^2) + eps) in fp32; with a weight and
`cast_before_weight`, y is rounded to the weight dtype before the fp32 product; one final rounding
to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_compile.ops.kernels._common import (
    EMULATE_RTNE,
    PLATFORMS,
    cast_to,
    collapse,
    device_reason,
    dtype_reason,
    first,
    launcher,
    lead_args,
    next_pow2,
    round_to,
    row_offsets,
    row_tiling,
    unused,
    width_reason,
)
from omni_compile.ops.registry import Kernel, register
from omni_compile.ops.rms_norm import rms_norm_out_dtype


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    n1,
    n2,
    sx0,
    sx1,
    sx2,
    D,
    eps,
    SXD: tl.constexpr,  # stride of x's last dim
    SW: tl.constexpr,  # stride of the weight
    LEAD: tl.constexpr,
    HAS_W: tl.constexpr,
    CAST_BEFORE_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """ROWS rows of x a program: out[r, :] = rms_norm(x[r, :]) (see the module docstring)."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64, which would make the norm fp64
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    x_off = row_offsets(rows, n1, n2, sx0, sx1, sx2, LEAD)
    x = tl.load(x_ptr + (x_off[:, None] + cols[None, :] * SXD), mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(w_ptr + cols * SW, mask=cmask, other=0.0).to(tl.float32)
        if CAST_BEFORE_W:
            y = round_to(y, w_ptr.dtype.element_ty, EMULATE_RTNE)
        y = y * w[None, :]
    out_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptr + out_off, cast_to(y, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=mask)


def supports(x, weight, eps, cast_before_weight) -> str | None:
    """None when the kernel handles these inputs (real or fake tensors), else the reason it does not."""
    reason = first(dtype_reason("x", x), dtype_reason("weight", weight), device_reason("weight", weight, x))
    if reason:
        return reason
    if x.dim() < 1:
        return "x is a scalar"
    reason = width_reason("the normalised dim", x.shape[-1])
    if reason:
        return reason
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        return f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)"
    if len(collapse(x.shape[:-1], x.stride()[:-1])) > 3:
        return f"x's leading dims (shape {tuple(x.shape)}, strides {x.stride()}) do not merge into three"
    return None


def _launch(x, weight, eps, cast_before_weight, out, config=None):
    """Launch the kernel writing `out` (contiguous, x's shape, the op's output dtype).

    `config` (tests and benchmarks only) overrides ROWS / num_warps.
    """
    d = x.shape[-1]
    block_d = next_pow2(d)
    rows, num_warps = row_tiling(block_d)
    if config:
        rows, num_warps = config.get("ROWS", rows), config.get("num_warps", num_warps)
    n1, n2, s0, s1, s2, lead = lead_args(collapse(x.shape[:-1], x.stride()[:-1]))
    n_rows = x.numel() // d
    launcher(_rms_norm_kernel)[(triton.cdiv(n_rows, rows),)](
        x,
        unused(x) if weight is None else weight,
        out,
        n_rows,
        n1,
        n2,
        s0,
        s1,
        s2,
        d,
        eps,
        SXD=x.stride(-1),
        SW=1 if weight is None else weight.stride(0),
        LEAD=lead,
        HAS_W=weight is not None,
        CAST_BEFORE_W=bool(cast_before_weight),
        ROWS=rows,
        BLOCK_D=block_d,
        EMULATE_RTNE=EMULATE_RTNE,
        num_warps=num_warps,
    )
    return out


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cast_before_weight: bool) -> torch.Tensor:
    """`omni_compile::rms_norm` as one Triton kernel."""
    # new_empty dispatches on x, so under the lowering's functional trace the output is fake like x
    # (a bare torch.empty there would allocate a real tensor).
    out = x.new_empty(x.shape, dtype=rms_norm_out_dtype(x, weight, cast_before_weight))
    return _launch(x, weight, eps, cast_before_weight, out)


# The triton_op runs the kernel eagerly and under torch.compile from the start of a graph; the lowering
# pass traces `_rms_norm_impl` itself to put the launch into post-grad graphs (see passes/lower_fused_ops.py).
rms_norm_triton = torch.library.triton_op("omni_compile::rms_norm_triton", mutates_args=())(_rms_norm_impl)


KERNEL = register(
    Kernel(
        op="rms_norm",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.rms_norm_triton.default,
        supports=supports,
        launcher=_rms_norm_impl,
        auto_on=("cuda",),
        description="Triton kernel, embedded in Inductor's generated code",
    )
)
