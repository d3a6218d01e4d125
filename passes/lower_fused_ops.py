"""Lower fused ops to the implementation their platform and inputs resolve to.

Runs last. For each `omni_compile::*` call in the graph, asks the op's registry entry which
implementation serves this platform and these inputs (`FusedOp.resolve`, honouring the config's
`kernels` choices):

- native: the call is replaced by the traced body of the native implementation, so Inductor fuses
  it with its neighbours exactly as it would the original chain (an opaque call would run eager
  torch, several kernels, inside compiled code);
- a Triton kernel on a GPU: the call is replaced by the kernel's launcher traced with make_fx, each
  launch turned into a `triton_kernel_wrapper_functional` node (`functional_trace`); Inductor embeds
  those kernels in its generated code like its own (no Python dispatch in the hot path);
- a Triton kernel on CPU (only under TRITON_INTERPRET=1, for tests): the call is redirected to the
  kernel's `triton_op`, which Inductor runs as an external call.

An explicitly requested kernel that cannot serve raises `KernelUnavailableError`. Each graph's
resolutions (implementation, reason, count, form) go into the build report.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
from typing import Any, ClassVar

import torch
from omni_compile.passes.base import OmniPass, PassContext, PassResult

from omni_compile.ops import FUSED_OPS, NATIVE, FusedOp, Kernel
from omni_compile.platform import Platform

logger = logging.getLogger(__name__)


def fake_trace(fn, args):
    """make_fx of `fn` with Inductor's decompositions (what its post-grad graphs hold, e.g. no aten.stack),
    in the fake mode of the example values (Inductor's, inside its passes)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    with detect_fake_mode(args) or contextlib.nullcontext():
        return make_fx(fn, select_decomp_table(), tracing_mode="real")(*args)


def functional_trace(fn, args):
    """Trace a kernel launcher into the functional form Inductor embeds.

    `make_fx` records each `wrap_triton(kernel)[grid](...)` launch as a `triton_kernel_wrapper_mutation`
    node writing into buffers the launcher allocated. Each becomes a `triton_kernel_wrapper_functional`
    whose `tensors_to_clone` are exactly those fresh buffers that are read after it (the launchers write
    nothing else; a fresh buffer nothing else reads is a spare for an unused pointer, never written), and
    later uses read the buffers from its result. Inductor's re-inplacing drops the clones of the fresh
    buffers, then lowers the launches like user-defined Triton kernels. Tracing runs in the fake mode of
    the example values, and needs no GPU: Triton's own mutation analysis is not used.
    """
    from torch._higher_order_ops.triton_kernel_wrap import (
        triton_kernel_wrapper_functional,
        triton_kernel_wrapper_mutation,
    )

    gm = fake_trace(fn, args)
    graph = gm.graph
    fresh = {torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default}
    for node in list(graph.nodes):
        if node.target is not triton_kernel_wrapper_mutation:
            continue
        params = node.kwargs["kwargs"]
        # the buffers it writes: fresh ones read after the launch (the launcher returns them); a fresh buffer only
        # this launch takes is a spare for a pointer the kernel never uses (`ops.kernels._common.unused`)
        outs = [k for k, v in params.items()
                if isinstance(v, torch.fx.Node) and v.target in fresh and any(u is not node for u in v.users)]  # fmt: skip
        if not outs:
            raise RuntimeError(f"kernel launch writes no buffer the launcher allocated: {node.format_node()}")
        with graph.inserting_after(node):
            functional = graph.call_function(
                triton_kernel_wrapper_functional, kwargs={**node.kwargs, "tensors_to_clone": outs}
            )
        functional.meta["val"] = {k: params[k].meta["val"] for k in outs}
        last = functional
        for k in outs:
            buffer = params[k]
            with graph.inserting_after(last):
                result = graph.call_function(operator.getitem, (functional, k))
            result.meta["val"] = buffer.meta["val"]
            last = result
            later = [u for u in buffer.users if u is not node and u is not functional and u not in (result,)]
            for user in later:
                user.replace_input_with(buffer, result)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def trace_body(bound: dict, impl, trace=fake_trace):
    """(traced graph module, names of its inputs): `impl(**bound)` traced with the graph nodes among `bound`'s
    values as its inputs and the other values as constants of the trace."""
    tensors = [n for n, v in bound.items() if isinstance(v, torch.fx.Node)]
    constants = {n: v for n, v in bound.items() if n not in tensors}

    def body(*values):
        return impl(**dict(zip(tensors, values)), **constants)

    return trace(body, [bound[n].meta["val"] for n in tensors]), tensors


def insert_body(node: torch.fx.Node, bound: dict, traced) -> None:
    """Replace `node` by a body `trace_body` traced (with `bound`'s graph nodes as its inputs), in place."""
    gm, tensors = traced
    graph = node.graph
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        out = graph.graph_copy(gm.graph, {ph: bound[name] for ph, name in zip(placeholders, tensors)})
    if isinstance(out, (tuple, list)):  # an op with several outputs: its users are getitem nodes
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"a user of the multi-output op {node.format_node()} is not a getitem: {user}")
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def splice_body(node: torch.fx.Node, bound: dict, impl, trace=fake_trace) -> None:
    """Replace `node` by the traced body of `impl(**bound)`, in place: the graph nodes among `bound`'s
    values become the body's inputs, the other values are constants of the trace."""
    insert_body(node, bound, trace_body(bound, impl, trace))


def _paired(*args):
    """Stands, for a moment, for the one launch that replaces two fused-op calls (`LowerFusedOpsPass`)."""
    raise RuntimeError("a placeholder of the fused-op lowering was left in the graph")


def splice(node: torch.fx.Node, op: FusedOp, impl, trace=fake_trace) -> None:
    """Replace the fused-op call `node` by the traced body of `impl` (same arguments as the op), in place."""
    bound = dict(zip(op.arg_names, node.args))
    bound.update(node.kwargs)
    splice_body(node, {n: bound.get(n) for n in op.arg_names}, impl, trace)


def inline_native(node: torch.fx.Node, op: FusedOp) -> None:
    """Replace one fused-op call by the traced body of its native implementation, in place."""
    splice(node, op, op.native)


def record_resolution(table: dict[str, dict], op: str, implementation: str, reason: str, count: int = 1,
                      measured: dict[str, dict] | None = None, paired: int = 0) -> None:  # fmt: skip
    """Add `count` calls of `op` resolved to `implementation` to a report table (op -> implementation,
    reason, count); calls of one op resolved differently make it "mixed" with every reason kept.
    `measured`: shape -> {implementation: ms or why dropped}, for a choice made by timing (kept per shape).
    `paired`: how many of the calls run two to a launch (`paired` in the entry, absent while none do)."""
    entry = table.setdefault(op, {"implementation": None, "reason": None, "count": 0})
    if paired:
        entry["paired"] = entry.get("paired", 0) + paired
    if entry["implementation"] not in (None, implementation):
        entry["implementation"] = "mixed"
        entry["reason"] = f"{entry['reason']} | {implementation}: {reason}"
    else:
        entry["implementation"], entry["reason"] = implementation, reason
    entry["count"] += count
    if measured:
        entry.setdefault("measured", {}).update(measured)


# Pure, yet two calls are two different buffers: never equal by their arguments.
_FRESH = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.empty_like.default}  # fmt: skip


def _value_key(value, memo: dict) -> object:
    """A key equal for equal argument values: constants by value, graph nodes by identity, except that two pure
    nodes (`_movable`) of the same op on equal arguments are equal (a model passes its rotary tables to q's and
    k's rotation, and the graph often takes the same view or cast of them twice)."""
    if isinstance(value, torch.fx.Node):
        if value not in memo:
            if _movable(value) and value.target not in _FRESH:
                memo[value] = (value.target, _value_key(value.args, memo),
                               tuple(sorted((k, _value_key(v, memo)) for k, v in value.kwargs.items())))  # fmt: skip
            else:
                memo[value] = ("node", id(value))
        return memo[value]
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_value_key(v, memo) for v in value))
    return (type(value).__name__, repr(value))


def _between(start: torch.fx.Node, stop: torch.fx.Node, order: dict, up: bool) -> list[torch.fx.Node] | None:
    """The nodes strictly between `start` and `stop` in graph order that `stop` depends on (up: walking its
    inputs) or that depend on `start` (down: walking its users), in graph order; None when the walk reaches the
    other end (one call depends on the other)."""
    lo, hi = order[start], order[stop]
    seen: set[torch.fx.Node] = set()
    todo = list(stop.all_input_nodes) if up else list(start.users)
    while todo:
        n = todo.pop()
        if n in seen or not lo <= order[n] <= hi:
            continue
        if n is (start if up else stop):
            return None
        seen.add(n)
        todo += list(n.all_input_nodes) if up else list(n.users)
    return sorted(seen, key=order.__getitem__)


def _movable(node: torch.fx.Node) -> bool:
    """A node that may change place in the graph: a pure op (no argument written, no random numbers), a
    functional kernel launch, or a getitem of one."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
        return not writes and torch.Tag.nondeterministic_seeded not in target.tags
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    return target is triton_kernel_wrapper_functional


def _placement(first: torch.fx.Node, second: torch.fx.Node, order: dict) -> tuple[torch.fx.Node, list] | None:
    """Where one launch can stand for both calls: (anchor, nodes to move) or None. Before `first`, with what
    leads from earlier values to `second`'s inputs moved up there (views of the tables, k's projection); else
    before `second`, with what uses `first`'s result before it moved down after `second`. Only pure nodes move
    (the graph is functional: the order of pure ops is free); a call that needs the other's result leaves the
    two apart."""
    for anchor, up in ((first, True), (second, False)):
        nodes = _between(first, second, order, up=up)
        if nodes is not None and all(_movable(n) for n in nodes):
            return anchor, nodes
    return None


class LowerFusedOpsPass(OmniPass):
    """Replaces each fused-op call by its resolved implementation (native body or platform kernel).

    Option `pair` (default on): where a kernel has a paired form (`Kernel.pair`) and two calls resolved to it
    share every argument but their own (the q and k of one attention: the same rotary tables), the two run as
    one embedded launch, placed where the later call was; only when every user of the earlier call comes after
    the later one, and only for embedded launches (GPU platforms)."""

    name = "lower_fused_ops"
    OPTIONS: ClassVar[dict[str, Any]] = {"pair": True}

    def __init__(self, options=None, platform: Platform | None = None, choices: dict[str, str] | None = None):
        super().__init__(options)
        self.platform = platform
        self.choices = dict(choices or {})
        if platform is not None:
            # A kernel asked for by name that cannot run on this platform at all fails now, before any
            # tracing; input-dependent requirements (dtype, head_dim, layout) are checked per call.
            for name, choice in self.choices.items():
                if choice not in ("auto", NATIVE):
                    FUSED_OPS[name].resolve(platform, None, choice)
        self.resolutions: dict[str, dict] = {}

    @classmethod
    def from_context(cls, ctx: PassContext) -> LowerFusedOpsPass:
        return cls(ctx.options, platform=ctx.platform, choices=ctx.kernel_choices)

    def run(self, graph: torch.fx.Graph) -> PassResult:
        self.resolutions = {}  # this graph's calls only
        rewrites = self.apply(graph)
        return PassResult(rewrites, {"fused_ops": {k: dict(v) for k, v in self.resolutions.items()}})

    def apply(self, graph: torch.fx.Graph) -> int:
        assert self.platform is not None, "LowerFusedOpsPass needs its platform before it runs"
        ops = {op.overload: op for op in FUSED_OPS.values()}
        calls = []
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target in ops]:
            op = ops[node.target]
            bound = dict(zip(op.arg_names, node.args))
            bound.update(node.kwargs)
            bound = {n: bound.get(n) for n in op.arg_names}
            meta = {n: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for n, v in bound.items()}
            calls.append((node, op, bound, meta, op.resolve(self.platform, meta, self.choices.get(op.name, "auto"))))
        done = set()
        for first, second in self._pairs(graph, calls):
            node, op, bound, _, resolution = first
            kernel = op.kernels[resolution.implementation]
            if self._lower_pair(node, bound, second[0], second[2], kernel):
                record_resolution(self.resolutions, op.name, f"{resolution.implementation} (embedded)",
                                  resolution.reason, count=2, paired=2)  # fmt: skip
                done |= {node, second[0]}
        for node, op, _, _, resolution in calls:
            if node in done:
                continue
            if resolution.implementation == NATIVE:
                splice(node, op, op.native)
                implementation = NATIVE
            else:
                form = self._lower_kernel(node, op, op.kernels[resolution.implementation])
                implementation = f"{resolution.implementation} ({form})"
            record_resolution(self.resolutions, op.name, implementation, resolution.reason)
        return len(calls)

    def _pairs(self, graph: torch.fx.Graph, calls: list) -> list[tuple]:
        """(earlier call, later call) pairs one paired launch can serve, each call in at most one, in graph order."""
        if not self.options["pair"] or self.platform.kind == "cpu":
            return []
        order = {n: i for i, n in enumerate(graph.nodes)}
        waiting: dict[tuple, list] = {}  # (op, implementation, shared arguments) -> unpaired calls, in order
        memo: dict = {}
        pairs = []
        for call in calls:
            node, op, bound, meta, resolution = call
            kernel = op.kernels.get(resolution.implementation)
            if kernel is None or kernel.pair is None:
                continue
            shared = tuple((n, _value_key(v, memo)) for n, v in bound.items() if n not in kernel.pair.own)
            candidates = waiting.setdefault((op.name, kernel.name, shared), [])
            for earlier in candidates:
                e_node, _, _, e_meta, _ = earlier
                if _placement(e_node, node, order) is None:
                    continue
                args = {**e_meta, **{s: meta[o] for o, s in zip(kernel.pair.own, kernel.pair.second)}}
                if kernel.pair.supports(**args) is None:
                    candidates.remove(earlier)
                    pairs.append((earlier, call))
                    break
            else:
                if candidates:
                    logger.info("%s: %s shares its arguments with %s but cannot share its launch (placement or "
                                "shapes)", op.name, node.name, [c[0].name for c in candidates])  # fmt: skip
                candidates.append(call)
        return pairs

    def _lower_pair(
        self, first: torch.fx.Node, bound: dict, second: torch.fx.Node, bound_2: dict, kernel: Kernel
    ) -> bool:
        """Replace two calls by one embedded paired launch (placed by `_placement`); False (graph unchanged) when
        the launch cannot be traced or placed."""
        graph = second.graph
        plan = _placement(first, second, {n: i for i, n in enumerate(graph.nodes)})
        if plan is None:  # an earlier pair's lowering changed what lies between them
            return False
        pair = kernel.pair
        args = {**bound, **{s: bound_2[o] for o, s in zip(pair.own, pair.second)}}
        try:
            traced = trace_body(args, pair.launcher, functional_trace)
        except Exception as e:  # keep the two launches, and say why
            logger.warning("could not pair two %s calls in one launch (%s); launching them apart", kernel.op, e)
            return False
        anchor, move = plan
        after = second
        for n in move:  # kept in graph order: up before `first`, or down after `second`
            if anchor is first:
                first.prepend(n)
            else:
                after.append(n)
                after = n
        with graph.inserting_before(anchor):
            launch = graph.call_function(_paired, ())
            outs = [graph.call_function(operator.getitem, (launch, i)) for i in range(2)]
        for node, out in zip((first, second), outs):
            out.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        insert_body(launch, args, traced)
        return True

    def _lower_kernel(self, node: torch.fx.Node, op: FusedOp, kernel: Kernel) -> str:
        if self.platform.kind != "cpu" and kernel.launcher is not None:
            try:
                splice(node, op, kernel.launcher, trace=functional_trace)
                return "embedded"
            except Exception as e:  # keep the kernel, called through its op, and say why
                logger.warning(
                    "could not embed the %s kernel of %s (%s); calling its op instead", kernel.name, op.name, e
                )
        node.target = kernel.overload
        return "external call"

    def uuid(self) -> str:
        # The resolution depends on the registered kernels and the choices; both join the hash.
        kernels = sorted((name, k.name, k.platforms) for name, op in FUSED_OPS.items() for k in op.kernels.values())
        return hashlib.sha256(
            (super().uuid() + repr(kernels) + repr(sorted(self.choices.items()))).encode()
        ).hexdigest()
