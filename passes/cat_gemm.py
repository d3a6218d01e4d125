"""Linear over a concatenation: `linear(cat([a, b, ...], -1), w, bias)` as a sum of linears, no cat.

Matches a GEMM (`mm`, or `addmm` with alpha = beta = 1) whose left operand is a concatenation along
the contraction dimension, directly or through the reshape that flattens its leading dimensions
([B, S, Ka + Kb] -> [B*S, Ka + Kb]); FLUX's single block writes `proj_out(cat([attn, mlp], dim=2))`. It
becomes `omni_compile::linear_parts([a, b, ...], wᵀ, bias)` (omni_compile/ops/linear_parts.py): one GEMM
per part over a view of the transposed weight (cuBLAS reads it in place, with the full row as leading
dimension), each later part accumulated in place into the first one's output. What goes away is writing
the concatenation and reading it back: for FLUX-dev at 1024² that is 4608 x 15360 bf16 (141 MB) written
and read per single block, against the first GEMM's output (4608 x 3072) read once more by the second.
Written as ATen ops, the accumulation (`addmm(acc, b, w)`) would copy `acc` first; the op does not.

Correctness: the same sum of products, in another order; the partial sum is rounded to the output
dtype between the GEMMs (one rounding more in bf16, well within the lossless bound). Rewritten only
when the concatenation and its reshape feed nothing else. On by default on GPUs; the CPU keeps the
graph as it is (its GEMMs are not what limits a CPU build).
"""

from __future__ import annotations

import torch

import omni_compile.ops  # noqa: F401  (registers omni_compile::linear_parts)
from omni_compile.passes.base import OmniPass, _source
from omni_compile.passes.lower_fused_ops import splice_body

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default)


def split_gemm(widths: list[int], parts: list[torch.Tensor], wt: torch.Tensor, bias: torch.Tensor | None):
    """sum_i parts_i @ wt[rows of part i] (+ bias): the parts flattened to [rows, K_i], one `linear_parts`
    (rows as -1: a symbolic row count stays symbolic)."""
    xs = [part.reshape(-1, k) for part, k in zip(parts, widths)]
    return torch.ops.omni_compile.linear_parts(xs, wt, bias)


class CatGemmPass(OmniPass):
    """Rewrites a GEMM over `cat([a, b, ...], -1)` into `linear_parts`: one GEMM per part, accumulated in place."""

    name = "cat_gemm"

    def __init__(self, options=None):
        super().__init__(options)
        self._extra_sources.append(_source(split_gemm))

    def is_applicable(self, platform, config) -> bool:
        return platform.kind in ("cuda", "rocm")

    def apply(self, graph: torch.fx.Graph) -> int:
        gemms = [n for n in graph.nodes if n.op == "call_function" and n.target in (aten.mm.default, aten.addmm.default)]
        return sum(self._rewrite(n) for n in gemms)

    def _rewrite(self, node: torch.fx.Node) -> int:
        if node.target is aten.addmm.default:
            if len(node.args) != 3 or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
                return 0
            bias, x, wt = node.args
        else:
            (x, wt), bias = node.args, None
        cat = x.args[0] if x.target in RESHAPES else x
        if not isinstance(cat, torch.fx.Node) or cat.target is not aten.cat.default or len(cat.users) != 1:
            return 0
        if x is not cat and len(x.users) != 1:
            return 0
        parts = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        ndim = cat.meta["val"].dim()
        if dim % ndim != ndim - 1 or len(parts) < 2 or not all(isinstance(p, torch.fx.Node) for p in parts):
            return 0
        widths = [int(p.meta["val"].shape[-1]) for p in parts]  # channels: static
        if any(k == 0 for k in widths) or sum(widths) != int(wt.meta["val"].shape[0]):
            return 0
        n = len(parts)
        bound = {f"p{i}": p for i, p in enumerate(parts)} | {"wt": wt, "bias": bias}

        def impl(wt, bias, **ps):
            return split_gemm(widths, [ps[f"p{i}"] for i in range(n)], wt, bias)

        splice_body(node, bound, impl)
        return 1
