"""Route every attention call of a region graph to the backend chosen for its role.

Matches the SDPA nodes of the post-grad graph (`aten.scaled_dot_product_attention` and the forms
torch decomposes it into: the flash, efficient, cuDNN and CPU-flash ops) whose first output is the
only one used, with no dropout and no causal mask. Each call's role comes from the attention
module that made it (`nn_module_stack`, e.g. `attn2` in a Wan block is `wan.cross`; the adapter
maps it), its requirements from the example values (dtype, head_dim, lengths, mask). The backend
is resolved per call (`omni_compile.attention.select`: explicit choices fail closed, `auto` walks
the platform's preference list) and the call is replaced by that backend's form:

- TORCH_SDPA: left as torch dispatched it;
- CUDNN_ATTN: `aten._scaled_dot_product_cudnn_attention` on the same [B, H, S, D] views;
- FA3_ATTN, FA4_ATTN, FLASH_ATTN (FA2), TRITON_ATTN, SAGE_ATTN: the backend's op on [B, S, H, D] tensors. diffusers builds
  q/k/v as [B, S, H, D] and transposes them for SDPA; the new call takes the transpose back, so the
  permute pair folds into the original tensor and no layout copy is made before or after the kernel.
  With a key-padding mask, FA3 gets each row's kept keys and values first (a stable sort of the mask and
  a gather, in the graph) and their count as `seqused_k`. With a key bias (an additive float mask that is
  the same for every query, such as diffusers' `(1 - mask) * -10000`), TRITON_ATTN adds it to the scores;
  no vendor flash kernel takes one, so SDPA is its other candidate.
  The Triton kernels are embedded in Inductor's code like the fused-op kernels (`functional_trace`).

Correctness: every backend computes softmax(q kᵀ · scale) v on the same inputs (SAGE_ATTN within its
documented, lossy bound); the output keeps SDPA's shape and dtype. The build report lists the backend,
reason and call count per role. The pass's match count is the number of calls it rewrote: a call left
as torch dispatched it (TORCH_SDPA, or cuDNN that torch already chose) is resolved, not matched.
"""

from __future__ import annotations

import hashlib
import math
import operator
import re

import torch
from torch.fx.operator_schemas import normalize_function

from omni_compile.attention.backends import BACKENDS, AttentionCall, installed_flash_modules
from omni_compile.attention.backends.base import seqused_attention
from omni_compile.attention.config import AttentionConfig
from omni_compile.attention.select import check_explicit_choices, resolve
from omni_compile.errors import ConfigError
from omni_compile.passes.base import OmniPass, PassContext, PassResult, _source, known_size, size_hint
from omni_compile.passes.lower_fused_ops import fake_trace, functional_trace, record_resolution, splice_body
from omni_compile.platform import Platform

aten = torch.ops.aten


def _sdpa_targets() -> set:
    names = (
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _module_path(node: torch.fx.Node) -> str:
    """The attention module's path inside the block, e.g. 'attn1' (from "L['self'].attn1")."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    for prefix in ("L['self'].", "L['self']", "self."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    return path or _path_from_stack_trace(node.meta.get("stack_trace") or "")


_SELF_CALL = re.compile(r"self\.([A-Za-z_]\w*)\(")


def _path_from_stack_trace(trace: str) -> str:
    """The attribute the block called its attention module through ('attn1' from a frame whose line is
    `attn_output = self.attn1(...)`). The ahead-of-time export (omni_compile/artifact/aot.py) traces a
    block that is not a registered submodule of the exported root, so its nodes carry no module paths;
    their stack traces still show the call line of the outermost module that made the call."""
    for line in trace.splitlines():
        m = _SELF_CALL.search(line)
        if m and not line.lstrip().startswith("File "):
            return m.group(1)
    return ""


# Ops a mask may pass through between where it is made and the attention call without changing which key an
# element belongs to (broadcasts, singleton dims, the padding of the last dim that torch's efficient-attention
# path adds and slices off again).
_SAME_KEYS = {aten.expand.default, aten.unsqueeze.default, aten.reshape.default, aten.view.default,
              aten.squeeze.dim, aten.squeeze.dims, aten.clone.default, aten.alias.default,
              aten.slice.Tensor, aten.constant_pad_nd.default}  # fmt: skip


# Fill values that drop a key as -inf does: torch's cuDNN path writes -65504 (fp16's lowest) for a bool mask's
# False, and models write finfo(dtype).min. They differ from -inf only where a score exceeds about 65,400 (no
# softmax input of a real model does) or where a row drops every key (there no backend's output means anything).
_MINUS_INF, _MASKED = float("-inf"), -65504.0


def _scalar(node) -> float | None:
    """The value of a scalar constant node (`full([], v)`, `scalar_tensor(v)`) or a Python number, else None."""
    if isinstance(node, (int, float)):
        return float(node)
    if isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is aten.full.default and list(node.args[0]) == []:
            return float(node.args[1])
        if node.target is aten.scalar_tensor.default:
            return float(node.args[0])
    return None


def _non_singleton(shape) -> list:
    # sizes as they are: int() of a symbolic size (a --dynamic build) would specialize it
    return [d for d in shape if d != 1]


def _keeps_keys(node: torch.fx.Node) -> bool:
    """`node` (one of `_SAME_KEYS`) moves no element to another key."""
    src = node.args[0].meta["val"]
    if node.target is aten.slice.Tensor:  # the first elements of the last dim (what a right padding added goes)
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        return dim % src.dim() == src.dim() - 1 and start in (0, None)
    if node.target is aten.constant_pad_nd.default:  # padding on the right of the last dim only
        pad = list(node.args[1])
        return len(pad) == 2 and pad[0] == 0
    if node.target in (aten.reshape.default, aten.view.default):
        return _non_singleton(src.shape) == _non_singleton(node.meta["val"].shape)
    return True


def _key_padding(mask: torch.fx.Node, q, k) -> tuple[torch.fx.Node, bool] | None:
    """(a bool node of shape [B or 1, 1, 1, S_kv] or [B or 1, S_kv], invert) when the attention call's mask only
    drops keys per batch row (the same for every head and query), else None.

    Either the mask is such a bool tensor, or it is the additive form torch's SDPA decomposition makes of one:
    `where(keep, 0, -inf)` or `where(logical_not(keep), -inf, 0)` (-inf or any fill ≤ -65504: `_MASKED`), possibly
    broadcast, reshaped into singleton
    dims, or padded on the right of the last dim and sliced back (the efficient-attention kernel's alignment).
    `invert`: the keys kept are those where the node is False."""
    b, skv = q.shape[0], k.shape[2]

    def row_mask_shape(shape) -> bool:
        shape = list(shape)
        if len(shape) not in (2, 3, 4) or shape[-1] != skv or shape[0] not in (1, b):
            return False
        return all(d == 1 for d in shape[1:-1])

    node = mask
    if node.meta["val"].dtype == torch.bool:
        return (node, False) if row_mask_shape(node.meta["val"].shape) else None
    while node.op == "call_function" and node.target in _SAME_KEYS and _keeps_keys(node):
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten.where.self:
        return None
    cond, a, c = node.args
    if not (isinstance(cond, torch.fx.Node) and cond.meta["val"].dtype == torch.bool):
        return None
    if tuple(cond.meta["val"].shape) != tuple(node.meta["val"].shape) or not row_mask_shape(cond.meta["val"].shape):
        return None
    values = tuple(_MINUS_INF if v is not None and v <= _MASKED else v for v in (_scalar(a), _scalar(c)))
    if values == (0.0, _MINUS_INF):
        invert = False
    elif values == (_MINUS_INF, 0.0):
        invert = True
    else:
        return None
    if cond.op == "call_function" and cond.target is aten.logical_not.default:
        cond, invert = cond.args[0], not invert
    return cond, invert


def _key_bias(mask: torch.fx.Node, q, k) -> torch.fx.Node | None:
    """`mask` when it is an additive float mask that is the same for every query: its shape, padded on the left
    to 4 dims, is [B or 1, H or 1, 1, S_kv] (e.g. diffusers' `(1 - mask) * -10000`, repeated per head), else
    None."""
    val = mask.meta["val"]
    if not val.dtype.is_floating_point or not 1 <= val.dim() <= 4:
        return None
    shape = [1] * (4 - val.dim()) + list(val.shape)
    b, h, skv = q.shape[0], q.shape[1], k.shape[2]
    return mask if shape[0] in (1, b) and shape[1] in (1, h) and shape[2] == 1 and shape[3] == skv else None


def _bias_rows(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The [B, H, S_kv] view of `_key_bias`'s mask for q [B, H, S, D] (broadcast dims get stride 0)."""
    if bias is None:
        return None
    b4 = bias.reshape([1] * (4 - bias.dim()) + list(bias.shape))
    return b4.expand(q.shape[0], q.shape[1], 1, b4.shape[-1])[:, :, 0, :]


def _to_bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _key_mask(mask: torch.Tensor | None, q: torch.Tensor, invert: bool = False) -> torch.Tensor | None:
    """The [B, S_kv] bool of kept keys from `_key_padding`'s node ([B or 1, ..., S_kv], singleton dims between)."""
    if mask is None:
        return None
    keep = mask.reshape(mask.shape[0], mask.shape[-1]).expand(q.shape[0], mask.shape[-1])
    return keep.logical_not() if invert else keep


def _cudnn_body(q, k, v, mask, scale, invert=False, bias=None):
    return aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, False, False, scale=scale)[0]


def _op_body(op, seqused_op=None):
    def body(q, k, v, mask, scale, invert=False, bias=None):
        if mask is None:
            return _to_bshd(op(_to_bshd(q), _to_bshd(k), _to_bshd(v), scale))
        # a key-padding mask (the backend's requirements passed): kept keys first, attended to by count
        keep = _key_mask(mask, q, invert)
        return _to_bshd(seqused_attention(seqused_op, _to_bshd(q), _to_bshd(k), _to_bshd(v), keep, scale))

    return body


def _kernel_body(launcher):
    def body(q, k, v, mask, scale, invert=False, bias=None):
        key_mask = _key_mask(mask, q, invert)
        t = (_to_bshd(q), _to_bshd(k), _to_bshd(v))
        if bias is None:  # not every kernel takes a key bias (`AttentionBackend.masks`)
            return _to_bshd(launcher(*t, key_mask, scale))
        return _to_bshd(launcher(*t, key_mask, scale, _bias_rows(bias, q)))

    return body


def _ulysses_body(backend: str):
    """The call as Ulysses attention through `backend` (`omni_compile.parallel.ulysses`), on [B, S, H, D] views."""
    from omni_compile.parallel.ulysses import ulysses_attention

    def body(q, k, v, mask, scale, invert=False, bias=None):
        return _to_bshd(ulysses_attention(_to_bshd(q), _to_bshd(k), _to_bshd(v), scale, backend))

    return body


def _splice_external_call(out: torch.fx.Node, bound: dict, op) -> None:
    """Replace `out` by `op(q, k, v, key_mask, scale[, key_bias])` on [B, S, H, D] views, as one call node
    (tracing would run a triton_op's kernel on fake tensors)."""
    graph = out.graph

    names = [n for n in ("q", "k", "v", "mask", "bias") if bound[n] is not None]

    def prepare(*tensors):
        given = dict(zip(names, tensors))
        q = given["q"]
        return (_to_bshd(q), _to_bshd(given["k"]), _to_bshd(given["v"]),
                _key_mask(given.get("mask"), q, bound["invert"]), _bias_rows(given.get("bias"), q))  # fmt: skip

    traced = fake_trace(prepare, [bound[n].meta["val"] for n in names])
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(out):
        q, k, v, mask, bias = graph.graph_copy(traced.graph, {ph: bound[n] for ph, n in zip(placeholders, names)})
        args = (q, k, v, mask, bound["scale"], *([bias] if bias is not None else []))
        call = graph.call_function(op, args)
        qv = q.meta["val"]
        call.meta["val"] = qv.new_empty(qv.shape)
        result = graph.call_function(aten.permute.default, (call, [0, 2, 1, 3]))
        result.meta["val"] = call.meta["val"].permute(0, 2, 1, 3)
    out.replace_all_uses_with(result)
    graph.erase_node(out)


class AttentionPass(OmniPass):
    """Replaces SDPA calls by the attention backend chosen for their role (CUDNN, FLASH, TRITON, SAGE)."""

    name = "attention"

    def __init__(self, options=None, platform: Platform | None = None, config: AttentionConfig | None = None,
                 role_of=None, sequence_parallel: bool = False):  # fmt: skip
        super().__init__(options)
        self.platform = platform
        self.config = config or AttentionConfig()
        self.role_of = role_of or (lambda path: path or "default")
        # every call becomes Ulysses attention over the sequence-parallel group (omni_compile.parallel)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:  # its op, which code from Inductor's cache calls without this pass running
            import omni_compile.parallel.ulysses  # noqa: F401
        if platform is not None:
            check_explicit_choices(self.config, platform)
        self.resolutions: dict[str, dict] = {}

    @classmethod
    def from_context(cls, ctx: PassContext) -> AttentionPass:
        return cls(ctx.options, platform=ctx.platform, config=ctx.attention, role_of=ctx.attention_role,
                   sequence_parallel=ctx.config.sequence_parallel)  # fmt: skip

    def run(self, graph: torch.fx.Graph) -> PassResult:
        self.resolutions = {}  # this graph's calls only
        rewrites = self.apply(graph)
        return PassResult(rewrites, {"attention": {k: dict(v) for k, v in self.resolutions.items()}})

    def apply(self, graph: torch.fx.Graph) -> int:
        assert self.platform is not None, "AttentionPass needs its platform before it runs"
        targets = _sdpa_targets()
        count = 0
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in targets]:
            count += self._rewrite(node)
        return count

    def _rewrite(self, node: torch.fx.Node) -> int:
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        kw = normalized.kwargs if normalized is not None else {}
        q, k, v = kw.get("query"), kw.get("key"), kw.get("value")
        if not all(isinstance(t, torch.fx.Node) for t in (q, k, v)):
            self._refuse_unsharded(node, "its query, key or value is not a tensor of the graph")
            return 0
        if not all(known_size(d) for t in (q, k, v) for d in t.meta["val"].shape):
            # e.g. the tokens a mask keeps, gathered by nonzero: no backend can be chosen or measured for a length
            # known only when the graph runs
            why = "a sequence length that depends on the data (nonzero, a mask's count): left to torch"
            self._refuse_unsharded(node, why)
            record_resolution(self.resolutions, self.role_of(_module_path(node)), "TORCH_SDPA", why)
            return 0
        mask = kw.get("attn_mask", kw.get("attn_bias"))
        key_padding, key_bias, mask_kind = None, None, None
        if isinstance(mask, torch.fx.Node):
            key_padding = _key_padding(mask, q.meta["val"], k.meta["val"])
            key_bias = None if key_padding else _key_bias(mask, q.meta["val"], k.meta["val"])
            mask_kind = "key_padding" if key_padding else "key_bias" if key_bias is not None else "other"
        role = self.role_of(_module_path(node))
        if mask_kind is not None:
            self._refuse_unsharded(node, f"it has an attention mask ({mask_kind.replace('_', '-')})")
        if kw.get("dropout_p", 0.0) or kw.get("is_causal", False):
            self._refuse_unsharded(node, "dropout or a causal mask")
            record_resolution(self.resolutions, role, "TORCH_SDPA", "dropout or a causal mask: left to torch")
            return 0
        if node.target is aten.scaled_dot_product_attention.default:
            out = node
        else:
            users = list(node.users)
            if not users or any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
                self._refuse_unsharded(node, "an output besides the attention's (the log-sum-exp) is read")
                return 0
            out = users[0]
            for extra in users[1:]:  # duplicate getitem(node, 0)
                extra.replace_all_uses_with(out)
        qv, kv_, vv = (t.meta["val"] for t in (q, k, v))
        call = AttentionCall(
            dtype=qv.dtype,
            head_dim=size_hint(qv.shape[-1]),
            q_len=size_hint(qv.shape[2]),
            kv_len=size_hint(kv_.shape[2]),
            mask=mask_kind,
            batch=size_hint(qv.shape[0]),
            heads=size_hint(qv.shape[1]),
        )
        if qv.shape[1] != kv_.shape[1] or vv.shape[-1] != qv.shape[-1]:
            why = "grouped-query attention or a different value head size: left to torch"
            self._refuse_unsharded(node, why)
            record_resolution(self.resolutions, role, "TORCH_SDPA", why)
            return 0
        resolution = resolve(self.config, role, self.platform, call, measure=self.config.measure)
        record_resolution(self.resolutions, role, resolution.backend, resolution.describe(),
                          measured=dict([resolution.measured]) if resolution.measured else None)  # fmt: skip
        if self.sequence_parallel:
            body, trace = _ulysses_body(resolution.backend), fake_trace
        else:
            body, trace = self._body(resolution.backend, node)
        if body is None:  # torch's own node already runs this backend: resolved (recorded above), not rewritten
            return 0
        scale = kw.get("scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(call.head_dim)
        # backends that take a mask take a key-padding one (its bool form replaces the mask) or a key bias
        # (`requirements`)
        keep, invert = key_padding or (None, False)
        bound = {"q": q, "k": k, "v": v, "mask": keep, "scale": scale, "invert": invert, "bias": key_bias}
        if trace is None:  # an op that must stay one call node (a triton_op on the CPU interpreter)
            _splice_external_call(out, bound, body)
        else:
            splice_body(out, bound, body, trace)
        return 1

    def _refuse_unsharded(self, node: torch.fx.Node, why: str) -> None:
        """Under sequence parallelism every attention call must become Ulysses attention: a call left as it is
        would attend to this rank's tokens only."""
        if self.sequence_parallel:
            raise ConfigError(f"sequence parallelism cannot split the attention call of {_module_path(node) or 'a block'}: "
                              f"{why}; run this model in one process (parallel ulysses=1)")  # fmt: skip

    def _body(self, backend: str, node: torch.fx.Node):
        """(body, trace) of the backend's form (`AttentionBackend.form`); (None, None): leave the node."""
        impl = BACKENDS[backend]
        if impl.form == "sdpa":
            return None, None
        if impl.form == "cudnn":
            if node.target is aten._scaled_dot_product_cudnn_attention.default:
                return None, None  # torch already chose cuDNN here
            return _cudnn_body, fake_trace
        if impl.form == "op":
            return _op_body(impl.load(), impl.load_seqused() if impl.load_seqused else None), fake_trace
        assert impl.form == "kernel", f"{backend}: unknown form {impl.form!r}"
        op, launcher = impl.load()
        if self.platform.kind == "cpu":  # the interpreter: the triton_op, as an external call
            return op, None
        return _kernel_body(launcher), functional_trace

    def uuid(self) -> str:
        # What changes the rewrite: the config, the adapter's role mapping, and (through `auto`) which
        # FlashAttention build is installed.
        factors = [super().uuid(), repr(self.config.to_json()), _source(self.role_of),
                   repr(sorted((n, b.form, sorted(b.priority.items())) for n, b in BACKENDS.items()))]
        factors.append(repr(installed_flash_modules()))
        if self.sequence_parallel:
            factors.append("sequence_parallel")
        return hashlib.sha256("|".join(factors).encode()).hexdigest()
