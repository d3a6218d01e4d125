"""Triton kernel for `omni_compile::gated_residual`.

Tiling: a 2-D grid over [B*S rows, D columns]; a program takes ROWS rows x BLOCK_D columns, BLOCK_D
= next_power_of_2(D) up to 2048 (masked past D) and ROWS = 2048 // BLOCK_D. Row r is
token (r // S, r % S); x, y and the gate are read with their own strides (the gate's stride is 0 on
a size-1 dim, so a per-sample gate stays in cache), the output is written contiguous.

Rounding (see `omni_compile.ops.gated_residual`): x + y * gate in fp32, rounded once to x.dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_compile.ops.kernels._common import (
    EMULATE_RTNE,
    PLATFORMS,
    bcast_reason,
    bcast_stride,
    cast_to,
    device_reason,
    dtype_reason,
    first,
    launcher,
    next_pow2,
)
from omni_compile.ops.registry import Kernel, register

MAX_BLOCK_D = 2048


@triton.jit
def _gated_residual_kernel(
    x_ptr,
    y_ptr,
    g_ptr,
    out_ptr,
    n_rows,
    S,
    D,
    sx_b,
    sx_s,
    sy_b,
    sy_s,
    sg_b,
    sg_s,
    SXD: tl.constexpr,
    SYD: tl.constexpr,
    SGD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """One [ROWS, BLOCK_D] tile a program: out = x + y * gate in fp32, rounded to x.dtype."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    b = (rows // S).to(tl.int64)
    s = (rows % S).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + ((b * sx_b + s * sx_s)[:, None] + cols[None, :] * SXD), mask=mask, other=0.0)
    y = tl.load(y_ptr + ((b * sy_b + s * sy_s)[:, None] + cols[None, :] * SYD), mask=mask, other=0.0)
    g = tl.load(g_ptr + ((b * sg_b + s * sg_s)[:, None] + cols[None, :] * SGD), mask=mask, other=0.0)
    out = x.to(tl.float32) + y.to(tl.float32) * g.to(tl.float32)
    out_off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptr + out_off, cast_to(out, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=mask)


def supports(x, y, gate) -> str | None:
    """None when the kernel handles these inputs (real or fake tensors), else the reason it does not."""
    reason = first(
        dtype_reason("x", x),
        dtype_reason("y", y),
        dtype_reason("gate", gate),
        device_reason("y", y, x),
        device_reason("gate", gate, x),
    )
    if reason:
        return reason
    if x.dim() != 3:
        return f"x has shape {tuple(x.shape)}; the Triton kernel takes [B, S, D]"
    if tuple(y.shape) != tuple(x.shape):
        return f"y has shape {tuple(y.shape)}, x {tuple(x.shape)}; the Triton kernel takes equal shapes"
    return bcast_reason("gate", gate, x.shape)


def _tiling(d: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_D, num_warps): rows of up to 2048 columns (masked past D), 2048 elements a program,
    8 warps (measured best on the H200 at D = 3072 and 1536, against tiles that divide D exactly)."""
    block_d = min(next_pow2(d), MAX_BLOCK_D)
    return max(1, MAX_BLOCK_D // block_d), block_d, 8


def _launch(x, y, gate, out, config=None):
    """Launch the kernel writing `out` (contiguous [B, S, D] of x.dtype). `config` overrides the tiling."""
    B, S, D = x.shape
    rows, block_d, num_warps = _tiling(D)
    if config:
        rows = config.get("ROWS", rows)
        block_d = config.get("BLOCK_D", block_d)
        num_warps = config.get("num_warps", num_warps)
    launcher(_gated_residual_kernel)[(triton.cdiv(B * S, rows), triton.cdiv(D, block_d))](
        x,
        y,
        gate,
        out,
        B * S,
        S,
        D,
        bcast_stride(x, 0),
        bcast_stride(x, 1),
        bcast_stride(y, 0),
        bcast_stride(y, 1),
        bcast_stride(gate, 0),
        bcast_stride(gate, 1),
        SXD=x.stride(2),
        SYD=y.stride(2),
        SGD=gate.stride(2),
        ROWS=rows,
        BLOCK_D=block_d,
        EMULATE_RTNE=EMULATE_RTNE,
        num_warps=num_warps,
    )
    return out


def _gated_residual_impl(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`omni_compile::gated_residual` as one Triton kernel."""
    # new_empty dispatches on x, so under the lowering's functional trace the output is fake like x
    # (a bare torch.empty there would allocate a real tensor).
    out = x.new_empty(x.shape)
    return _launch(x, y, gate, out)


# The triton_op runs the kernel eagerly and under torch.compile from the start of a graph; the lowering
# pass traces `_gated_residual_impl` itself to put the launch into post-grad graphs (see passes/lower_fused_ops.py).
gated_residual_triton = torch.library.triton_op("omni_compile::gated_residual_triton", mutates_args=())(
    _gated_residual_impl
)


KERNEL = register(
    Kernel(
        op="gated_residual",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.gated_residual_triton.default,
        supports=supports,
        launcher=_gated_residual_impl,
        manual_reason="it ties Inductor's code on the H200 (0.98x W1, 1.00x W2), which also fuses the add into its neighbours",
        description="Triton kernel, embedded in Inductor's generated code",
    )
)
