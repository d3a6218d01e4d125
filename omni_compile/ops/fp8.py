"""fp8 GEMMs (lossy, opt-in): a Linear whose weight is stored once in float8 e4m3 with one scale per output
channel, and whose input is quantized per row (token) at run time, inside the compiled region.

    y = (q(x) * s_x) (q(W) * s_W)ᵀ + b,   s_x = max|x_row| / 448,  s_W = max|W_row| / 448

`torch._scaled_mm` multiplies the e4m3 operands and applies both scales and the bias in its epilogue
(rowwise scaling: [M, 1] and [1, N] fp32 scales), writing the activation dtype. The quantization of x is
the fused op `omni_compile::quant_rows` (`omni_compile.ops.quant_rows`): one kernel on a GPU that reads each
row once, with a GELU before it folded in by the `fp8_act` pass (the MLP's second GEMM); with
`--kernels quant_rows=native` it is plain torch that Inductor fuses with whatever produces x.

Weights are quantized once, when they are bound (`omni_compile.weights`, transform "fp8"): the bf16 weight
is replaced by its e4m3 copy (half the memory), never kept beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_compile.ops.quant_rows import FP8, FP8_MAX, quantize, quantize_rows  # noqa: F401  (re-exported)


class Fp8Linear(nn.Module):
    """A Linear with an e4m3 weight [out, in] and fp32 per-output-channel scales; same call as the Linear it
    replaces (`from_linear`). Inputs are quantized per row; the output has the input's dtype."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)  # fp32 [out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.reshape(-1).contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # one op (`omni_compile::quant_rows`): the fp8_act pass folds a GELU before it, and on a GPU it lowers
        # to one kernel that reads the row once
        xq, sx = torch.ops.omni_compile.quant_rows(x.reshape(-1, shape[-1]), "none")
        # weight [out, in] row-major: its transpose is the column-major [in, out] operand _scaled_mm wants
        # the bias in the GEMM's epilogue (no pass of its own over the output); fast accumulation, as torchao's
        # float8 forward does: Hopper's fp8 MMA accumulates in reduced precision between its periodic promotions
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.weight_scale[None, :], bias=bias,
                             out_dtype=x.dtype, use_fast_accum=True)  # fmt: skip
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=e4m3 per-channel"


def has_fp8(model: nn.Module) -> bool:
    """Whether the fp8 transform has run on `model` (any of its Linears is an Fp8Linear)."""
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def eligible(linear: nn.Linear) -> str | None:
    """None when `linear` can run as an Fp8Linear, else why not (the GEMM needs both sizes multiples of 16)."""
    if linear.in_features % 16 or linear.out_features % 16:
        return f"{linear.in_features}x{linear.out_features} (fp8 GEMMs need multiples of 16)"
    if linear.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weight dtype {linear.weight.dtype}"
    return None
