"""`omni_compile::gated_residual`: `x + gate * y`, the gated residual after attention and MLP.

Numerical contract: computed in fp32 from x, y and gate in their own dtypes, rounded once to
`x.dtype` (FLUX's bf16 `x + gate * y` as Inductor compiles it; Wan's `(x.float() + y * gate).type_as(x)`).

Shapes: `x` and `y` are [B, S, D]; `gate` is [B or 1, S or 1, D], any strides.
"""

from __future__ import annotations

import torch

from omni_compile.ops.registry import FusedOp, register_fused_op


def gated_residual_native(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) + y.to(torch.float32) * gate.to(torch.float32)).to(x.dtype)


@torch.library.custom_op("omni_compile::gated_residual", mutates_args=())
def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`x + gate * y` in fp32, rounded once to x.dtype."""
    return gated_residual_native(x, y, gate)


@gated_residual.register_fake
def _gated_residual_fake(x, y, gate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


GATED_RESIDUAL = register_fused_op(
    FusedOp(
        name="gated_residual",
        overload=torch.ops.omni_compile.gated_residual.default,
        arg_names=("x", "y", "gate"),
        native=gated_residual_native,
    )
)
