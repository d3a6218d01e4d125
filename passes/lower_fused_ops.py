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
    whose `tensors_to_clone` are exactly those fresh buffers (the launchers write nothing else), and
    later uses read the buffers from its result. Inductor's re-inplacing drops the clones of the fresh
    buffers, then lowers the launches like user-defined Triton kernels. Tracing runs in the fake mode of
    the example values, and needs no GPU: Triton's own mutation analysis is not used.
    """
    import operator

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
        outs = [k for k, v in params.items() if isinstance(v, torch.fx.Node) and v.target in fresh]
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


def splice_body(node: torch.fx.Node, bound: dict, impl, trace=fake_trace) -> None:
    """Replace `node` by the traced body of `impl(**bound)`, in place: the graph nodes among `bound`'s
    values become the body's inputs, the other values are constants of the trace."""
    tensors = [n for n, v in bound.items() if isinstance(v, torch.fx.Node)]
    constants = {n: v for n, v in bound.items() if n not in tensors}

    def body(*values):
        return impl(**dict(zip(tensors, values)), **constants)

    traced = trace(body, [bound[n].meta["val"] for n in tensors])
    graph = node.graph
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        out = graph.graph_copy(traced.graph, {ph: bound[name] for ph, name in zip(placeholders, tensors)})
    if isinstance(out, (tuple, list)):  # an op with several outputs: its users are getitem nodes
        import operator

        for user in list(node.users):
            if user.target is not operator.getitem:
                raise RuntimeError(f"a user of the multi-output op {node.format_node()} is not a getitem: {user}")
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def splice(node: torch.fx.Node, op: FusedOp, impl, trace=fake_trace) -> None:
    """Replace the fused-op call `node` by the traced body of `impl` (same arguments as the op), in place."""
    bound = dict(zip(op.arg_names, node.args))
    bound.update(node.kwargs)
    splice_body(node, {n: bound.get(n) for n in op.arg_names}, impl, trace)


def inline_native(node: torch.fx.Node, op: FusedOp) -> None:
    """Replace one fused-op call by the traced body of its native implementation, in place."""
    splice(node, op, op.native)


def record_resolution(table: dict[str, dict], op: str, implementation: str, reason: str, count: int = 1,
                      measured: dict[str, dict] | None = None) -> None:  # fmt: skip
    """Add `count` calls of `op` resolved to `implementation` to a report table (op -> implementation,
    reason, count); calls of one op resolved differently make it "mixed" with every reason kept.
    `measured`: shape -> {implementation: ms or why dropped}, for a choice made by timing (kept per shape)."""
    entry = table.setdefault(op, {"implementation": None, "reason": None, "count": 0})
    if entry["implementation"] not in (None, implementation):
        entry["implementation"] = "mixed"
        entry["reason"] = f"{entry['reason']} | {implementation}: {reason}"
    else:
        entry["implementation"], entry["reason"] = implementation, reason
    entry["count"] += count
    if measured:
        entry.setdefault("measured", {}).update(measured)


class LowerFusedOpsPass(OmniPass):
    """Replaces each fused-op call by its resolved implementation (native body or platform kernel)."""

    name = "lower_fused_ops"

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
        calls = [n for n in graph.nodes if n.op == "call_function" and n.target in ops]
        for node in calls:
            op = ops[node.target]
            bound = dict(zip(op.arg_names, node.args))
            bound.update(node.kwargs)
            meta = {n: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for n, v in bound.items()}
            resolution = op.resolve(self.platform, meta, self.choices.get(op.name, "auto"))
            if resolution.implementation == NATIVE:
                splice(node, op, op.native)
                implementation = NATIVE
            else:
                form = self._lower_kernel(node, op, op.kernels[resolution.implementation])
                implementation = f"{resolution.implementation} ({form})"
            record_resolution(self.resolutions, op.name, implementation, resolution.reason)
        return len(calls)

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
