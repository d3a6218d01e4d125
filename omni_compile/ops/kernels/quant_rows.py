"""Triton kernel for `omni_compile::quant_rows`: activation, row maximum and e4m3 quantization in one pass.

A program holds ROWS whole rows in registers (BLOCK_K = next power of two of the row, masked), so each
input element is read once: the activation in fp32, rounded to x.dtype as the op's contract says, the row
maximum over the rounded values, then the scaled e4m3 row and its fp32 scale are written. Rows may have
any strides (up to three collapsed leading dims); the row itself must be contiguous.

The tanh of tanh-GELU is computed as 1 - 2 / (exp(2u) + 1), which the Triton interpreter runs too; it
differs from torch's tanh by a few fp32 ulps, far below the bf16 rounding that follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_compile.ops.kernels._common import (
    EMULATE_RTNE,
    PLATFORMS,
    collapse,
    dtype_reason,
    e4m3_rows,
    first,
    launcher,
    lead_args,
    next_pow2,
    round_to,
    row_offsets,
    row_tiling,
    width_reason,
)
from omni_compile.ops.quant_rows import ACTS, FP8, FP8_MAX, TINY
from omni_compile.ops.registry import Kernel, register

_ACT_CODE = {"none": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    n1,
    n2,
    s0,
    s1,
    s2,
    K,
    ACT: tl.constexpr,
    LEAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """ROWS rows a program: q = e4m3(act(x) / s), s = max|act(x)| / 448 per row (module docstring)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows < n_rows)[:, None] & (cols < K)[None, :]
    x_off = row_offsets(rows, n1, n2, s0, s1, s2, LEAD)
    y = tl.load(x_ptr + (x_off[:, None] + cols[None, :]), mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACT == 2:
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * u, 80.0)) + 1.0))  # tanh(u) saturates long before
    if ACT != 0:
        y = round_to(y, x_ptr.dtype.element_ty, EMULATE_RTNE)
    q, scale = e4m3_rows(y, mask, q_ptr.dtype.element_ty, EMULATE_RTNE)
    out_off = rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(q_ptr + out_off, q, mask=mask)
    tl.store(s_ptr + rows.to(tl.int64), scale, mask=rows < n_rows)


assert FP8_MAX == 448.0 and TINY == 1e-12, "e4m3_rows' constants follow omni_compile.ops.quant_rows"


def supports(x, act) -> str | None:
    """None when the kernel handles these inputs (real or fake tensors), else the reason it does not."""
    if act not in ACTS:
        return f"act {act!r} is not one of {ACTS}"
    if x.dim() < 1 or x.numel() == 0:
        return f"x has shape {tuple(x.shape)}"
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        return "x's rows are not contiguous (last-dimension stride 1)"
    dims = collapse(x.shape[:-1], x.stride()[:-1])
    if len(dims) > 3:
        return f"x's leading dims {tuple(x.shape[:-1])} with strides {x.stride()[:-1]} do not collapse to three"
    return first(dtype_reason("x", x), width_reason("the row", x.shape[-1]))


def _launch(x, act, q, s, config=None):
    """Launch the kernel writing `q` (contiguous e4m3, x's shape) and `s` (contiguous fp32, [..., 1])."""
    k = x.shape[-1]
    block = next_pow2(k)
    rows, num_warps = row_tiling(block)
    if config:
        rows, num_warps = config.get("ROWS", rows), config.get("num_warps", num_warps)
    n1, n2, s0, s1, s2, lead = lead_args(collapse(x.shape[:-1], x.stride()[:-1]))
    n_rows = x.numel() // k
    launcher(_quant_rows_kernel)[(triton.cdiv(n_rows, rows),)](
        x,
        q,
        s,
        n_rows,
        n1,
        n2,
        s0,
        s1,
        s2,
        k,
        ACT=_ACT_CODE[act],
        LEAD=lead,
        ROWS=rows,
        BLOCK_K=block,
        EMULATE_RTNE=EMULATE_RTNE,
        num_warps=num_warps,
    )
    return q, s


def _quant_rows_impl(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`omni_compile::quant_rows` as one Triton kernel."""
    # new_empty dispatches on x: under the lowering's functional trace the outputs are fake like x
    q = x.new_empty(x.shape, dtype=FP8)
    s = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return _launch(x, act, q, s)


# The triton_op runs the kernel eagerly and under torch.compile from the start of a graph; the lowering
# pass traces `_quant_rows_impl` itself to put the launch into post-grad graphs (passes/lower_fused_ops.py).
quant_rows_triton = torch.library.triton_op("omni_compile::quant_rows_triton", mutates_args=())(_quant_rows_impl)


KERNEL = register(
    Kernel(
        op="quant_rows",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.quant_rows_triton.default,
        supports=supports,
        launcher=_quant_rows_impl,
        auto_on=("cuda",),
        description="Triton kernel: activation, row max and e4m3 rows in one read, embedded in Inductor's code",
    )
)
