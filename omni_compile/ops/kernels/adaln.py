"""Triton kernel for `omni_compile::adaln`.

Tiling: x [B, S, D] is seen as B*S rows; a program takes ROWS rows x BLOCK_D columns (BLOCK_D = next
power of two of D, masked; ROWS = TILE // BLOCK_D). Row r is token (r // S, r % S); scale and shift
are read at that token with their own strides (stride 0 on a size-1 dim, so a per-sample [B, 1, D]
view of a larger chunked tensor is read in place, once per row, from cache).

Rounding (see `omni_compile.ops.adaln`): fp32 statistics (layer: two-pass mean and biased variance
over the registers; rms: mean of squares); the norm's affine (weight, bias) in fp32; with `round_norm`
the result is rounded to x.dtype; `(1 + scale)`, the product and `+ shift` in fp32; one final rounding
to x.dtype. An RMSNorm weight in diffusers' cast-before-weight convention is left to the native code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_compile.ops.adaln import NORMS
from omni_compile.ops.kernels._common import (
    EMULATE_RTNE,
    PLATFORMS,
    bcast_reason,
    bcast_stride,
    cast_to,
    device_reason,
    dtype_reason,
    e4m3_rows,
    first,
    launcher,
    next_pow2,
    round_to,
    row_tiling,
    unused,
    width_reason,
)
from omni_compile.ops.quant_rows import FP8
from omni_compile.ops.registry import Kernel, register


@triton.jit
def _adaln_kernel(
    x_ptr,
    scale_ptr,
    shift_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    q_ptr,
    qs_ptr,
    n_rows,
    S,
    D,
    sx_b,
    sx_s,
    ssc_b,
    ssc_s,
    ssh_b,
    ssh_s,
    eps,
    SXD: tl.constexpr,
    SSCD: tl.constexpr,
    SSHD: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LAYER: tl.constexpr,
    ROUND_NORM: tl.constexpr,
    QUANT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """ROWS tokens a program: out = norm(x) * (1 + scale) + shift (see the module docstring); with QUANT, the
    rounded rows in e4m3 (q) with their scales (qs) instead, as `quant_rows` computes them."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64, which would make the norm fp64
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = (rows // S).to(tl.int64)
    s = (rows % S).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + ((b * sx_b + s * sx_s)[:, None] + cols[None, :] * SXD), mask=mask, other=0.0).to(tl.float32)
    if LAYER:
        mean = tl.sum(x, axis=1) / D
        xc = tl.where(mask, x - mean[:, None], 0.0)
        y = xc * tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)[:, None]
    else:
        y = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if ROUND_NORM:
        y = round_to(y, x_ptr.dtype.element_ty, EMULATE_RTNE)
    if HAS_SCALE:
        sc_off = (b * ssc_b + s * ssc_s)[:, None] + cols[None, :] * SSCD
        y = y * (tl.load(scale_ptr + sc_off, mask=mask, other=0.0).to(tl.float32) + 1.0)
    if HAS_SHIFT:
        sh_off = (b * ssh_b + s * ssh_s)[:, None] + cols[None, :] * SSHD
        y = y + tl.load(shift_ptr + sh_off, mask=mask, other=0.0).to(tl.float32)
    out_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    if QUANT:
        y = round_to(y, x_ptr.dtype.element_ty, EMULATE_RTNE)  # the adaln output quant_rows would read
        q, qscale = e4m3_rows(y, mask, q_ptr.dtype.element_ty, EMULATE_RTNE)
        tl.store(q_ptr + out_off, q, mask=mask)
        tl.store(qs_ptr + rows.to(tl.int64), qscale, mask=rows < n_rows)
    else:
        tl.store(out_ptr + out_off, cast_to(y, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=mask)


def supports(x, scale, shift, eps, norm, round_norm, weight=None, bias=None, cast_before_weight=False) -> str | None:
    """None when the kernel handles these inputs (real or fake tensors), else the reason it does not."""
    if norm not in NORMS:
        return f"norm {norm!r} is not one of {NORMS}"
    if norm == "rms" and weight is not None and cast_before_weight:
        return "an RMSNorm weight in the cast-before-weight convention (the kernel applies weights in fp32)"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != x.shape[-1] or t.stride(0) != 1):
            return f"the norm {name} has shape {tuple(t.shape)}; the kernel takes a contiguous [D]"
    reason = first(
        dtype_reason("x", x),
        dtype_reason("scale", scale),
        dtype_reason("shift", shift),
        dtype_reason("weight", weight),
        dtype_reason("bias", bias),
        device_reason("scale", scale, x),
        device_reason("shift", shift, x),
        device_reason("weight", weight, x),
        device_reason("bias", bias, x),
    )
    if reason:
        return reason
    if x.dim() != 3:
        return f"x has shape {tuple(x.shape)}; the Triton kernel takes [B, S, D]"
    return first(
        width_reason("the hidden size", x.shape[-1]),
        bcast_reason("scale", scale, x.shape) if scale is not None else None,
        bcast_reason("shift", shift, x.shape) if shift is not None else None,
    )


def _launch(x, scale, shift, eps, norm, round_norm, out, config=None, weight=None, bias=None, quant=None):
    """Launch the kernel writing `out` (contiguous [B, S, D] of x.dtype), or with `quant` = (q, qs) the e4m3 rows
    (contiguous [B, S, D]) and their fp32 scales ([B, S, 1]) instead. `config` overrides ROWS / num_warps."""
    B, S, D = x.shape
    block_d = next_pow2(D)
    rows, num_warps = row_tiling(block_d)
    if config:
        rows, num_warps = config.get("ROWS", rows), config.get("num_warps", num_warps)
    sc = unused(x) if scale is None else scale
    sh = unused(x) if shift is None else shift
    launcher(_adaln_kernel)[(triton.cdiv(B * S, rows),)](
        x,
        sc,
        sh,
        unused(x) if weight is None else weight,
        unused(x) if bias is None else bias,
        unused(x) if out is None else out,
        unused(x) if quant is None else quant[0],
        unused(x) if quant is None else quant[1],
        B * S,
        S,
        D,
        bcast_stride(x, 0),
        bcast_stride(x, 1),
        0 if scale is None else bcast_stride(sc, 0),
        0 if scale is None else bcast_stride(sc, 1),
        0 if shift is None else bcast_stride(sh, 0),
        0 if shift is None else bcast_stride(sh, 1),
        eps,
        SXD=x.stride(2),
        SSCD=1 if scale is None else sc.stride(2),
        SSHD=1 if shift is None else sh.stride(2),
        HAS_SCALE=scale is not None,
        HAS_SHIFT=shift is not None,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        LAYER=norm == "layer",
        ROUND_NORM=bool(round_norm),
        QUANT=quant is not None,
        ROWS=rows,
        BLOCK_D=block_d,
        EMULATE_RTNE=EMULATE_RTNE,
        num_warps=num_warps,
    )
    return out if quant is None else quant


def _adaln_impl(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    norm: str,
    round_norm: bool,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    """`omni_compile::adaln` as one Triton kernel (a cast-before-weight RMSNorm weight is not taken: `supports`)."""
    # new_empty dispatches on x, so under the lowering's functional trace the output is fake like x
    # (a bare torch.empty there would allocate a real tensor).
    out = x.new_empty(x.shape)
    return _launch(x, scale, shift, eps, norm, round_norm, out, weight=weight, bias=bias)


# The triton_op runs the kernel eagerly and under torch.compile from the start of a graph; the lowering
# pass traces `_adaln_impl` itself to put the launch into post-grad graphs (see passes/lower_fused_ops.py).
adaln_triton = torch.library.triton_op("omni_compile::adaln_triton", mutates_args=())(_adaln_impl)


KERNEL = register(
    Kernel(
        op="adaln",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.adaln_triton.default,
        supports=supports,
        launcher=_adaln_impl,
        auto_on=("cuda",),
        description="Triton kernel, embedded in Inductor's generated code",
    )
)


def _adaln_quant_impl(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    norm: str,
    round_norm: bool,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cast_before_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`omni_compile::adaln_quant` as one launch of the adaln kernel: the rows in e4m3 and their scales."""
    q = x.new_empty(x.shape, dtype=FP8)
    qs = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return _launch(x, scale, shift, eps, norm, round_norm, None, weight=weight, bias=bias, quant=(q, qs))


adaln_quant_triton = torch.library.triton_op("omni_compile::adaln_quant_triton", mutates_args=())(_adaln_quant_impl)

QUANT_KERNEL = register(
    Kernel(
        op="adaln_quant",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.adaln_quant_triton.default,
        supports=supports,
        launcher=_adaln_quant_impl,
        auto_on=("cuda",),
        description="the adaln Triton kernel writing e4m3 rows and their scales, embedded in Inductor's code",
    )
)
