"""RMSNorm fusion: rewrite the decomposed RMSNorm chain into `omni_compile::rms_norm`.

Matches, on the post-grad ATen graph, the chain every RMSNorm becomes after decomposition,

    xf = x.to(float32); r = rsqrt(mean(xf ** 2, -1, keepdim=True) + eps); y = x * r
    torch semantics:     out = (y * weight).to(x.dtype)
    diffusers semantics: out = y.to(weight.dtype) * weight         (half-precision weight)
    no weight:           out = y.to(x.dtype)

for fp32/bf16/fp16 inputs and any eps, and also a surviving `aten._fused_rms_norm(...)[0]`. It
produces one `omni_compile::rms_norm` call whose native implementation rounds exactly where the
matched chain rounds, so the rewrite changes no value. `extra_check` guards that the mean reduces
the last dimension only, the power is 2, the weight covers that dimension, and the dtypes are those
the variant was traced with (the dtype decides which rounding convention the chain encodes). Those
checks read every literal of the chain, so the patterns are registered without torch's literal re-check
(`recheck=False`): eps matches however the torch release renders it.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

from omni_compile.ops import rms_norm as _ops  # noqa: F401  (registers omni_compile::rms_norm)
from omni_compile.passes.base import PatternPass

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- eager patterns: the code the models run ------------------------------------------------------------------
def torch_rms_norm(x, weight, eps):
    # What `torch.nn.RMSNorm` / `F.rms_norm` become after Inductor's decompositions (written out,
    # because tracing F.rms_norm eagerly takes the C++ composite, which adds eps in place).
    # The decomposition reduces over a non-negative dim, so variants are traced per input rank.
    xf = x.to(torch.float32)
    r = torch.rsqrt(torch.ops.aten.add.Scalar(xf.pow(2).mean(x.dim() - 1, keepdim=True), eps))
    return (xf * r * weight).to(x.dtype)


def torch_rms_norm_no_weight(x, eps):
    xf = x.to(torch.float32)
    r = torch.rsqrt(torch.ops.aten.add.Scalar(xf.pow(2).mean(x.dim() - 1, keepdim=True), eps))
    return (xf * r).to(x.dtype)


def diffusers_rms_norm(x, weight, eps):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight.dtype in HALF:
        y = y.to(weight.dtype)
    return y * weight


def diffusers_rms_norm_no_weight(x, eps):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


# --- replacements ---------------------------------------------------------------------------------------------
def fused_rms_norm(x, weight, eps):
    return torch.ops.omni_compile.rms_norm(x, weight, eps, False)


def fused_rms_norm_cast_first(x, weight, eps):
    return torch.ops.omni_compile.rms_norm(x, weight, eps, True)


def fused_rms_norm_no_weight(x, eps):
    return torch.ops.omni_compile.rms_norm(x, None, eps, False)


def _examples(dtype: torch.dtype) -> list[torch.Tensor]:
    """Example inputs of rank 2 to 4 ([tokens, dim], [batch, seq, dim], [batch, seq, heads, head_dim])."""
    return [torch.empty(*([2] * (rank - 1)), 8, dtype=dtype) for rank in (2, 3, 4)]


def _reduces_last_dim_only(match: Match) -> bool:
    for node in match.nodes:
        if node.target == aten.mean.dim:
            rank = node.args[0].meta["val"].dim()
            dims = [d % rank for d in node.args[1]]
            if dims != [rank - 1] or not (len(node.args) > 2 and node.args[2]):
                return False
        elif node.target == aten.pow.Tensor_Scalar and node.args[1] != 2:
            return False
    return True


def _dtype_check(traced_x: torch.dtype, weight_ok=None):
    """Check for a chain traced with activations of dtype `traced_x`.

    Dtype literals are ignored when patterns are compared, so the bf16 and fp16 chains of one form are
    one registration (fp32 chains differ: they have no casts). The check accepts every activation
    dtype of the traced structure, and weights for which `weight_ok(x_dtype, w_dtype)` holds.
    """

    def check(match: Match) -> bool:
        # anything not a node is not our chain
        names = ("x", "weight") if weight_ok is not None else ("x",)
        if not all(isinstance(match.kwargs.get(n), torch.fx.Node) for n in names):
            return False
        x = match.kwargs["x"].meta["val"]
        if x.dtype not in DTYPES or (x.dtype == torch.float32) != (traced_x == torch.float32):
            return False
        if not isinstance(match.kwargs.get("eps"), float):
            return False
        out_dtype = x.dtype
        if weight_ok is not None:
            w = match.kwargs["weight"].meta["val"]
            if not weight_ok(x.dtype, w.dtype) or tuple(w.shape) != (x.shape[-1],):
                return False
            if weight_ok is _cast_first_weight:
                out_dtype = w.dtype
        # the chain's casts (their dtype literals are not compared): the result has the dtype the op returns
        if match.output_node().meta["val"].dtype != out_dtype:
            return False
        for node in match.nodes:  # the statistics are taken in fp32
            if node.target == aten.mean.dim and node.meta["val"].dtype != torch.float32:
                return False
        return _reduces_last_dim_only(match)

    return check


def _torch_weight(x_dtype, w_dtype):
    return w_dtype in (x_dtype, torch.float32)


def _cast_first_weight(x_dtype, w_dtype):
    return w_dtype in HALF and x_dtype in (w_dtype, torch.float32)


def _fp32_weight(x_dtype, w_dtype):
    return x_dtype == w_dtype == torch.float32


class RMSNormPass(PatternPass):
    """Rewrites decomposed RMSNorm chains (torch and diffusers conventions) into `omni_compile::rms_norm`."""

    name = "rms_norm"
    OPTIONS = {"semantics": ["torch", "diffusers"]}

    def register_patterns(self) -> None:
        semantics = set(self.options["semantics"])
        unknown = semantics - {"torch", "diffusers"}
        if unknown:
            from omni_compile.errors import ConfigError

            raise ConfigError(f"rms_norm option 'semantics' accepts 'torch' and 'diffusers', not {sorted(unknown)}")
        eps = {"eps": 1e-6}
        for x_dtype in (torch.float32, torch.bfloat16):
            w = torch.empty(8, dtype=x_dtype)
            if "torch" in semantics:
                for x in _examples(x_dtype):
                    self.register(torch_rms_norm, fused_rms_norm, [x, w, 1e-6], _dtype_check(x_dtype, _torch_weight),
                                  eps, recheck=False)  # fmt: skip
                    self.register(torch_rms_norm_no_weight, fused_rms_norm_no_weight, [x, 1e-6], _dtype_check(x_dtype),
                                  eps, recheck=False)  # fmt: skip
            if "diffusers" in semantics:
                x = torch.empty(2, 4, 8, dtype=x_dtype)
                half_w = torch.empty(8, dtype=torch.bfloat16)
                check = _dtype_check(x_dtype, _cast_first_weight)
                self.register(diffusers_rms_norm, fused_rms_norm_cast_first, [x, half_w, 1e-6], check, eps, recheck=False)
                if x_dtype == torch.float32:  # fp32 all through: both roundings are the same, the torch flag
                    check = _dtype_check(x_dtype, _fp32_weight)
                    self.register(diffusers_rms_norm, fused_rms_norm, [x, w, 1e-6], check, eps, recheck=False)
                check = _dtype_check(x_dtype)
                self.register(diffusers_rms_norm_no_weight, fused_rms_norm_no_weight, [x, 1e-6], check, eps, recheck=False)
        if "torch" in semantics:
            self._register_fused_aten_op()

    def _register_fused_aten_op(self) -> None:
        # Where torch keeps `_fused_rms_norm` (it is in the core decompositions, so Inductor's graphs
        # normally hold the chain above), take its normalised output when the rstd output is unused.
        fused = CallFunction(
            aten._fused_rms_norm.default,
            KeywordArg("x"),
            KeywordArg("normalized_shape"),
            KeywordArg("weight"),
            KeywordArg("eps"),
            _users=1,
        )
        pattern = CallFunction(operator.getitem, fused, 0)

        def only_last_dim(match: Match) -> bool:
            x = match.kwargs["x"].meta["val"]
            return list(match.kwargs["normalized_shape"]) == [x.shape[-1]] and match.kwargs["eps"] is not None

        def replace_fused_aten_rms_norm(match: Match, x, normalized_shape, weight, eps):
            if weight is None:
                match.replace_by_example(lambda x: torch.ops.omni_compile.rms_norm(x, None, eps, False), [x])
            else:
                match.replace_by_example(lambda x, w: torch.ops.omni_compile.rms_norm(x, w, eps, False), [x, weight])

        self.register_handler(pattern, replace_fused_aten_rms_norm, only_last_dim)
