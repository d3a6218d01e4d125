"""AdaLN modulation: rewrite `norm(x) * (1 + scale) + shift` into `omni_compile::adaln`.

Matches, on the post-grad graph, the modulations DiTs write after a norm without affine parameters:

    LayerNorm in x's dtype (FLUX's and SD3's AdaLayerNormZero, PixArt, Sana, HunyuanVideo, ...):
        LayerNorm(x) * (1 + scale) + shift     -> adaln(x, scale, shift, eps, "layer", round_norm=True)
        LayerNorm(x) * (1 + scale)             -> adaln(x, scale, None, eps, "layer", round_norm=True)
        LayerNorm(x) * (1 + scale)[:, None] + shift[:, None]   ([B, D] conditioning, AdaLayerNormContinuous)
    RMSNorm without weight (LTX-Video's norm1/norm2, Mochi, ...), as the rms_norm pass leaves it (one op):
        rms_norm(x) * (1 + scale) + shift      -> adaln(x, scale, shift, eps, "rms", round_norm=True)
        rms_norm(x) * (1 + scale)              -> adaln(x, scale, None, eps, "rms", round_norm=True)
    fp32 LayerNorm of an upcast (Wan's norm1, norm3):
        (FP32LayerNorm(x.float()) * (1 + scale) + shift).type_as(x)
                                               -> adaln(x, scale, shift, eps, "layer", round_norm=False)

for fp32/bf16/fp16 activations, scale/shift in the activation dtype (fp32 for the Wan form), however the
conditioning was split (chunk, unbind, slicing: the pattern starts at the tensors), per-sample [B, 1, D]
or per-token [B, S, D], and any eps. `extra_check` guards that the statistics reduce the last dimension
only with a biased variance, that x is [B, S, D], that scale and shift broadcast along it without
changing its shape, that the result has x's dtype (a modulation in another dtype would promote it) and
that an RMSNorm has no weight. The norm is rounded to x's dtype before modulating where the unfused
graph stores it in that dtype (`round_norm`); the modulation is computed in fp32 and rounded once, as
Inductor computes the unfused chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from omni_compile.ops import adaln as _ops  # noqa: F401  (registers omni_compile::adaln)
from omni_compile.ops import rms_norm as _rms  # noqa: F401  (registers omni_compile::rms_norm, in the RMS patterns)
from omni_compile.passes.base import PatternPass

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE = ("scale",)


def flux_adaln(x, scale, shift, eps):
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


def wan_adaln(x, scale, shift, eps):
    return (F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale) + shift).type_as(x)


def layer_scale_only(x, scale, eps):
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale)


def flux_adaln_2d(x, scale, shift, eps):
    # [B, D] conditioning broadcast after the `1 +`: `norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]`
    # (diffusers' AdaLayerNormContinuous, SD3's last context norm)
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale).unsqueeze(1) + shift.unsqueeze(1)


def fused_adaln_2d(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale.unsqueeze(1), shift.unsqueeze(1), eps, "layer", True)


def rms_adaln(x, scale, shift, eps):
    # The RMSNorm without weight as the rms_norm pass leaves it: one op, in x's dtype.
    return torch.ops.omni_compile.rms_norm(x, None, eps, False) * (1 + scale) + shift


def rms_scale_only(x, scale, eps):
    return torch.ops.omni_compile.rms_norm(x, None, eps, False) * (1 + scale)


def fused_layer_scale_only(x, scale, eps):
    return torch.ops.omni_compile.adaln(x, scale, None, eps, "layer", True)


def fused_rms_adaln(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale, shift, eps, "rms", True)


def fused_rms_scale_only(x, scale, eps):
    return torch.ops.omni_compile.adaln(x, scale, None, eps, "rms", True)


def fused_adaln_rounded(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale, shift, eps, "layer", True)


def fused_adaln(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale, shift, eps, "layer", False)


def _check(traced_x: torch.dtype | None, mod_fp32: bool, names: tuple[str, ...] = ("scale", "shift"), rank: int = 3):
    # Dtype literals are ignored when patterns are compared, so the bf16 and fp16 chains of a form are
    # one registration: the check accepts every activation dtype of the same structure (fp32 chains
    # have no casts) with scale/shift in the activation dtype (FLUX form) or fp32 (Wan form).
    def check(match: Match) -> bool:
        if not all(isinstance(match.kwargs.get(n), torch.fx.Node) for n in ("x", *names)):
            return False
        x = match.kwargs["x"].meta["val"]
        x_dtype = x.dtype
        mod_dtype = torch.float32 if mod_fp32 else x_dtype
        if x_dtype not in DTYPES:
            return False
        if traced_x is not None and (x_dtype == torch.float32) != (traced_x == torch.float32):
            return False  # a LayerNorm chain's casts depend on the dtype; an RMSNorm op's do not (None)
        if x.dim() != 3 or not isinstance(match.kwargs.get("eps"), float):
            return False
        b, s, d = x.shape
        if match.output_node().meta["val"].dtype != x_dtype:
            return False  # a modulation in another dtype promotes the result: not this op's contract
        for name in names:
            t = match.kwargs[name].meta["val"]
            if t.dim() == 2 and rank == 2:  # [B or 1, D], unsqueezed to [B or 1, 1, D] in the pattern
                t = t.unsqueeze(1)
            if t.dtype != mod_dtype or t.dim() != 3 or t.shape[2] != d:
                return False
            if t.shape[0] not in (1, b) or t.shape[1] not in (1, s):
                return False
        for node in match.nodes:
            if node.target == torch.ops.omni_compile.rms_norm.default and node.args[1] is not None:
                return False  # an RMSNorm with a weight: not a plain norm before the modulation
            if node.target == aten.var_mean.correction:
                dims = [dim % 3 for dim in node.args[1]]
                if dims != [2] or node.kwargs.get("correction", 1) != 0 or not node.kwargs.get("keepdim", False):
                    return False
        return True

    return check


class AdaLNPass(PatternPass):
    """Rewrites a norm without affine parameters followed by `* (1 + scale) [+ shift]` into `omni_compile::adaln`."""

    name = "adaln"

    def register_patterns(self) -> None:
        eps = {"eps": 1e-6}
        for x_dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(2, 4, 8, dtype=x_dtype)
            mod = torch.empty(2, 1, 8, dtype=x_dtype)
            mod32 = torch.empty(2, 1, 8)
            self.register(flux_adaln, fused_adaln_rounded, [x, mod, mod.clone(), 1e-6], _check(x_dtype, False), eps)
            self.register(layer_scale_only, fused_layer_scale_only, [x, mod, 1e-6], _check(x_dtype, False, SCALE), eps)
            mod2 = torch.empty(2, 8, dtype=x_dtype)
            check = _check(x_dtype, False, rank=2)
            self.register(flux_adaln_2d, fused_adaln_2d, [x, mod2, mod2.clone(), 1e-6], check, eps)
            if x_dtype != torch.float32:
                self.register(wan_adaln, fused_adaln, [x, mod32, mod32.clone(), 1e-6], _check(x_dtype, True), eps)
        # RMSNorm forms (LTX-Video's norm1/norm2, Mochi's, ...): the rms_norm pass has made the norm an op, so
        # the chain has no casts and one registration serves every dtype.
        x, mod = torch.empty(2, 4, 8), torch.empty(2, 1, 8)
        self.register(rms_adaln, fused_rms_adaln, [x, mod, mod.clone(), 1e-6], _check(None, False), eps)
        self.register(rms_scale_only, fused_rms_scale_only, [x, mod, 1e-6], _check(None, False, SCALE), eps)
