"""AdaLN modulation: rewrite `norm(x) * (1 + scale) + shift` into `omni_compile::adaln`.

Matches, on the post-grad graph, the two forms the models write:

    FLUX (AdaLayerNormZero, norm2):  LayerNorm(x, no affine) in x's dtype, then * (1 + scale) + shift
                                     -> adaln(x, scale, shift, eps, "layer", round_norm=True)
    Wan (norm1, norm3):              (FP32LayerNorm(x.float()) * (1 + scale) + shift).type_as(x)
                                     -> adaln(x, scale, shift, eps, "layer", round_norm=False)

for fp32/bf16/fp16 activations, scale/shift in the activation dtype or fp32, per-sample [B, 1, D] or
per-token [B, S, D], and any eps. `extra_check` guards that the statistics reduce the last dimension
only with a biased variance, that x is [B, S, D], and that scale and shift broadcast along it
without changing its shape (a different broadcast is left alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from omni_compile.ops import adaln as _ops  # noqa: F401  (registers omni_compile::adaln)
from omni_compile.passes.base import PatternPass

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flux_adaln(x, scale, shift, eps):
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


def wan_adaln(x, scale, shift, eps):
    return (F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale) + shift).type_as(x)


def fused_adaln_rounded(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale, shift, eps, "layer", True)


def fused_adaln(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale, shift, eps, "layer", False)


def _check(traced_x: torch.dtype, mod_fp32: bool):
    # Dtype literals are ignored when patterns are compared, so the bf16 and fp16 chains of a form are
    # one registration: the check accepts every activation dtype of the same structure (fp32 chains
    # have no casts) with scale/shift in the activation dtype (FLUX form) or fp32 (Wan form).
    def check(match: Match) -> bool:
        if not all(isinstance(match.kwargs.get(n), torch.fx.Node) for n in ("x", "scale", "shift")):
            return False
        x = match.kwargs["x"].meta["val"]
        x_dtype = x.dtype
        mod_dtype = torch.float32 if mod_fp32 else x_dtype
        if x_dtype not in DTYPES or (x_dtype == torch.float32) != (traced_x == torch.float32):
            return False
        if x.dim() != 3 or not isinstance(match.kwargs.get("eps"), float):
            return False
        b, s, d = x.shape
        for name in ("scale", "shift"):
            t = match.kwargs[name].meta["val"]
            if t.dtype != mod_dtype or t.dim() != 3 or t.shape[2] != d:
                return False
            if t.shape[0] not in (1, b) or t.shape[1] not in (1, s):
                return False
        for node in match.nodes:
            if node.target == aten.var_mean.correction:
                dims = [dim % 3 for dim in node.args[1]]
                if dims != [2] or node.kwargs.get("correction", 1) != 0 or not node.kwargs.get("keepdim", False):
                    return False
        return True

    return check


class AdaLNPass(PatternPass):
    """Rewrites LayerNorm + `* (1 + scale) + shift` chains (FLUX and Wan forms) into `omni_compile::adaln`."""

    name = "adaln"

    def register_patterns(self) -> None:
        eps = {"eps": 1e-6}
        for x_dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(2, 4, 8, dtype=x_dtype)
            mod = torch.empty(2, 1, 8, dtype=x_dtype)
            mod32 = torch.empty(2, 1, 8)
            self.register(flux_adaln, fused_adaln_rounded, [x, mod, mod.clone(), 1e-6], _check(x_dtype, False), eps)
            if x_dtype != torch.float32:
                self.register(wan_adaln, fused_adaln, [x, mod32, mod32.clone(), 1e-6], _check(x_dtype, True), eps)
