"""fp8 GEMMs (lossy, opt-in): a Linear whose weight is stored once in float8 e4m3 with one scale per output
channel, and whose input is quantized per row (token) at run time, inside the compiled region.

    y = (q(x) * s_x) (q(W) * s_W)ᵀ + b,   s_x = max|x_row| / 448,  s_W = max|W_row| / 448

`torch._scaled_mm` multiplies the e4m3 operands and applies both scales and the bias in its epilogue
(rowwise scaling: [M, 1] and [1, N] fp32 scales), writing the activation dtype. Inductor traces the
quantization of x (a row max, a division, a cast) into the region graph, where it fuses with whatever
produces x (the norm and modulation before a projection, the GELU before the MLP's second GEMM).

Weights are quantized once, when they are bound (`omni_compile.weights`, transform "fp8"): the bf16 weight
is replaced by its e4m3 copy (half the memory), never kept beside it.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = 1e-12  # a row of zeros gets a scale that maps it to zeros, not NaN


def quantize(t: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, fp32 scales) with one scale per slice over `dims` (kept as size 1 in the scales), the
    slice's largest magnitude mapped to 448: t ≈ q * scale."""
    amax = t.abs().amax(dim=dims, keepdim=True).float().clamp(min=_TINY)
    scale = amax / FP8_MAX
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, fp32 [rows, 1] scales) of a 2-D tensor, one scale per row."""
    return quantize(t, -1)


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
        xq, sx = quantize_rows(x.reshape(-1, shape[-1]))
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
