"""`omni_compile::rms_norm`: RMSNorm over the last dimension, with or without a weight.

Two rounding conventions exist in the models we compile, and the op reproduces both exactly:

- torch (`torch.nn.RMSNorm`, `F.rms_norm`, used by FLUX and Wan attention): normalise in fp32,
  multiply by the weight in fp32, then round once to the input dtype;
- diffusers (`diffusers.models.normalization.RMSNorm` with a half-precision weight): normalise in
  fp32, round to the weight dtype, then multiply by the weight in that dtype.

`cast_before_weight=True` selects the second. Without a weight both are `(x * rsqrt(...)).to(x.dtype)`.
"""

from __future__ import annotations

import torch

from omni_compile.ops.registry import FusedOp, register_fused_op


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cast_before_weight: bool) -> torch.Tensor:
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(x.dtype)
    if cast_before_weight:
        return y.to(weight.dtype) * weight
    return (y * weight).to(x.dtype)


def rms_norm_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, cast_before_weight: bool) -> torch.dtype:
    if weight is not None and cast_before_weight:
        return weight.dtype
    return x.dtype


@torch.library.custom_op("omni_compile::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cast_before_weight: bool) -> torch.Tensor:
    """RMSNorm over the last dimension; see the module docstring for the rounding contract."""
    return rms_norm_native(x, weight, eps, cast_before_weight)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, cast_before_weight):
    return torch.empty_like(
        x, dtype=rms_norm_out_dtype(x, weight, cast_before_weight), memory_format=torch.contiguous_format
    )


RMS_NORM = register_fused_op(
    FusedOp(
        name="rms_norm",
        overload=torch.ops.omni_compile.rms_norm.default,
        arg_names=("x", "weight", "eps", "cast_before_weight"),
        native=rms_norm_native,
    )
)
