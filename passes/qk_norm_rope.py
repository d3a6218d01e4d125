"""QK-norm + RoPE: fuse the RMSNorm of q/k with the rotary embedding that follows it.

Runs after `rms_norm` (and runs its patterns itself first, so it works with that pass disabled), and
matches `omni_compile::rms_norm` followed by the rotary embedding as the models write it:

    FLUX single block:  apply_rotary_emb(norm_q(q), (cos, sin), sequence_dim=1)          (per-head norm)
    FLUX double block:  apply_rotary_emb(cat([norm_added_q(q_txt), norm_q(q_img)], 1), ...)
    a rotated prefix:   cat([apply_rotary_emb(n[:, :S_img], ...), n[:, S_img:]], 1) with n = norm_q(q)
                        (HunyuanVideo's single-stream block: the text tokens at the end are not rotated)
    Wan self-attention: norm_q(q) over all heads, unflatten to heads, then Wan's rotary embedding
                        (out[..., 0::2] = x1 * cos - x2 * sin; out[..., 1::2] = x1 * sin + x2 * cos)
    interleaved pairs over all heads (LTX-Video): norm_q(q) over H * D on [B, S, H * D], then
                        x * cos + stack([-x_odd, x_even]).flatten() * sin with [1, S, H * D] tables,
                        before the unflatten to heads (the whole token is one "head" of the op)
    per-head tables:    Mochi: stack([(e * cos - o * sin), (e * sin + o * cos)], -1).flatten(-2) with e, o the even and
                        odd elements of norm_q(q) in fp32 and [S, H, D/2] tables (one per head)
    complex tables:     view_as_real(view_as_complex(norm_q(q).float().reshape(..., -1, 2)) * freqs).flatten(3)
                        with freqs [S, 1, D/2] or [1, S, 1, D/2] (Qwen-Image, Lumina2, Z-Image), after the
                        `complex_mul` pass wrote the product in real arithmetic: the table's real view, read
                        as [S, D], holds (cos, sin) per pair, the op's "per_pair" tables both at once (a
                        float64 table, Lumina2's, is read in fp32: the rotation is computed in fp32)

with the norm in either rounding (torch's, or diffusers' cast to a half-precision weight's dtype first),
and replaces each with one `omni_compile::rms_norm_rope`; and a LayerNorm over head_dim followed by per-element or
rotate-half RoPE, on every token or, written back in place, from a token on (HunyuanDiT, CogView4), with one
`omni_compile::layer_norm_rope` (`LayerNormRopePatterns`, traced only for graphs with a per-head LayerNorm). Each
op normalises and rotates in one pass and writes the concatenated sequence directly (no separate cat copy). The rotation tables are
passed whole ([S, D]; Wan's [1, S, 1, D] as a free reshape), with how a pair reads them. `extra_check`/handler guards: the
tables are [S, D] (FLUX) or [1, S, 1, D] (Wan) for the full sequence, head_dim is even, the norm
output has no other user, the unflatten splits the normalised dimension into heads exactly.
"""

from __future__ import annotations

import operator

import torch
from diffusers.models.embeddings import apply_rotary_emb
from omni_compile.passes.base import PatternPass, _source, shared_pass
from omni_compile.passes.complex_mul import real_product_of_pairs
from omni_compile.passes.rms_norm import RMSNormPass
from torch._inductor.pattern_matcher import CallFunction, Ignored, KeywordArg, Match

from omni_compile.ops import rms_norm_rope as _ops  # noqa: F401  (registers omni_compile::rms_norm_rope, layer_norm_rope)

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX = 9223372036854775807  # the `end` of an open slice in ATen graphs


def flux_norm_rope(x, weight, cos, sin, eps, cbw):
    n = torch.ops.omni_compile.rms_norm(x, weight, eps, cbw)
    return apply_rotary_emb(n, (cos, sin), sequence_dim=1)


def flux_joint_norm_rope(x, weight, x_tail, weight_tail, cos, sin, eps, cbw):
    n = torch.cat(
        [
            torch.ops.omni_compile.rms_norm(x, weight, eps, cbw),
            torch.ops.omni_compile.rms_norm(x_tail, weight_tail, eps, cbw),
        ],
        dim=1,
    )
    return apply_rotary_emb(n, (cos, sin), sequence_dim=1)


def _fused(x, weight, x_tail, weight_tail, cos, sin, eps, cbw):
    return torch.ops.omni_compile.rms_norm_rope(x, weight, x_tail, weight_tail, cos, sin, eps, cbw, False, "per_element")


def flux_forms(cbw: bool) -> list:
    """(pattern, replacement, joint) of FLUX's two forms with the norms in one rounding. torch's
    `register_replacement` re-checks a candidate against the pattern traced at its shapes with every literal
    compared, the rounding flag included: one registration per flag."""

    def flux_single(x, weight, cos, sin, eps):
        return flux_norm_rope(x, weight, cos, sin, eps, cbw)

    def flux_single_fused(x, weight, cos, sin, eps):
        return _fused(x, weight, None, None, cos, sin, eps, cbw)

    def flux_joint(x, weight, x_tail, weight_tail, cos, sin, eps):
        return flux_joint_norm_rope(x, weight, x_tail, weight_tail, cos, sin, eps, cbw)

    def flux_joint_fused(x, weight, x_tail, weight_tail, cos, sin, eps):
        return _fused(x, weight, x_tail, weight_tail, cos, sin, eps, cbw)

    return [(flux_single, flux_single_fused, False), (flux_joint, flux_joint_fused, True)]


def prefix_form(cbw: bool):
    def prefix_norm_rope(x, weight, cos, sin, eps):
        # HunyuanVideo's single-stream block: q/k of [image tokens, text tokens] normalised together, the rotary
        # embedding on the image tokens only, the text tokens appended as they are (the example's tail is 2
        # tokens; the slice bounds are integers, which the comparison ignores: the check reads them)
        n = torch.ops.omni_compile.rms_norm(x, weight, eps, cbw)
        return torch.cat([apply_rotary_emb(n[:, :-2], (cos, sin), sequence_dim=1), n[:, -2:]], dim=1)

    def prefix_norm_rope_fused(x, weight, cos, sin, eps):
        return prefix_fused(x, weight, cos, sin, eps, cbw)

    return prefix_norm_rope, prefix_norm_rope_fused


def prefix_fused(x, weight, cos, sin, eps, cast_before_weight):
    # the tail's rotation is the identity: cos 1 and sin 0 give n exactly (n * 1 - n' * 0 in fp32), rounded
    # to n's dtype as the unrotated tail already is
    tail, d = x.shape[1] - cos.shape[0], x.shape[-1]
    cos, sin = cos.float(), sin.float()
    # made from the tables, not by factories (the replacement is traced with real-mode make_fx on fake tensors)
    cos = torch.cat([cos, (cos[:1] * 0 + 1).expand(tail, d)])
    sin = torch.cat([sin, (sin[:1] * 0).expand(tail, d)])
    return torch.ops.omni_compile.rms_norm_rope(x, weight, None, None, cos, sin, eps, cast_before_weight, False,
                                                "per_element")  # fmt: skip


def interleaved_forms(cbw: bool) -> tuple:
    def interleaved_norm_rope(x, weight, cos, sin, eps):
        # LTX-Video's apply_rotary_emb on the normalised [B, S, C] projection, tables [1, S, C] (C = H * D)
        n = torch.ops.omni_compile.rms_norm(x, weight, eps, cbw)
        x_real, x_imag = n.unflatten(2, (-1, 2)).unbind(-1)
        rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
        return (n.float() * cos + rotated.float() * sin).to(n.dtype)

    def interleaved_fused(x, weight, cos, sin, eps):
        # the token as one head of C channels: the norm over C is the norm across heads
        out = torch.ops.omni_compile.rms_norm_rope(
            x.unsqueeze(2), weight, None, None, cos[0], sin[0], eps, cbw, False, "per_element"
        )
        return out.squeeze(2)

    return interleaved_norm_rope, interleaved_fused


def halves_forms(cbw: bool) -> tuple:
    def halves_norm_rope(x, weight, cos, sin, eps):
        # rotate-half RoPE on heads-first q/k [B, H, S, D] (Cosmos, CogView4, OmniGen), tables [S, D]. The
        # sequence-second form (ACE-Step, `sequence_dim=1`) traces to the same graph but for the unsqueeze dims,
        # which the matcher does not compare: one registration, and the check reads where the tables broadcast.
        n = torch.ops.omni_compile.rms_norm(x, weight, eps, cbw)
        return apply_rotary_emb(n, (cos, sin), use_real=True, use_real_unbind_dim=-2)

    def halves_fused(x, weight, cos, sin, eps):
        # the op takes [B, S, H, D]: heads-first q/k are a transposed view of it, and so is the result
        heads_first = x.shape[2] == cos.shape[0]
        if heads_first:
            x = x.transpose(1, 2)
        out = torch.ops.omni_compile.rms_norm_rope(x, weight, None, None, cos, sin, eps, cbw, False, "halves")
        return out.transpose(1, 2) if heads_first else out

    return halves_norm_rope, halves_fused


def per_head_forms(cbw: bool) -> tuple:
    def per_head_norm_rope(x, weight, cos, sin, eps):
        # Mochi: the even and odd elements of each normalised head rotated with [S, H, D/2] tables, one per head
        n = torch.ops.omni_compile.rms_norm(x, weight, eps, cbw)
        even, odd = n[..., 0::2].float(), n[..., 1::2].float()
        first = (even * cos - odd * sin).to(n.dtype)
        second = (even * sin + odd * cos).to(n.dtype)
        return torch.stack([first, second], dim=-1).flatten(-2)

    def per_head_fused(x, weight, cos, sin, eps):
        return torch.ops.omni_compile.rms_norm_rope(x, weight, None, None, cos, sin, eps, cbw, False, "per_head")

    return per_head_norm_rope, per_head_fused


def _per_head_check(traced: torch.dtype):
    def check(match: Match) -> bool:
        if not _x_and_weight_ok(match, traced, rank=4):
            return False
        x = match.kwargs["x"].meta["val"]
        for name in ("cos", "sin"):
            t = match.kwargs[name].meta["val"]
            if t.dtype not in (torch.float32, x.dtype) or tuple(t.shape) != (x.shape[1], x.shape[2], x.shape[3] // 2):
                return False
        norm = next(n for n in match.nodes if n.target == torch.ops.omni_compile.rms_norm.default)
        return len(norm.users) == 2  # the even and the odd elements, nothing else

    return check


def _broadcast_table(match: Match, table: torch.fx.Node) -> tuple[int, ...] | None:
    """The 4-d shape `table` ([S, D]) is viewed as where the rotation multiplies by it, if the match has one."""
    for node in match.nodes:
        if node.target != aten.mul.Tensor:
            continue
        for arg in node.args:
            seen = arg
            for _ in range(6):  # up the chain of views (unsqueeze, slice, view) to the table
                if not isinstance(seen, torch.fx.Node) or seen is table:
                    break
                seen = seen.args[0] if seen.args else None
            if seen is table and isinstance(arg, torch.fx.Node) and arg is not table and arg.meta["val"].dim() == 4:
                return tuple(arg.meta["val"].shape)
    return None


def _halves_check(traced: torch.dtype):
    def check(match: Match) -> bool:
        if not _x_and_weight_ok(match, traced, rank=4):
            return False
        x = match.kwargs["x"].meta["val"]
        s, d = match.kwargs["cos"].meta["val"].shape[0], x.shape[-1]
        for name in ("cos", "sin"):
            t = match.kwargs[name].meta["val"]
            if t.dtype not in (torch.float32, x.dtype) or tuple(t.shape) != (s, d):
                return False
        # where the tables broadcast must be where the replacement puts the sequence (dim 2 when it is S, else 1)
        heads_first = x.shape[2] == s
        if not heads_first and x.shape[1] != s:
            return False
        want = (1, 1, s, d) if heads_first else (1, s, 1, d)
        if any(_broadcast_table(match, match.kwargs[n]) != want for n in ("cos", "sin")):
            return False
        # registered without torch's literal re-check (it compares the model's reshape sizes with the trace's -1):
        # the halves are the last dim split in two (a reshape to [..., 2, D/2], unbind over the 2), and the rotated
        # copy is cat([-second, first]) along the last dim
        for node in match.nodes:
            if node.target == aten.reshape.default and tuple(node.meta["val"].shape[-2:]) != (2, d // 2):
                return False
            if node.target == aten.unbind.int and node.args[1] not in (-2, 3):
                return False
            if node.target == aten.cat.default:
                first, second = node.args[0]
                dim = node.args[1] if len(node.args) > 1 else 0
                if dim not in (-1, 3) or first.target != aten.neg.default or first.args[0].args[1] != 1:
                    return False
                if second.target != operator.getitem or second.args[1] != 0:
                    return False
        norm = next(n for n in match.nodes if n.target == torch.ops.omni_compile.rms_norm.default)
        return len(norm.users) == 2  # the rotation's two reads (the product with cos, the halves), nothing else

    return check


def complex_forms(cbw: bool, dtype: torch.dtype) -> tuple:
    def complex_norm_rope(x, weight, fr, eps):
        # diffusers' complex rotary embedding (use_real=False) once `complex_mul` has written the product on the
        # real pairs; `fr` is the table's real view, [S, 1, D/2, 2] (or with a leading 1). In fp32 the casts are
        # no-ops: the chain ends at the flatten (a model's own no-op cast after it, Lumina2's, stays outside)
        n = torch.ops.omni_compile.rms_norm(x, weight, eps, cbw)
        out = real_product_of_pairs(n.float().reshape(*n.shape[:-1], -1, 2), fr).flatten(3)
        return out if dtype == torch.float32 else out.type_as(n)

    def complex_fused(x, weight, fr, eps):
        # pair i of row s reads (table[s, 2i], table[s, 2i + 1]) = (cos, sin): one table for both; a float64 table
        # (Lumina2 computes its rotation in float64, then rounds to the activations' dtype) is read in fp32
        table = fr.reshape(x.shape[1], x.shape[3]).float()
        return torch.ops.omni_compile.rms_norm_rope(x, weight, None, None, table, table, eps, cbw, False, "per_pair")

    return complex_norm_rope, complex_fused


def _complex_check(traced: torch.dtype):
    def check(match: Match) -> bool:
        if not _x_and_weight_ok(match, traced, rank=4, nodes=("x", "weight", "fr")):
            return False
        x, fr = match.kwargs["x"].meta["val"], match.kwargs["fr"].meta["val"]
        s, d = x.shape[1], x.shape[3]
        # one table for the batch (a per-sample table, [B, S, 1, D/2] with B > 1, is left as it is)
        if fr.dtype not in (torch.float32, torch.float64) or tuple(fr.shape) not in ((s, 1, d // 2, 2), (1, s, 1, d // 2, 2)):
            return False
        norm = next(n for n in match.nodes if n.target == torch.ops.omni_compile.rms_norm.default)
        return len(norm.users) == 1  # the rotation alone reads the norm

    return check


def _x_and_weight_ok(match: Match, traced: torch.dtype, rank: int, nodes: tuple[str, ...] = ("x", "cos", "sin")) -> bool:
    """`nodes` are graph tensors; x has the rank, an even last dim and a dtype of the traced chain's kind
    (fp32 chains have no casts; half-precision ones do); eps is a float; the weight, if any, is [last dim]."""
    if not all(isinstance(match.kwargs.get(n), torch.fx.Node) for n in nodes):
        return False
    x = match.kwargs["x"].meta["val"]
    if x.dtype not in DTYPES or (x.dtype == torch.float32) != (traced == torch.float32):
        return False
    if x.dim() != rank or x.shape[-1] % 2 or not isinstance(match.kwargs.get("eps"), float):
        return False
    w = match.kwargs.get("weight")
    return w is None or (isinstance(w, torch.fx.Node) and tuple(w.meta["val"].shape) == (x.shape[-1],))


def _interleaved_check(traced: torch.dtype):
    def check(match: Match) -> bool:
        if not _x_and_weight_ok(match, traced, rank=3):
            return False
        x = match.kwargs["x"].meta["val"]
        for node in match.nodes:
            if node.target == torch.ops.omni_compile.rms_norm.default and len(node.users) != 2:
                return False  # the rotation's two reads, nothing else
        for name in ("cos", "sin"):
            t = match.kwargs[name].meta["val"]
            # one table for the batch ([1, S, C]; a per-sample table is left as it is)
            if t.dtype not in (torch.float32, x.dtype) or tuple(t.shape) != (1, x.shape[1], x.shape[2]):
                return False
        return True

    return check


def _flux_check(traced: torch.dtype, joint: bool):
    # The tables' dtype leaves no trace in the pattern (they multiply fp32 values), so both fp32 and
    # activation-dtype tables are accepted by one registration.
    def check(match: Match) -> bool:
        names = ("x", "weight", "cos", "sin") + (("x_tail", "weight_tail") if joint else ())
        if not all(isinstance(match.kwargs.get(n), torch.fx.Node) for n in names):
            return False
        x = match.kwargs["x"].meta["val"]
        dtype = x.dtype
        if (dtype == torch.float32) != (traced == torch.float32) or dtype not in DTYPES:
            return False  # fp32 chains have no casts; half-precision ones do
        cos, sin = match.kwargs["cos"].meta["val"], match.kwargs["sin"].meta["val"]
        if x.dim() != 4 or x.shape[-1] % 2 or not isinstance(match.kwargs.get("eps"), float):
            return False
        seq = x.shape[1]
        if joint:
            tail = match.kwargs["x_tail"].meta["val"]
            if tail.dtype != dtype or tail.dim() != 4 or tail.shape[0] != x.shape[0] or tail.shape[2:] != x.shape[2:]:
                return False
            seq += tail.shape[1]
        for t in (cos, sin):
            if t.dtype not in (torch.float32, dtype) or tuple(t.shape) != (seq, x.shape[-1]):
                return False
        return True

    return check


def _prefix_check(traced: torch.dtype):
    def check(match: Match) -> bool:
        if not _x_and_weight_ok(match, traced, rank=4):
            return False
        x = match.kwargs["x"].meta["val"]
        seq, head = x.shape[1], match.kwargs["cos"].meta["val"].shape[0]
        if not 0 < head < seq:
            return False
        for name in ("cos", "sin"):
            t = match.kwargs[name].meta["val"]
            if t.dtype not in (torch.float32, x.dtype) or tuple(t.shape) != (head, x.shape[-1]):
                return False
        # the two slices of the norm's output along the sequence: [0, head) and [head, seq), nothing else
        norm = next(n for n in match.nodes if n.target == torch.ops.omni_compile.rms_norm.default)
        spans = []
        for user in norm.users:
            if user.target != aten.slice.Tensor or user.kwargs:
                return False
            _, dim, start, end, step = list(user.args) + [None] * (5 - len(user.args))
            if dim != 1 or step not in (None, 1):
                return False
            start, end = (0 if start is None else start), (seq if end is None else end)
            spans.append(tuple(v + seq if v < 0 else min(v, seq) for v in (start, end)))
        return sorted(spans) == [(0, head), (head, seq)]

    return check


# ---------------------------------------------------------------- LayerNorm QK-norm (CogView4, HunyuanDiT)
# `F.layer_norm` over head_dim is var_mean, rsqrt and the affine in post-grad graphs; these forms start from that
# chain. Registered without torch's literal re-check (the tables' unsqueeze dims, the suffix's start and the reshape
# sizes are literals each model writes its own way): `_layer_analysis` reads every literal that matters.
AFFINES = ("weight_bias", "weight", "none")


def _layer_chain(x, weight, bias, cos, sin, eps, tables: str, suffix: bool):
    n = torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    unbind_dim = -2 if tables == "halves" else -1
    if not suffix:  # heads-first [B, H, S, D]; sequence-second traces to the same chain but for unsqueeze dims
        return apply_rotary_emb(n, (cos, sin), use_real=True, use_real_unbind_dim=unbind_dim)
    # CogView4: `q[:, :, t:] = apply_rotary_emb(q[:, :, t:], ...)` on the normalised q, functionalised (t = 2 here)
    rotated = apply_rotary_emb(n[:, :, 2:], (cos, sin), use_real=True, use_real_unbind_dim=unbind_dim)
    return aten.slice_scatter.default(n, aten.copy.default(n[:, :, 2:], rotated), 2, 2, MAX)


def layer_search(affine: str, tables: str, suffix: bool):
    """The search function of LayerNorm per head ("weight_bias", "weight" or "none" affine) then RoPE on the whole
    sequence or (`suffix`) on the tokens from some t on, as the model writes it in place."""
    if affine == "weight_bias":
        def search(x, weight, bias, cos, sin, eps):
            return _layer_chain(x, weight, bias, cos, sin, eps, tables, suffix)
    elif affine == "weight":
        def search(x, weight, cos, sin, eps):
            return _layer_chain(x, weight, None, cos, sin, eps, tables, suffix)
    else:
        def search(x, cos, sin, eps):
            return _layer_chain(x, None, None, cos, sin, eps, tables, suffix)
    return search


def layer_fused(x, weight, bias, cos, sin, eps, tables: str, seq: int, start: int):
    """One `omni_compile::layer_norm_rope` on [B, S, H, D] (heads-first q, `seq` 2, is a transposed view of it), the
    tokens from `start` on rotated. The tables are the model's own: q and k share them, and one launch serves both."""
    if seq == 2:
        x = x.transpose(1, 2)
    out = torch.ops.omni_compile.layer_norm_rope(x, weight, bias, cos, sin, eps, tables, start)
    return out.transpose(1, 2) if seq == 2 else out


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _from(node, target):
    """`node`, or what it views (through unsqueezes), if that is a call of `target`."""
    while isinstance(node, torch.fx.Node) and node.target == aten.unsqueeze.default and node.meta["val"].shape[-1] == 1:
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.target == target else None


def _layer_analysis(match: Match, traced: torch.dtype, tables: str, suffix: bool) -> tuple[int, int] | None:
    """(sequence dim of x, first rotated token) when the match means LayerNorm over head_dim, then the rotary
    embedding `tables` names on the tokens from there on; None otherwise."""
    x, cos, sin = (match.kwargs.get(k) for k in ("x", "cos", "sin"))
    if not all(isinstance(v, torch.fx.Node) for v in (x, cos, sin)) or not isinstance(match.kwargs.get("eps"), float):
        return None
    xv = x.meta["val"]
    if xv.dtype not in DTYPES or (xv.dtype == torch.float32) != (traced == torch.float32) or xv.dim() != 4:
        return None
    d = xv.shape[-1]
    if d % 2:
        return None
    for name in ("weight", "bias"):
        p = match.kwargs.get(name)
        if p is not None and (not isinstance(p, torch.fx.Node) or tuple(p.meta["val"].shape) != (d,)):
            return None
    rows = cos.meta["val"].shape[0]
    for t in (cos, sin):
        tv = t.meta["val"]
        if tv.dtype not in (torch.float32, xv.dtype) or tuple(tv.shape) != (rows, d):
            return None
    # the layout: where the tables broadcast (a sequence of H tokens must not be taken for H heads)
    shapes = {_broadcast_table(match, t) for t in (cos, sin)}
    seq = {(1, 1, rows, d): 2, (1, rows, 1, d): 1}.get(shapes.pop()) if len(shapes) == 1 else None
    if seq is None:
        return None
    start = 0
    nodes = set(match.nodes)
    for node in match.nodes:
        val = node.meta.get("val")
        if node.target == aten.var_mean.correction:  # over the last dim, the biased variance
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if list(dims or ()) not in ([3], [-1]) or node.kwargs.get("correction", 1) != 0:
                return None
        elif node.target == aten.reshape.default and val.dim() == 5:  # the head split into pairs or halves
            if tuple(val.shape[-2:]) != ((2, d // 2) if tables == "halves" else (d // 2, 2)):
                return None
        elif node.target == aten.unbind.int:
            if _dim(node.args[1], 5) != (3 if tables == "halves" else 4):
                return None
        elif node.target == aten.cat.default:  # the rotated copy: cat([-second, first]) along the last dim
            parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
            neg = _from(parts[0], aten.neg.default)
            second, first = (neg.args[0] if neg is not None else None), _from(parts[1], operator.getitem)
            if _dim(dim, val.dim()) != val.dim() - 1 or len(parts) != 2 or first is None or first.args[1] != 0:
                return None
            if not isinstance(second, torch.fx.Node) or second.target != operator.getitem or second.args[1] != 1:
                return None
        elif node.target in (aten.slice.Tensor, aten.slice_scatter.default):
            args = list(node.args) + [None] * 6
            dim, lo, hi, step = args[1:5] if node.target == aten.slice.Tensor else args[2:6]
            if _dim(dim, 4) != seq or step not in (None, 1) or (hi is not None and hi < xv.shape[seq]):
                return None
            if not isinstance(lo, int) or lo <= 0 or (start and lo != start):
                return None
            start = lo
        if node is not match.output_node() and any(u not in nodes for u in node.users):
            return None  # an intermediate value read outside the chain
    if suffix != bool(start) or start + rows != xv.shape[seq]:
        return None
    return seq, start


def _layer_check(traced: torch.dtype, tables: str, suffix: bool):
    def check(match: Match) -> bool:
        return _layer_analysis(match, traced, tables, suffix) is not None

    return check


def _layer_handler(traced: torch.dtype, tables: str, suffix: bool):
    def handler(match: Match) -> None:
        seq, start = _layer_analysis(match, traced, tables, suffix)
        names = [n for n in ("x", "weight", "bias", "cos", "sin") if match.kwargs.get(n) is not None]
        eps = match.kwargs["eps"]

        def replacement(*values):
            v = dict(zip(names, values))
            return layer_fused(v["x"], v.get("weight"), v.get("bias"), v["cos"], v["sin"], eps, tables, seq, start)

        match.replace_by_example(replacement, [match.kwargs[n] for n in names])

    return handler


class LayerNormRopePatterns(PatternPass):
    """The LayerNorm forms, apart: traced (about 24 patterns) only for a graph that has a LayerNorm over a 4-d q/k."""

    name = "qk_norm_rope.layer"

    def register_patterns(self) -> None:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(1, 2, 6, 8, dtype=dtype)  # [B, H, S, D], the suffix from token 2
            p = torch.empty(8, dtype=dtype)
            for suffix in (False, True):
                t = torch.empty(4 if suffix else 6, 8)
                for tables in ("per_element", "halves"):
                    for affine in AFFINES:
                        params = {"weight_bias": [p, p.clone()], "weight": [p], "none": []}[affine]
                        self.register_traced(
                            layer_search(affine, tables, suffix), [x, *params, t, t.clone(), 1e-6],
                            _layer_handler(dtype, tables, suffix), _layer_check(dtype, tables, suffix), {"eps": 1e-6},
                        )  # fmt: skip

    @staticmethod
    def occurs_in(graph: torch.fx.Graph) -> bool:
        """Whether `graph` has a LayerNorm over the last dim of a 4-d tensor (a per-head QK-norm)."""
        return any(
            n.target == aten.var_mean.correction and isinstance(n.args[0], torch.fx.Node)
            and getattr(n.args[0].meta.get("val"), "ndim", 0) == 4
            for n in graph.nodes
        )  # fmt: skip


class QKNormRopePass(PatternPass):
    """Fuses RMSNorm of q/k with the rotary embedding (FLUX single/joint, Wan, interleaved over all heads as
    LTX-Video writes it, complex, rotate-half and per-head tables) into `omni_compile::rms_norm_rope`, and a LayerNorm
    QK-norm with its rotary embedding (CogView4, HunyuanDiT) into `omni_compile::layer_norm_rope`."""

    name = "qk_norm_rope"
    # On by default: inside a compiled graph on the H200 its kernel runs 2.6-2.7x faster than Inductor's
    # code for the same chain at W1 and W2 shapes, and W1/W2 steps are 1.04x/1.02x faster with it
    # (docs/passes.md).
    enabled_by_default = True

    def prepare(self) -> None:
        super().prepare()
        self._norms.prepare()  # the RMSNorm patterns it runs on its trial graphs

    def register_patterns(self) -> None:
        self._norms = shared_pass(RMSNormPass, "{}")  # the instance the manager uses: patterns traced once
        self._extra_sources.extend([self._norms.uuid(), _source(real_product_of_pairs)])
        # Dtype literals and the bool argument are ignored when patterns are compared, so the bf16 and
        # fp16 chains are one registration; the checks pin what the traced chain means. Both RMSNorm roundings
        # (torch's, and diffusers' cast before the weight) fuse: the check hands the flag to the replacement.
        sw = {"eps": 1e-6}
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.empty(1, 4, 2, 8, dtype=dtype)
            w = torch.empty(8, dtype=dtype)
            t, t2 = torch.empty(4, 8), torch.empty(8, 8)
            xi, wi, ti = torch.empty(1, 4, 16, dtype=dtype), torch.empty(16, dtype=dtype), torch.empty(1, 4, 16)
            for cbw in (False, True):
                # the second flag's patterns equal the first's but for the flag: kept, not skipped as duplicates
                again = {"skip_duplicates": not cbw}
                for search, replace, joint in flux_forms(cbw):
                    example = [x, w, x.clone(), w.clone(), t2, t2.clone(), 1e-6] if joint else [x, w, t, t.clone(), 1e-6]
                    self.register(search, replace, example, _flux_check(dtype, joint), sw, **again)
                self.register(*interleaved_forms(cbw), [xi, wi, ti, ti.clone(), 1e-6], _interleaved_check(dtype), sw,
                              **again)  # fmt: skip
                self.register(*complex_forms(cbw, dtype), [x, w, torch.empty(4, 1, 4, 2), 1e-6], _complex_check(dtype), sw,
                              **again)  # fmt: skip
                tp = torch.empty(4, 2, 4)  # [S, H, D/2]
                self.register(*per_head_forms(cbw), [x, w, tp, tp.clone(), 1e-6], _per_head_check(dtype), sw, **again)
                th = torch.empty(2, 8)  # x [1, 4, 2, 8] as [B, H, S, D]
                self.register(*halves_forms(cbw), [x, w, th, th.clone(), 1e-6], _halves_check(dtype), sw,
                              recheck=False, **again)  # fmt: skip
            # a prefix rotated: without torch's literal re-check, which would compare the slice bounds (the model's
            # `:-T` against the trace's); the check reads them
            for cbw in (False, True):
                self.register(*prefix_form(cbw), [torch.empty(1, 6, 2, 8, dtype=dtype), w, t, t.clone(), 1e-6],
                              _prefix_check(dtype), sw, recheck=False)  # fmt: skip
        self._register_wan()
        self._layer = shared_pass(LayerNormRopePatterns, "{}")  # traced where a graph has a per-head LayerNorm
        self._extra_sources.append(self._layer.uuid())

    def _register_wan(self) -> None:
        # Wan's rotary embedding writes the even and odd halves into an empty tensor; after
        # functionalisation that is two slice_scatter's, which a traced eager function cannot express.
        from torch._inductor.pattern_matcher import MULTIPLE

        def call(fn, *args, users=1, **kwargs):
            return CallFunction(fn, *args, _users=users, **kwargs)

        n = KeywordArg("n")
        pairs = call(aten.unbind.int, call(aten.reshape.default, n, Ignored()), -1, users=2)
        x1 = call(operator.getitem, pairs, 0, users=MULTIPLE)
        x2 = call(operator.getitem, pairs, 1, users=MULTIPLE)
        cos = call(aten.slice.Tensor, KeywordArg("cos"), 3, 0, MAX, 2, users=MULTIPLE)
        sin = call(aten.slice.Tensor, KeywordArg("sin"), 3, 1, MAX, 2, users=MULTIPLE)
        empty = call(
            aten.empty.memory_format,
            Ignored(),
            dtype=Ignored(),
            layout=Ignored(),
            device=Ignored(),
            pin_memory=Ignored(),
            users=MULTIPLE,
        )
        even = call(aten.sub.Tensor, call(aten.mul.Tensor, x1, cos), call(aten.mul.Tensor, x2, sin))
        odd = call(aten.add.Tensor, call(aten.mul.Tensor, x1, sin), call(aten.mul.Tensor, x2, cos))
        half = call(aten.copy.default, call(aten.slice.Tensor, empty, 3, 0, MAX, 2), even)
        first = call(aten.slice_scatter.default, empty, half, 3, 0, MAX, 2, users=MULTIPLE)
        other = call(aten.copy.default, call(aten.slice.Tensor, first, 3, 1, MAX, 2), odd)
        pattern = call(aten.slice_scatter.default, first, other, 3, 1, MAX, 2)
        self.register_handler(pattern, _replace_wan, _wan_check)

    def apply(self, graph: torch.fx.Graph) -> int:
        # The patterns start from `omni_compile::rms_norm`: the norms must be ops, whether or not the rms_norm
        # pass is on. Norms made here that do not fuse would have to be put back as native code, which is
        # another chain than the model's (new nodes, no source lines): so where this pass would make norms,
        # it first tries on a copy of the graph and leaves the graph as it was when nothing fuses (a pass
        # with 0 matches changes nothing).
        layer = self._layer.apply(graph) if LayerNormRopePatterns.occurs_in(graph) else 0
        return layer + self._apply_rms(graph)

    def _apply_rms(self, graph: torch.fx.Graph) -> int:
        rms_norm = torch.ops.omni_compile.rms_norm.default
        trial = _copy(graph)
        before = sum(n.target == rms_norm for n in trial.graph.nodes)
        self._norms.apply(trial.graph)
        self.materialize()
        if sum(n.target == rms_norm for n in trial.graph.nodes) == before:
            return self.patterns.apply(graph)  # no norm made: the norms pass would change nothing here
        if self.patterns.apply(trial.graph) == 0:
            return 0
        return self._apply_with_norms(graph)

    def _apply_with_norms(self, graph: torch.fx.Graph) -> int:
        from omni_compile.passes.lower_fused_ops import inline_native

        from omni_compile.ops import FUSED_OPS

        rms_norm = torch.ops.omni_compile.rms_norm.default
        before = {n for n in graph.nodes if n.target == rms_norm}
        self._norms.apply(graph)
        matches = self.patterns.apply(graph)
        for node in [n for n in graph.nodes if n.target == rms_norm and n not in before]:
            inline_native(node, FUSED_OPS["rms_norm"])  # made here and not fused: native code again
        return matches


def _copy(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A copy of `graph` (node meta included) in a module of its own, to try the patterns on."""
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return torch.fx.GraphModule(graph.owning_module or torch.nn.Module(), copy)


def _wan_norm(n: torch.fx.Node) -> torch.fx.Node | None:
    """The `omni_compile::rms_norm` across heads that `n` ([B, S, H, D]) unflattens, if that is all it is."""
    if n.target not in (aten.reshape.default, aten.view.default) or len(n.users) != 1:
        return None
    norm = n.args[0]
    if not isinstance(norm, torch.fx.Node) or norm.target != torch.ops.omni_compile.rms_norm.default:
        return None
    return norm if len(norm.users) == 1 else None


def _wan_check(match: Match) -> bool:
    n, cos, sin = (match.kwargs.get(k) for k in ("n", "cos", "sin"))
    if not all(isinstance(v, torch.fx.Node) for v in (n, cos, sin)):
        return False
    norm = _wan_norm(n)
    if norm is None:
        return False
    q = n.meta["val"]
    x = norm.args[0].meta["val"]
    if (
        q.dim() != 4
        or x.dim() != 3
        or q.shape[-1] % 2
        or tuple(x.shape) != (q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
    ):
        return False
    if q.dtype not in DTYPES or x.dtype != q.dtype:  # the across-heads norm rounds to x's dtype (torch semantics)
        return False
    table = (1, q.shape[1], 1, q.shape[3])
    return all(tuple(t.meta["val"].shape) == table for t in (cos, sin))


def _replace_wan(match: Match, n, cos, sin) -> None:
    norm = _wan_norm(n)
    x, weight, eps, cbw = norm.args
    b, s, h, d = n.meta["val"].shape

    def fused(*tensors):
        x, cos, sin, *w = tensors
        return torch.ops.omni_compile.rms_norm_rope(
            x.reshape(b, s, h, d), w[0] if w else None, None, None, cos.reshape(s, d), sin.reshape(s, d), eps, cbw,
            True, "per_pair",
        )  # fmt: skip

    match.replace_by_example(fused, [x, cos, sin] + ([weight] if weight is not None else []))
