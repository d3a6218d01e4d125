"""fp8 activations: fold a GELU into the row quantization that follows it, and quantize each tensor once.

An fp8 model (`--precision fp8`) quantizes every fp8 GEMM's input with `omni_compile::quant_rows(x, "none")`
(`omni_compile.ops.fp8.Fp8Linear`). Two rewrites on the post-grad graph:

- **GELU folding.** `quant_rows(gelu(y), "none")`, possibly through a reshape to rows, becomes
  `quant_rows(y, act)` with act "gelu_tanh" or "gelu": the MLP's activation is computed inside the
  quantization kernel, so the GELU's bf16 output is never written and read back (Wan's FFN: 32760 x 8960
  per block). Matched on the GELU's meaning: the decomposed tanh or erf chain, in fp32 or with the
  half-precision upcast and downcast, whatever module wrote it. Folded only when every user of the GELU's
  output is such a quantization; the op's contract rounds the activation to y's dtype first, as the
  unfused chain does, so the e4m3 rows are the same.
- **One quantization per tensor.** Quantizations of the same tensor with the same activation (q, k and v
  projections of one normed input) are merged into the first.
- **Norm folding.** A quantization that is the only reader of an `omni_compile::adaln` (the adaln pass ran
  before) becomes `omni_compile::adaln_quant`: the norm's kernel writes the e4m3 rows and their scales, and
  the bf16 rows are never written.

The rewrite count is GELU folds plus merges plus norm folds. It runs for fp8 builds only (weight transform
`fp8`); nothing here is family-specific.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from omni_compile.passes.base import PatternPass, _source

from omni_compile.ops import adaln as _adaln  # noqa: F401  (registers omni_compile::adaln and adaln_quant)
from omni_compile.ops import quant_rows as _ops  # noqa: F401  (registers omni_compile::quant_rows)

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default)
QUANT_ROWS = torch.ops.omni_compile.quant_rows.default
ADALN = torch.ops.omni_compile.adaln.default
ADALN_QUANT = torch.ops.omni_compile.adaln_quant.default


def tanh_gelu(y):
    return F.gelu(y, approximate="tanh")


def erf_gelu(y):
    return F.gelu(y)


def _plain_quant(node: torch.fx.Node, src: torch.fx.Node) -> bool:
    return node.target is QUANT_ROWS and node.args[0] is src and node.args[1] == "none" and not node.kwargs


def _fold(match, y: torch.fx.Node, *, act: str, folds: list[int]) -> None:
    graph = match.graph
    out = match.output_node()
    if not isinstance(y, torch.fx.Node) or not isinstance(y.meta.get("val"), torch.Tensor):
        return
    targets = []  # (quantization, the reshape of the GELU's output it reads, or None)
    for user in out.users:
        if _plain_quant(user, out):
            targets.append((user, None))
        elif user.target in RESHAPES and user.users and all(_plain_quant(u, user) for u in user.users):
            targets += [(u, user) for u in user.users]
        else:
            return  # the GELU's output is used by something else: keep it
    if not targets:
        return
    for quant, reshape in targets:
        with graph.inserting_before(quant):
            src = y
            if reshape is not None:
                src = graph.call_function(aten.reshape.default, (y, reshape.args[1]))
                src.meta.update(reshape.meta)  # same shape, and the GELU keeps y's dtype
            fused = graph.call_function(QUANT_ROWS, (src, act))
            fused.meta.update(quant.meta)
        quant.replace_all_uses_with(fused)
        graph.erase_node(quant)
    for user in list(out.users):
        graph.erase_node(user)
    match.erase_nodes()
    folds[0] += 1


def _source_key(node: torch.fx.Node):
    """What a quantization reads, looking through one reshape (two reshapes of a tensor to the same rows are
    the same rows)."""
    x = node.args[0]
    if isinstance(x, torch.fx.Node) and x.target in RESHAPES:
        return ("reshape", x.args[0], tuple(x.args[1]))
    return x


def merge_duplicates(graph: torch.fx.Graph) -> int:
    """Merge `quant_rows` calls that quantize the same rows with the same activation into the first; how many
    were merged."""
    first: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not QUANT_ROWS or node.kwargs:
            continue
        key = (_source_key(node), *node.args[1:])
        if key in first:
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
            merged += 1
        else:
            first[key] = node
    return merged


def fold_norms(graph: torch.fx.Graph) -> int:
    """`quant_rows(adaln(...) [-> reshape], "none")`, where the quantization is the norm's only reader, becomes
    `adaln_quant(...)` (its e4m3 rows and scales reshaped as the quantization's were); how many were folded."""
    import operator

    from torch._guards import detect_fake_mode

    folded = 0
    for quant in [n for n in graph.nodes if n.target is QUANT_ROWS and n.args[1] == "none" and not n.kwargs]:
        src = quant.args[0]
        norm = src.args[0] if src.target in RESHAPES else src
        if not isinstance(norm, torch.fx.Node):
            continue
        if norm.target is not ADALN or len(norm.users) != 1 or len(src.users) != 1:
            continue
        if any(u.target is not operator.getitem for u in quant.users):
            continue
        x = norm.args[0].meta["val"]
        with graph.inserting_before(quant), detect_fake_mode([x]) or contextlib.nullcontext():
            fused = graph.call_function(ADALN_QUANT, norm.args, norm.kwargs)
            parts = []
            for i, dtype in enumerate((torch.float8_e4m3fn, torch.float32)):
                part = graph.call_function(operator.getitem, (fused, i))
                part.meta["val"] = x.new_empty((*x.shape[:-1], x.shape[-1] if i == 0 else 1), dtype=dtype)
                parts.append(part)
        for user in list(quant.users):
            i = user.args[1]
            with graph.inserting_before(user):
                rows = graph.call_function(aten.reshape.default, (parts[i], list(user.meta["val"].shape)))
                rows.meta.update(user.meta)
            user.replace_all_uses_with(rows)
            graph.erase_node(user)
        graph.erase_node(quant)
        if src is not norm:
            graph.erase_node(src)
        graph.erase_node(norm)
        folded += 1
    return folded


class Fp8ActPass(PatternPass):
    """Folds GELUs into the fp8 row quantization after them, and merges duplicate quantizations."""

    name = "fp8_act"

    def is_applicable(self, platform, config) -> bool:
        return "fp8" in config.weight_transforms  # only fp8 models quantize activations

    def register_patterns(self) -> None:
        from omni_compile.passes.base import _trace_like_post_grad
        from torch._inductor.pattern_matcher import gen_pattern

        helpers = (tanh_gelu, erf_gelu, _plain_quant, _fold, _source_key, merge_duplicates, fold_norms)
        self._extra_sources += [_source(f) for f in helpers]
        self._folds = [0]
        for fn, act in ((tanh_gelu, "gelu_tanh"), (erf_gelu, "gelu")):
            for dtype in (torch.float32, torch.bfloat16):  # fp16 traces as bf16 does (dtype literals are ignored)
                self._pending.append(
                    lambda fn=fn, act=act, dtype=dtype: self._register_fold(
                        gen_pattern(fn, [torch.empty(4, 8, dtype=dtype)], _trace_like_post_grad), act
                    )
                )

    def _register_fold(self, pattern, act: str) -> None:
        from torch._inductor.pattern_matcher import register_graph_pattern

        handler = functools.partial(_fold, act=act, folds=self._folds)
        register_graph_pattern(pattern, pass_dict=self.patterns)(handler)

    def apply(self, graph: torch.fx.Graph) -> int:
        if not any(n.target is QUANT_ROWS for n in graph.nodes):
            return 0  # no fp8 GEMMs here
        self.materialize()
        self._folds[0] = 0
        self.patterns.apply(graph)
        merged = merge_duplicates(graph)
        graph.eliminate_dead_code()  # the merged quantizations' reshapes: a norm's readers are counted next
        return self._folds[0] + merged + fold_norms(graph)
