"""Ahead-of-time compilation of regions: one compiled file per (region, call signature).

A region is a repeated block class (`graphs.regions`) or a piece of glue: a direct child module of the
transformer that holds no block (FLUX's `x_embedder`, `time_text_embed`, `pos_embed`, `norm_out`,
`proj_out`, ...). One forward of the model per shape bucket records, through forward pre-hooks, the
arguments each instance is called with. For each distinct call signature (tensor shapes, strides and
dtypes, other values, pytree structure) the first instance's module is exported with its parameters
and buffers as inputs (`torch.func.functional_call` under `torch.export`), so one package serves every
instance; Inductor compiles it with our pass manager as the post-grad pass, into an AOTInductor package
(`torch._inductor.aoti_compile_and_package`; loading maps a shared library) or an Inductor standalone
artifact (`standalone_compile`; loading runs no Dynamo and compiles no Triton kernel). See FORMATS.

The few tensor operations of the transformer's own `forward` between those modules (concatenations,
reshapes, the timestep scale) stay in Python; CUDA graphs (`runtime.cuda_graphs`) capture them with
the rest of the step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from omni_compile.graphs.layout import module_device, region_call

if TYPE_CHECKING:  # build-time only: loading an artifact (the server's start) does not import the passes
    from omni_compile.graphs.trace import OpTrace
    from omni_compile.passes import PassManager

logger = logging.getLogger("omni_compile.artifact")


def canonical_call(args: tuple, kwargs: dict, device: torch.device | None = None) -> tuple[tuple, dict]:
    """What the region receives, as the JIT path gives it (`graphs.layout.region_call`): one signature per layout."""
    return region_call(args, kwargs, device)


def call_key(args: tuple, kwargs: dict) -> tuple:
    """A hashable description of one call: pytree structure, then per leaf (shape, stride, dtype,
    device) for tensors or (type, repr) otherwise. kwargs are keyed by name, in sorted order."""
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    out = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type))
        else:
            out.append((type(x).__name__, repr(x)))
    return tuple(out)


def signature_id(key: tuple) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


def describe_key(key: tuple, symbolic=()) -> str:
    """'1x16x32, 1x8x32, None' for the tensor leaves and values of a call key; the (leaf, dim) pairs in `symbolic`
    (a --dynamic file's sizes, `artifact.dynamic.DynamicSpec.shape`) written as '*'."""
    symbolic = set(symbolic)
    parts = []
    for i, leaf in enumerate(key[1:]):
        if len(leaf) == 4:
            parts.append("x".join("*" if (i, d) in symbolic else str(v) for d, v in enumerate(leaf[0])) or "scalar")
        else:
            parts.append(leaf[1])
    return ", ".join(parts)


@dataclass
class Target:
    """A module class compiled as one region: its instances (path, module) in model order."""

    name: str
    kind: str  # "block" or "glue"
    instances: list[tuple[str, nn.Module]]


@dataclass
class CallRecord:
    """The calls seen for one target: signature id -> example (args, kwargs), key, buckets, instances."""

    examples: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    keys: dict[str, tuple] = field(default_factory=dict)
    buckets: dict[str, list[str]] = field(default_factory=dict)  # bucket -> signature ids (call order)
    instances: dict[str, list[str]] = field(default_factory=dict)  # signature id -> instance paths
    traces: dict[str, str] = field(default_factory=dict)  # signature id -> graphs.trace hash of its first call


def glue_targets(model: nn.Module, block_paths: set[str]) -> list[Target]:
    """Direct children of `model` that hold no block instance (and have parameters or buffers or are
    called: an uncalled child is dropped after the recording forward)."""
    out = []
    for name, child in model.named_children():
        inside = any(p == name or p.startswith(name + ".") for p in block_paths)
        if not inside:
            out.append(Target(name=name, kind="glue", instances=[(name, child)]))
    return out


class CallRecorder:
    """Forward hooks on every instance of every target, recording calls per bucket. The first call of
    each signature also runs under `graphs.trace.OpTrace`: its hash is the region's graph identity in
    the store key, so a build whose files all come from a store never exports a region."""

    def __init__(self, targets: list[Target]):
        self.targets = targets
        self.records = {t.name: CallRecord() for t in targets}
        self.bucket = None
        self._handles = []
        self._tracing: tuple[nn.Module, CallRecord, str, OpTrace] | None = None

    def __enter__(self):
        for t in self.targets:
            for path, module in t.instances:
                self._handles.append(module.register_forward_pre_hook(self._hook(t.name, path), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._end_trace, always_call=True))
        return self

    def __exit__(self, *exc):
        if self._tracing is not None:  # the traced call raised
            self._tracing[3].__exit__(None, None, None)
            self._tracing = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def compiles(self) -> int:
        """Distinct calls recorded so far: one compiled file each (a `build.compilers.base.Tracer`)."""
        return sum(len(rec.keys) for rec in self.records.values())

    def _end_trace(self, module, *_):
        if self._tracing is not None and self._tracing[0] is module:
            _, rec, sig, trace = self._tracing
            self._tracing = None
            trace.__exit__(None, None, None)
            rec.traces[sig] = trace.hexdigest()

    def _hook(self, target: str, path: str):
        def hook(module, args, kwargs):
            args, kwargs = canonical_call(args, kwargs, module_device(module))
            key = call_key(args, kwargs)
            sig = signature_id(key)
            rec = self.records[target]
            if sig not in rec.examples:
                rec.examples[sig] = (args, kwargs)
                rec.keys[sig] = key
                if self._tracing is None:  # targets do not nest; this guards against a model where they do
                    from omni_compile.graphs.trace import OpTrace, named_call_inputs

                    trace = OpTrace(named_call_inputs(module_state(module), args, kwargs))
                    self._tracing = (module, rec, sig, trace)
                    trace.__enter__()
            seen = rec.buckets.setdefault(self.bucket, [])
            if sig not in seen:
                seen.append(sig)
            paths = rec.instances.setdefault(sig, [])
            if path not in paths:
                paths.append(path)
            return args, kwargs

        return hook


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name: what a compiled region takes as its first input."""
    state = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    return state


# How a compiled region is called: (state, tensors), the instance's parameters and buffers by name and
# the tensor leaves of the call in `call_leaves` order. The call's other values (ints, flags, a
# torch.dtype or torch.device a glue module takes, None) are constants of the compiled file: the call
# key holds each one's value, so a call with other values has another key and another file.
REGION_CALL = "state+tensor-leaves"


def call_leaves(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """The leaves of one call (kwargs in sorted order, as `call_key` takes them) and their tree spec."""
    return pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))


def tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """What a compiled region takes after the state: the call's tensors, in `call_leaves` order."""
    return [x for x in call_leaves(args, kwargs)[0] if isinstance(x, torch.Tensor)]


class _Functional(nn.Module):
    """`module` with its parameters and buffers as inputs and the call's tensors as the other input,
    the example call's non-tensor values fixed (see REGION_CALL). The module is held, not registered,
    so the exported program owns no weights: every instance's tensors come in as arguments."""

    def __init__(self, module: nn.Module, example: tuple[tuple, dict]):
        super().__init__()
        object.__setattr__(self, "_target", module)
        leaves, self._spec = call_leaves(*example)
        self._constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._is_tensor = [isinstance(x, torch.Tensor) for x in leaves]

    def forward(self, state, tensors):
        given = iter(tensors)
        leaves = [next(given) if t else c for t, c in zip(self._is_tensor, self._constants)]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return torch.func.functional_call(self._target, state, args, kwargs, strict=True)


# The compiled-file formats. "aoti-package": an AOTInductor package (.pt2), a shared library the loader
# maps (no Dynamo, no Inductor, no compiler at load). "inductor-standalone": Inductor's standalone
# artifact (`torch._inductor.standalone_compile`, saved binary): the FX-graph cache entry with its
# Python wrapper and, on CUDA, the compiled Triton kernels (cubins); loading it imports Inductor's
# runtime and runs no Dynamo, no tracing and no Triton compile. On CPU its C++ kernels are compiled at
# load, so CPU builds use AOTInductor. CUDA builds default to the standalone format: on torch
# 2.11.0+cu130 (the H200 image) every AOTInductor package, CUDA or CPU, crashes its loader in the
# generated library's device-string parser (docs/artifact.md#compiled-file-formats).
FORMATS = {"aoti-package": ".pt2", "inductor-standalone": ".bin"}


def default_format(device: str) -> str:
    return "inductor-standalone" if torch.device(device).type == "cuda" else "aoti-package"


@dataclass
class CompiledFile:
    file: str
    sha256: str
    graph_hash: str
    seconds: float
    passes: dict[str, int]
    resolutions: dict[str, dict]
    attention: dict[str, dict]
    source: str = "compiled"  # or "store": taken from a shared store (omni_compile.cache)
    dynamic: dict | None = None  # build --dynamic: the file's symbolic dimensions (artifact.dynamic.DynamicSpec)
    cache_key: str | None = None
    pytree: dict[str, str] | None = None  # inductor-standalone: the call's input and output tree specs
    identity: str | None = None  # the graph identity in the cache key: "trace:SHA" (graphs.trace) or "export:SHA"
    parity: dict | None = None  # from a store: the publishing build's parity check, per bucket
    notes: list[str] = field(default_factory=list)  # what Inductor warned about while compiling (CompileNotes)


def export_region(module: nn.Module, example: tuple[tuple, dict], dynamic=None, name: str = ""):
    """`module` exported at `example` with its state as an input; returns (program, graph hash). `dynamic` (an
    `artifact.dynamic.DynamicSpec`): the call's dimensions to export as symbolic sizes (`build --dynamic`)."""
    from omni_compile import counters

    counters.region_exports += 1
    state = module_state(module)
    shapes = None
    if dynamic is not None:
        from omni_compile.artifact.dynamic import check_symbolic

        key = call_key(*example)
        shapes = ({k: None for k in state}, dynamic.export_shapes(key))
    with torch.no_grad():
        ep = torch.export.export(_Functional(module, example), (state, tensor_leaves(*example)), strict=False,
                                 dynamic_shapes=shapes)  # fmt: skip
    if dynamic is not None:
        check_symbolic(ep, dynamic, key, name or type(module).__name__)
    return ep, hashlib.sha256(ep.graph_module.code.encode()).hexdigest()


def compile_package(
    module: nn.Module,
    example: tuple[tuple, dict],
    path: Path,
    pass_manager: PassManager,
    label: str,
    exported=None,
    fmt: str = "aoti-package",
    dynamic=None,
) -> CompiledFile:
    """Export `module` at `example` with its state as an input (or take `exported`, the result of
    `export_region`) and compile it ahead of time into `path` in format `fmt` (see FORMATS). `dynamic`: the
    symbolic dimensions (`export_region`), which the compiled code keeps symbolic."""
    from omni_compile import counters
    from omni_compile.artifact.manifest import sha256_file

    if fmt not in FORMATS:
        raise ValueError(f"unknown compiled-file format {fmt!r}; known: {', '.join(FORMATS)}")
    t0 = time.perf_counter()
    ep, graph_hash = exported or export_region(module, example, dynamic, label)
    pass_manager.prepare()
    from omni_compile.passes import PassLog

    log = PassLog(label=label)
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = None
    with pass_manager.recording(log), CompileNotes() as notes:
        if fmt == "aoti-package":
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(path), inductor_configs={"post_grad_custom_post_pass": pass_manager}
            )
        else:
            specs = _standalone(ep, (module_state(module), tensor_leaves(*example)), path, pass_manager,
                                dynamic is not None)  # fmt: skip
    counters.aot_compiles += 1
    return CompiledFile(
        file=str(path),
        sha256=sha256_file(path),
        graph_hash=graph_hash,
        seconds=time.perf_counter() - t0,
        passes=log.matches(),
        resolutions=log.resolutions,
        attention=log.attention,
        pytree=specs,
        notes=notes.lines(),
        dynamic=dynamic.to_json() if dynamic is not None else None,
    )


class CompileNotes:
    """What Inductor says while compiling one file, collected instead of printed over the progress display.

    Dropped: torch's own FutureWarning about `LeafSpec` (raised by pickling its tree specs, nothing a user
    can act on). Kept as notes, one line each, in the build report and on request in the log: the ops
    AOTInductor runs through its proxy executor for want of a C shim (one W-level log line per use
    otherwise), and every other warning (e.g. Inductor falling back to eager for complex operators)."""

    _SHIM = re.compile(r"(\S+) is missing a c-shim implementation")

    def __init__(self):
        self.shim_fallbacks: list[str] = []
        self.warnings: list[str] = []
        self._catch = warnings.catch_warnings(record=True)

    def filter(self, record: logging.LogRecord) -> bool:
        m = self._SHIM.search(record.getMessage())
        if m is None:
            return True
        if m.group(1) not in self.shim_fallbacks:
            self.shim_fallbacks.append(m.group(1))
        return False

    def __enter__(self):
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")
        logging.getLogger("torch._inductor.ir").addFilter(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("torch._inductor.ir").removeFilter(self)
        self._catch.__exit__(*exc)
        for w in self._caught:
            text = f"{w.category.__name__}: {w.message}"
            if "LeafSpec" not in text and text not in self.warnings:
                self.warnings.append(text)
        return False

    def lines(self) -> list[str]:
        out = list(self.warnings)
        if self.shim_fallbacks:
            out.append("no C shim, run through the proxy executor: " + ", ".join(self.shim_fallbacks))
        return out


def _standalone(ep, example: tuple, path: Path, pass_manager: PassManager, dynamic: bool = False) -> dict[str, str]:
    """Compile the exported program with `standalone_compile` and save it to `path`; returns the
    serialized input and output tree specs the loader flattens and unflattens a call with. `dynamic`: the
    program has symbolic sizes, which the compile takes from its graph (else from the example's sizes)."""
    from torch._inductor.utils import fresh_cache

    gm = ep.module()
    for node in list(gm.graph.nodes):  # export's input-guard check: a submodule the cache cannot pickle
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    out_spec = gm.graph._codegen.pytree_info.out_spec
    gm.graph._codegen = torch.fx.graph.CodeGen()  # flat inputs in, the flat output tuple out
    gm.recompile()
    flat, in_spec = pytree.tree_flatten((example, {}))
    if dynamic:
        # Compiled at the program's own fake tensors, whose sizes are symbolic; "from_graph" takes their fake mode
        # (with its shape environment) from the output's example values, which a Dynamo graph has and an
        # exported one names "val".
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        flat = [n.meta["val"] for n in placeholders]
        for node in pytree.tree_leaves(gm.graph.output_node().args):
            if isinstance(node, torch.fx.Node) and "val" in node.meta:
                node.meta.setdefault("example_value", node.meta["val"])
    # A fresh Inductor cache: a hit in the machine's own cache would skip our passes (and their match
    # log); the artifact carries everything it needs, so nothing of that cache is wanted.
    with fresh_cache():
        art = torch._inductor.standalone_compile(
            gm, flat, dynamic_shapes="from_graph" if dynamic else "from_example_inputs",
            options={"config_patches": {"post_grad_custom_post_pass": pass_manager}},
        )  # fmt: skip
        art.save(path=str(path), format="binary")
    return {"in": pytree.treespec_dumps(in_spec), "out": pytree.treespec_dumps(out_spec)}


class StandaloneRunner:
    """Calls a loaded `inductor-standalone` file as a package runner is called: (state, tensors)."""

    def __init__(self, artifact, specs: dict[str, str]):
        self.artifact = artifact
        self.in_spec = pytree.treespec_loads(specs["in"])
        self.out_spec = pytree.treespec_loads(specs["out"])
        self._checked = False

    def __call__(self, state, tensors):
        flat, spec = pytree.tree_flatten(((state, tensors), {}))
        if not self._checked:  # once: the instance's state names and the call's structure are the build's
            if spec != self.in_spec:
                raise RuntimeError(f"call structure differs from the compiled one: {spec} vs {self.in_spec}")
            self._checked = True
        return pytree.tree_unflatten(list(self.artifact(*flat)), self.out_spec)


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
