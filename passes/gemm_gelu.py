"""GEMM + tanh-GELU: run the GELU in the GEMM's epilogue (`aten._addmm_activation(..., use_gelu=True)`).

Matches `gelu(linear(x, w, b), approximate="tanh")` (diffusers' `GELU(approximate="tanh")`, the FFN of FLUX
and Wan and of most DiTs) in the post-grad graph: the decomposed tanh-GELU chain, fp32 or with the
half-precision upcast and downcast, applied to a linear's output, which is `addmm(b, x, wᵀ)` or, where
Inductor unfused the bias for its pointwise user on a GPU, `b + mm(x, wᵀ)`, possibly through a reshape
back to [B, S, N]. The chain becomes `_addmm_activation(b, x, wᵀ, use_gelu=True)` (then the reshape):
on CUDA, cuBLASLt's bias+GELU epilogue, so the GEMM's output is written once, already activated, instead
of written, read back by a GELU kernel and written again (for W2's FFN, 32760 x 8960 bf16: 590 MB of
traffic per block saved).

Correctness: the epilogue computes tanh-GELU on the fp32 accumulator and rounds to the output dtype
once; the unfused chain rounds the GEMM output to that dtype first, then computes GELU in fp32 and
rounds again. The fused result is the closer of the two to the exact value (one rounding fewer). Where
cuBLASLt's conditions fail, torch computes `addmm` then tanh-GELU: the unfused chain's values. Exact
(erf) GELU is left alone: cuBLASLt's epilogue is the tanh form only.

CUDA (and ROCm) tensors only: on the CPU `_addmm_activation(use_gelu=True)` computes the exact (erf) GELU
(torch's decomposition says so too), so there the rewrite would change the values; the pass does not
apply on a CPU platform and its handler refuses tensors on another device. Rewritten only when the
linear's output and the reshape feed nothing but this GELU, the bias is 1-D of the GEMM's width and
every operand has the same floating dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from omni_compile.passes.base import PatternPass, _source

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default)


def tanh_gelu(y):
    return F.gelu(y, approximate="tanh")


def _linear(node: torch.fx.Node):
    """(bias, mat1, mat2) when `node` is `addmm(b, x, w)` (alpha = beta = 1) or `b + mm(x, w)`, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.addmm.default:
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1 or len(node.args) != 3:
            return None
        return node.args
    if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        for mm, bias in (node.args, node.args[::-1]):
            if isinstance(mm, torch.fx.Node) and mm.target is aten.mm.default and len(mm.users) == 1:
                return bias, *mm.args
    return None


def _gelu_is_tanh_on(device: torch.device) -> bool:
    """`_addmm_activation(use_gelu=True)` is tanh-GELU on CUDA (and ROCm) tensors, exact GELU on the CPU."""
    return device.type == "cuda"


def _rewrite(match, y: torch.fx.Node, *, rewrites: list[int]) -> None:
    graph = match.graph
    out = match.output_node()
    src, shape = (y.args[0], y.args[1]) if y.target in RESHAPES else (y, None)
    if not all(u in match.nodes for u in y.users) or (shape is not None and len(src.users) != 1):
        return  # the linear's output is used elsewhere too: keep it
    found = _linear(src)
    if found is None:
        return
    bias, mat1, mat2 = found
    if not all(isinstance(t, torch.fx.Node) and isinstance(t.meta.get("val"), torch.Tensor) for t in found):
        return
    b, m1, m2, o = bias.meta["val"], mat1.meta["val"], mat2.meta["val"], out.meta["val"]
    dtypes = {b.dtype, m1.dtype, m2.dtype, o.dtype}
    if len(dtypes) != 1 or not dtypes.pop().is_floating_point or m1.dim() != 2 or m2.dim() != 2:
        return
    if not _gelu_is_tanh_on(o.device):
        return
    if b.dim() != 1 or b.shape[0] != m2.shape[1]:
        return
    with graph.inserting_before(out):
        act = graph.call_function(aten._addmm_activation.default, (bias, mat1, mat2), {"use_gelu": True})
        act.meta.update(src.meta)
        result = act
        if shape is not None:
            result = graph.call_function(aten.reshape.default, (act, shape))
            result.meta.update(y.meta)
    out.replace_all_uses_with(result)
    match.erase_nodes()
    rewrites[0] += 1


class GemmGeluPass(PatternPass):
    """Moves tanh-GELU after a linear into the GEMM's epilogue (`aten._addmm_activation`)."""

    name = "gemm_gelu"

    def is_applicable(self, platform, config) -> bool:
        return platform.kind in ("cuda", "rocm")

    def register_patterns(self) -> None:
        from torch._inductor.pattern_matcher import gen_pattern

        from omni_compile.passes.base import _trace_like_post_grad

        self._extra_sources += [_source(tanh_gelu), _source(_rewrite), _source(_linear), _source(_gelu_is_tanh_on)]
        self._rewrites = [0]
        for dtype in (torch.float32, torch.bfloat16):  # fp16 traces as bf16 does (dtype literals are ignored)
            self._pending.append(
                lambda dtype=dtype: self._register_gelu(
                    gen_pattern(tanh_gelu, [torch.empty(4, 8, dtype=dtype)], _trace_like_post_grad)
                )
            )

    def _register_gelu(self, pattern) -> None:
        from torch._inductor.pattern_matcher import register_graph_pattern

        register_graph_pattern(pattern, pass_dict=self.patterns)(functools.partial(_rewrite, rewrites=self._rewrites))

    def apply(self, graph: torch.fx.Graph) -> int:
        # The matcher counts every match its handler saw; the handler counts the ones it rewrote.
        self.materialize()
        self._rewrites[0] = 0
        self.patterns.apply(graph)
        return self._rewrites[0]
