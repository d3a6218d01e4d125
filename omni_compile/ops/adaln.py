"""`omni_compile::adaln`: normalise the last dimension, then modulate: `norm(x) * (1 + scale) + shift`.

The AdaLN-Zero modulation of FLUX and Wan blocks, and (with no scale and no shift) a LayerNorm or
RMSNorm. The norm may have its own affine parameters, applied before the modulation as the norm module
applies them (CogVideoX's LayerNorm with weight and bias, Lumina2's RMSNorm with a weight).

Numerical contract (what the unfused graph computes once Inductor has compiled it):
- statistics and normalisation in fp32 (`norm` is "layer": `(x - mean) * rsqrt(var + eps)`, biased
  variance; or "rms": `x * rsqrt(mean(x^2) + eps)`);
- `round_norm=True` rounds the normalised value to `x.dtype` before modulating (FLUX: its
  `nn.LayerNorm` returns bf16); `False` keeps it in fp32 (Wan: `FP32LayerNorm(x.float())`);
- `(1 + scale)` and the modulation in fp32, from scale/shift in whatever dtype they come;
- one final rounding to `x.dtype`;
- a norm affine (`weight` [D], `bias` [D], either may be None) is applied to the fp32 normalised value
  before the `round_norm` rounding: `n * weight + bias` (LayerNorm: `F.layer_norm` rounds once after its
  affine; RMSNorm in torch's convention); an RMSNorm with `cast_before_weight` (diffusers' RMSNorm with a
  half-precision weight) rounds `n` to the weight's dtype first and multiplies in that dtype, as
  `omni_compile::rms_norm` does.

Shapes: `x` is [B, S, D]; `scale` and `shift` are [B or 1, S or 1, D] (per-sample or per-token), any
strides. Either may be None.
"""

from __future__ import annotations

import torch

from omni_compile.ops.quant_rows import FP8, quantize_rows
from omni_compile.ops.registry import FusedOp, register_fused_op
from omni_compile.ops.rms_norm import rms_norm_native

NORMS = ("layer", "rms")


def normalize_native(xf: torch.Tensor, eps: float, norm: str) -> torch.Tensor:
    if norm == "layer":
        var, mean = torch.var_mean(xf, dim=-1, correction=0, keepdim=True)
        return (xf - mean) * torch.rsqrt(var + eps)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def adaln_native(
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
    if norm == "rms" and weight is not None and cast_before_weight and round_norm:
        y = rms_norm_native(x, weight, eps, True).to(torch.float32)  # diffusers' RMSNorm, rounded as it rounds
        if bias is not None:
            y = y + bias.to(torch.float32)
    else:
        y = normalize_native(x.to(torch.float32), eps, norm)
        if weight is not None:
            y = y * weight.to(torch.float32)
        if bias is not None:
            y = y + bias.to(torch.float32)
        if round_norm:
            y = y.to(x.dtype).to(torch.float32)
    if scale is not None:
        y = y * (scale.to(torch.float32) + 1)
    if shift is not None:
        y = y + shift.to(torch.float32)
    return y.to(x.dtype)


@torch.library.custom_op("omni_compile::adaln", mutates_args=())
def adaln(
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
    """`norm(x) * (1 + scale) + shift` over the last dimension; see the module docstring."""
    return adaln_native(x, scale, shift, eps, norm, round_norm, weight, bias, cast_before_weight)


@adaln.register_fake
def _adaln_fake(x, scale, shift, eps, norm, round_norm, weight=None, bias=None, cast_before_weight=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


ADALN = register_fused_op(
    FusedOp(
        name="adaln",
        overload=torch.ops.omni_compile.adaln.default,
        arg_names=("x", "scale", "shift", "eps", "norm", "round_norm", "weight", "bias", "cast_before_weight"),
        native=adaln_native,
    )
)


# ---------------------------------------------------------------- adaln, then fp8 rows

def adaln_quant_native(
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
    return quantize_rows(adaln_native(x, scale, shift, eps, norm, round_norm, weight, bias, cast_before_weight))


@torch.library.custom_op("omni_compile::adaln_quant", mutates_args=())
def adaln_quant(
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
    """`quant_rows(adaln(...), "none")`: the modulated rows in e4m3 with their fp32 scales ([B, S, D] and
    [B, S, 1]), for the fp8 GEMMs that read a norm's output (the `fp8_act` pass); the bf16 rows are never
    written."""
    return adaln_quant_native(x, scale, shift, eps, norm, round_norm, weight, bias, cast_before_weight)


@adaln_quant.register_fake
def _adaln_quant_fake(x, scale, shift, eps, norm, round_norm, weight=None, bias=None, cast_before_weight=False):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


ADALN_QUANT = register_fused_op(
    FusedOp(
        name="adaln_quant",
        overload=torch.ops.omni_compile.adaln_quant.default,
        arg_names=ADALN.arg_names,
        native=adaln_quant_native,
    )
)
