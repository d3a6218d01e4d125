"""Gated residual: rewrite `x + gate * y` after attention and MLP into `omni_compile::gated_residual`.

Matches the forms the models write, for fp32/bf16/fp16 activations and a gate in the activation
dtype or fp32:

    FLUX:       x + gate * y                                  (gate [B, 1, D], all in x's dtype), and the
                x + y * gate, gate * y + x, y * gate + x      other operand orders (HiDream: gate * y + x)
    Wan attn:   (x.float() + y * gate).type_as(x)             (fp32 gate)
    Wan FFN:    (x.float() + y.float() * gate).type_as(x)

`extra_check` guards that x and y are the same [B, S, D] shape and the gate broadcasts along it
([B or 1, S or 1, D]) without changing the output shape.
"""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import Match

from omni_compile.ops import gated_residual as _ops  # noqa: F401  (registers omni_compile::gated_residual)
from omni_compile.passes.base import PatternPass

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flux_gated(x, gate, y):
    return x + gate * y


def flux_gated_swapped(x, gate, y):
    return x + y * gate


def gated_first(x, gate, y):
    return gate * y + x


def gated_first_swapped(x, gate, y):
    return y * gate + x


def wan_gated_attn(x, gate, y):
    return (x.float() + y * gate).type_as(x)


def wan_gated_ffn(x, gate, y):
    return (x.float() + y.float() * gate).type_as(x)


def fused_gated(x, gate, y):
    return torch.ops.omni_compile.gated_residual(x, y, gate)


def _check(dtypes: set[tuple[torch.dtype, torch.dtype, torch.dtype]]):
    # Forms without casts trace to one graph for every dtype (the matcher keeps the first of identical
    # patterns), so a check lists every (x, y, gate) dtype combination its form stands for.
    def check(match: Match) -> bool:
        if not all(isinstance(match.kwargs.get(n), torch.fx.Node) for n in ("x", "y", "gate")):
            return False
        x, y, gate = (match.kwargs[n].meta["val"] for n in ("x", "y", "gate"))
        if (x.dtype, y.dtype, gate.dtype) not in dtypes:
            return False
        if x.dim() != 3 or tuple(y.shape) != tuple(x.shape) or gate.dim() != 3:
            return False
        b, s, d = x.shape
        return gate.shape[2] == d and gate.shape[0] in (1, b) and gate.shape[1] in (1, s)

    return check


class GatedResidualPass(PatternPass):
    """Rewrites `x + gate * y` residual updates (FLUX and Wan forms) into `omni_compile::gated_residual`."""

    name = "gated_residual"
    # Off by default: on the H200 its kernel only ties Inductor's (0.98x on W1, 1.00x on W2; see
    # docs/passes.md), and Inductor fuses the unfused add into the next norm; end to end on W1 it cost 1.5%.
    enabled_by_default = False

    def register_patterns(self) -> None:
        same = {(d, d, d) for d in DTYPES}
        x = torch.empty(2, 4, 8)
        # ATen keeps the operand order the model wrote, and a pattern matches one order: every order of the
        # product and the sum
        for fn in (flux_gated, flux_gated_swapped, gated_first, gated_first_swapped):
            self.register(fn, fused_gated, [x, torch.empty(2, 1, 8), x.clone()], _check(same))
        # The casts' dtype literals are ignored when patterns are compared: one registration per form
        # serves bf16 and fp16.
        x = torch.empty(2, 4, 8, dtype=torch.bfloat16)
        g32 = torch.empty(2, 1, 8, dtype=torch.float32)
        wan = {(d, d, torch.float32) for d in DTYPES[1:]}
        self.register(wan_gated_attn, fused_gated, [x, g32, x.clone()], _check(wan))
        self.register(wan_gated_ffn, fused_gated, [x, g32, x.clone()], _check(wan))
