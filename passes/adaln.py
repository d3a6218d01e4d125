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
    a norm with its own affine parameters, then the modulation:
        LayerNorm(x; weight, bias) * (1 + scale)[:, None] + shift[:, None]     (CogVideoX), or per token
                                               -> adaln(..., "layer", True, weight, bias)
        RMSNorm(x; weight) * (1 + scale[:, None]) [+ shift]     (Lumina2; diffusers' RMSNorm, whose weight
                                               rounds as `cast_before_weight`; in fp32 the torch flag)
                                               -> adaln(..., "rms", True, weight, None, cast_before_weight)

for fp32/bf16/fp16 activations, scale/shift in the activation dtype (fp32 for the Wan form), however the
conditioning was split (chunk, unbind, slicing: the pattern starts at the tensors), per-sample [B, 1, D]
or per-token [B, S, D], and any eps. `extra_check` guards that the statistics reduce the last dimension
only with a biased variance, that x is [B, S, D], that scale and shift broadcast along it without
changing its shape, that the result has x's dtype (a modulation in another dtype would promote it) and
that a norm's weight and bias are [D] (an RMSNorm weight only in the cast-before-weight convention, or
in fp32). The norm is rounded to x's dtype before modulating where the unfused
graph stores it in that dtype (`round_norm`); the modulation is computed in fp32 and rounded once, as
Inductor computes the unfused chain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._inductor.pattern_matcher import Match

from omni_compile.ops import adaln as _ops  # noqa: F401  (registers omni_compile::adaln)
from omni_compile.ops import rms_norm as _rms  # noqa: F401  (registers omni_compile::rms_norm, in the RMS patterns)
from omni_compile.passes.base import PatternPass

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE = ("scale",)


def search_forms(first: bool) -> dict[str, Callable]:
    """The search functions of the forms, with the modulation written `norm * (1 + scale)` or, `first`,
    `(1 + scale) * norm` (Flux2 writes it so): ATen keeps the operand order a model wrote, and a pattern matches
    one order."""

    def mod(norm, factor):
        return factor * norm if first else norm * factor

    def flux_adaln(x, scale, shift, eps):
        return mod(F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale) + shift

    def wan_adaln(x, scale, shift, eps):
        return (mod(F.layer_norm(x.float(), (x.shape[-1],), eps=eps), 1 + scale) + shift).type_as(x)

    def layer_scale_only(x, scale, eps):
        return mod(F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)

    def flux_adaln_2d(x, scale, shift, eps):
        # [B, D] conditioning broadcast after the `1 +`: `norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]`
        # (diffusers' AdaLayerNormContinuous, SD3's last context norm)
        return mod(F.layer_norm(x, (x.shape[-1],), eps=eps), (1 + scale).unsqueeze(1)) + shift.unsqueeze(1)

    def rms_adaln(x, scale, shift, eps):
        # The RMSNorm without weight as the rms_norm pass leaves it: one op, in x's dtype.
        return mod(torch.ops.omni_compile.rms_norm(x, None, eps, False), 1 + scale) + shift

    def rms_scale_only(x, scale, eps):
        return mod(torch.ops.omni_compile.rms_norm(x, None, eps, False), 1 + scale)

    def layer_affine_adaln(x, weight, bias, scale, shift, eps):
        return mod(F.layer_norm(x, (x.shape[-1],), weight, bias, eps=eps), 1 + scale) + shift

    def layer_affine_adaln_2d(x, weight, bias, scale, shift, eps):
        # CogVideoX: `norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]`
        norm = F.layer_norm(x, (x.shape[-1],), weight, bias, eps=eps)
        return mod(norm, (1 + scale).unsqueeze(1)) + shift.unsqueeze(1)

    return {f.__name__: f for f in (flux_adaln, wan_adaln, layer_scale_only, flux_adaln_2d, rms_adaln, rms_scale_only,
                                    layer_affine_adaln, layer_affine_adaln_2d)}  # fmt: skip


def fused_adaln_2d(x, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale.unsqueeze(1), shift.unsqueeze(1), eps, "layer", True)


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


def fused_layer_affine(x, weight, bias, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale, shift, eps, "layer", True, weight, bias, False)


def fused_layer_affine_2d(x, weight, bias, scale, shift, eps):
    return torch.ops.omni_compile.adaln(x, scale.unsqueeze(1), shift.unsqueeze(1), eps, "layer", True, weight, bias,
                                        False)  # fmt: skip


def rms_weight_forms(cbw: bool, first: bool = False) -> list:
    """(pattern, replacement, which) of an RMSNorm with a weight, then the modulation (Lumina2), for the norm's
    rounding flag: diffusers' cast before the weight in half precision, the torch flag in fp32 (where the rms_norm
    pass folds diffusers' separate weight multiply into the op: all fp32, the same values). torch's
    re-check of a candidate compares that literal: one registration per flag. `first`: `(1 + scale) * norm`."""

    def mod(norm, factor):
        return factor * norm if first else norm * factor

    def rms_weight_adaln(x, weight, scale, shift, eps):
        return mod(torch.ops.omni_compile.rms_norm(x, weight, eps, cbw), 1 + scale) + shift

    def rms_weight_scale_only(x, weight, scale, eps):
        return mod(torch.ops.omni_compile.rms_norm(x, weight, eps, cbw), 1 + scale)

    def rms_weight_scale_only_2d(x, weight, scale, eps):
        # Lumina2: `norm(x) * (1 + scale[:, None])` (the unsqueeze before the `1 +`)
        return mod(torch.ops.omni_compile.rms_norm(x, weight, eps, cbw), 1 + scale.unsqueeze(1))

    def fused_rms_weight_adaln(x, weight, scale, shift, eps):
        return torch.ops.omni_compile.adaln(x, scale, shift, eps, "rms", True, weight, None, cbw)

    def fused_rms_weight_scale_only(x, weight, scale, eps):
        return torch.ops.omni_compile.adaln(x, scale, None, eps, "rms", True, weight, None, cbw)

    def fused_rms_weight_scale_only_2d(x, weight, scale, eps):
        return torch.ops.omni_compile.adaln(x, scale.unsqueeze(1), None, eps, "rms", True, weight, None, cbw)

    return [(rms_weight_adaln, fused_rms_weight_adaln, "shift"), (rms_weight_scale_only, fused_rms_weight_scale_only,
            "scale"), (rms_weight_scale_only_2d, fused_rms_weight_scale_only_2d, "scale-2d")]  # fmt: skip


def _affine_ok(match: Match, x: torch.Tensor) -> bool:
    """The norm's own weight/bias are [D] of a float dtype; an RMSNorm weight rounds before multiplying
    (`cast_before_weight`, diffusers' convention: what the fused replacement computes) unless all is fp32."""
    for name in ("weight", "bias"):
        t = match.kwargs.get(name)
        if t is None:
            continue
        if not isinstance(t, torch.fx.Node):
            return False
        v = t.meta["val"]
        if v.dim() != 1 or v.shape[0] != x.shape[-1] or v.dtype not in DTYPES:
            return False
    for node in match.nodes:
        if node.target == torch.ops.omni_compile.rms_norm.default and node.args[1] is not None:
            w = node.args[1].meta["val"]
            if not node.args[3] and not (w.dtype == x.dtype == torch.float32):
                return False
    return True


def _check(traced_x: torch.dtype | None, mod_fp32: bool, names: tuple[str, ...] = ("scale", "shift"), rank: int = 3,
           affine: bool = False, fp32_only: bool = False):  # fmt: skip
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
        if affine and not _affine_ok(match, x):
            return False
        if fp32_only and x_dtype != torch.float32:
            return False  # in half precision the chain rounds the norm before the weight: not this replacement
        for node in match.nodes:
            if not affine and node.target == torch.ops.omni_compile.rms_norm.default and node.args[1] is not None:
                return False  # an RMSNorm with a weight: the affine forms take it
            if node.target == aten.var_mean.correction:
                dims = [dim % 3 for dim in node.args[1]]
                if dims != [2] or node.kwargs.get("correction", 1) != 0 or not node.kwargs.get("keepdim", False):
                    return False
        return True

    return check


class AdaLNPass(PatternPass):
    """Rewrites a norm (with or without its own affine) followed by `* (1 + scale) [+ shift]` into `omni_compile::adaln`."""

    name = "adaln"

    def register_patterns(self) -> None:
        for first in (False, True):
            self._register_forms(search_forms(first), first)

    def _register_forms(self, f: dict[str, Callable], first: bool) -> None:
        eps = {"eps": 1e-6}
        for x_dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(2, 4, 8, dtype=x_dtype)
            mod = torch.empty(2, 1, 8, dtype=x_dtype)
            mod32 = torch.empty(2, 1, 8)
            self.register(f["flux_adaln"], fused_adaln_rounded, [x, mod, mod.clone(), 1e-6], _check(x_dtype, False), eps)
            self.register(f["layer_scale_only"], fused_layer_scale_only, [x, mod, 1e-6], _check(x_dtype, False, SCALE),
                          eps)  # fmt: skip
            mod2 = torch.empty(2, 8, dtype=x_dtype)
            check = _check(x_dtype, False, rank=2)
            self.register(f["flux_adaln_2d"], fused_adaln_2d, [x, mod2, mod2.clone(), 1e-6], check, eps)
            if x_dtype != torch.float32:
                self.register(f["wan_adaln"], fused_adaln, [x, mod32, mod32.clone(), 1e-6], _check(x_dtype, True), eps)
            # a LayerNorm with weight and bias, then the modulation (CogVideoX)
            w, b = torch.empty(8, dtype=x_dtype), torch.empty(8, dtype=x_dtype)
            check = _check(x_dtype, False, affine=True)
            self.register(f["layer_affine_adaln"], fused_layer_affine, [x, w, b, mod, mod.clone(), 1e-6], check, eps)
            check = _check(x_dtype, False, rank=2, affine=True)
            self.register(f["layer_affine_adaln_2d"], fused_layer_affine_2d, [x, w, b, mod2, mod2.clone(), 1e-6], check,
                          eps)  # fmt: skip
        # RMSNorm forms (LTX-Video's norm1/norm2, Mochi's, ...): the rms_norm pass has made the norm an op, so
        # the chain has no casts and one registration serves every dtype.
        x, mod = torch.empty(2, 4, 8), torch.empty(2, 1, 8)
        self.register(f["rms_adaln"], fused_rms_adaln, [x, mod, mod.clone(), 1e-6], _check(None, False), eps)
        self.register(f["rms_scale_only"], fused_rms_scale_only, [x, mod, 1e-6], _check(None, False, SCALE), eps)
        # an RMSNorm with a weight, then the modulation (Lumina2): diffusers' rounding, or all fp32
        w, mod2 = torch.empty(8), torch.empty(2, 8)
        for cbw in (True, False):
            for search, replace, which in rms_weight_forms(cbw, first):
                names, rank = {"shift": (("scale", "shift"), 3), "scale": (SCALE, 3), "scale-2d": (SCALE, 2)}[which]
                example = {"shift": [x, w, mod, mod.clone(), 1e-6], "scale": [x, w, mod, 1e-6],
                           "scale-2d": [x, w, mod2, 1e-6]}[which]  # fmt: skip
                check = _check(None, False, names, rank=rank, affine=True, fp32_only=not cbw)
                self.register(search, replace, example, check, eps, skip_duplicates=cbw)
