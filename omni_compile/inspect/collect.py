"""Collect an inspection: from an artifact's stored dumps, or by compiling a model once.

A model target is compiled just in time (each distinct region traced and compiled once per shape
bucket, one forward per bucket) with Inductor's caches off, so the passes run and are recorded
(`record.recording`); then the Dynamo view and, with `--profile`, one profiled step per bucket. An
artifact target is read from `ART/report/inspect/` (written by the build), its manifest and build
report: nothing is compiled or run, and no GPU is needed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import omni_compile
from omni_compile.config import CompileConfig, dtype_name
from omni_compile.errors import ConfigError
from omni_compile.inspect.graphs import dynamo_call, read_graph_dumps
from omni_compile.inspect.kernels import read_kernels
from omni_compile.artifact.parity import bucket_output, rel_l2
from omni_compile.build.record import capture_output_code

SCHEMA = "omni-compile/inspect/1"
DUMPS = "inspect"  # under an artifact's report/ directory
RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


@dataclass
class InspectOptions:
    target: str | None = None
    shapes: str | None = None
    dtype: str | None = None
    device: str | None = None
    seed: int = 0
    text_len: int | None = None
    model_config: dict[str, Any] | None = None
    example_inputs: str | None = None
    regions: list[str] | None = None
    compile: CompileConfig = field(default_factory=CompileConfig)
    profile: bool = False
    dynamo: bool = True


def is_artifact(target: str | None) -> bool:
    return target is not None and (Path(target) / "manifest.json").is_file()


def inspect(opts: InspectOptions, workdir: Path, on_stage=lambda msg: None) -> dict[str, Any]:
    """The inspection report (schema `omni-compile/inspect/1`, docs/inspect.md) of `opts.target`.
    `workdir` receives the raw dumps of a model target."""
    if is_artifact(opts.target):
        if opts.profile:
            raise ConfigError("--profile runs the model; inspect the model (preset, directory or module:Class) "
                              "with --shapes to profile it, an artifact is read from its stored dumps")  # fmt: skip
        return inspect_artifact(Path(opts.target))
    return inspect_model(opts, workdir, on_stage)


def _graph_entry(directory: Path, key: str, graph_hash: str, buckets: list[str], call: str | None, matches,
                 resolutions, attention):  # fmt: skip
    """One compiled graph. `call` says what it was compiled for (the artifact's call description); None
    for a model target: the call's inputs as Dynamo captured them."""
    present = directory.is_dir()  # not for a file an artifact build took from a store: its passes ran elsewhere
    dumps = read_graph_dumps(directory, matches)
    return {
        "key": key,
        "graph_hash": graph_hash,
        "buckets": buckets,
        "call": dynamo_call(dumps["dynamo_graph"]) if call is None else call,
        "dump_dir": str(directory),
        "matches": matches,
        "dumps": present,
        "fused_op_implementations": resolutions or {},
        "attention": attention or {},
        **dumps,
        "kernels": read_kernels(directory),
    }


def inspect_artifact(root: Path) -> dict[str, Any]:
    from omni_compile.artifact.manifest import read_manifest

    manifest = read_manifest(root)
    dumps = root / "report" / DUMPS
    if not dumps.is_dir():
        raise ConfigError(f"{root} holds no inspection dumps (report/{DUMPS}/): it was built by an omni-compile "
                          "without them; rebuild it, or inspect the model with --shapes")  # fmt: skip
    report_path = root / "report" / "build_report.json"
    files = {}  # file -> its compile in the build report
    quality = None
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        costs = {b: {"rel_l2_vs_lossless": p["rel_l2_vs_lossless"]}
                 for b, p in (report.get("parity") or {}).get("buckets", {}).items() if "rel_l2_vs_lossless" in p}
        if costs:  # the build measured a lossy option's cost
            quality = {"lossy": lossy_options(CompileConfig.from_dict(manifest.build.compile_config)),
                       "buckets": costs}  # fmt: skip
        # build-report/2: the regions' compiles; artifact-report/1 (artifacts built before it): a list of files
        compiles = report.get("files") or [c for r in report.get("regions", []) for c in r.get("compiles", [])]
        files = {c["file"]: c for c in compiles if "file" in c}
    regions = []
    for r in manifest.regions:
        by_sig: dict[str, dict] = {}
        for bucket, entries in r.buckets.items():
            for e in entries:
                by_sig.setdefault(e.signature, {"entry": e, "buckets": []})["buckets"].append(bucket)
        graphs = []
        for sig, item in by_sig.items():
            e = item["entry"]
            extra = files.get(e.file, {})
            graphs.append(_graph_entry(dumps / r.name / sig, sig, e.graph_hash, item["buckets"], e.call, e.passes,
                                       extra.get("fused_op_implementations"), extra.get("attention")))  # fmt: skip
        regions.append({"name": r.name, "kind": r.kind, "class": r.cls, "instances": r.instances, "graphs": graphs})
    m, b = manifest.model, manifest.build
    return {
        "schema": SCHEMA,
        "target": {"kind": "artifact", "path": str(root)},
        "model": {"source": m.source, "family": m.family, "class": m.cls},
        "dtype": b.dtype,
        "device": b.device,
        "buckets": b.buckets,
        "platform": manifest.platform,
        "passes": {"enabled": manifest.fusion["passes"], "uuid": manifest.pass_uuid,
                   "matches": manifest.fusion["matches"]},  # fmt: skip
        "attention": manifest.attention["per_role"],
        "fused_op_implementations": manifest.fusion["fused_op_implementations"],
        "regions": regions,
        "dynamo": {"available": False, "reason": "an artifact is exported with torch.export (no Dynamo entry "
                   "points are stored); inspect the model for the Dynamo view"},  # fmt: skip
        "profile": None,
        "quality": quality,
    }


def lossy_options(config: CompileConfig) -> list[str]:
    """The lossy options `config` asks for: weight transforms (fp8) and attention backends named by the user."""
    from omni_compile.attention.backends import BACKENDS
    from omni_compile.weights import LOSSY

    names = [f"weight transform {t}" for t in config.weight_transforms if t in LOSSY]
    from omni_compile.attention.config import AttentionConfig

    named = dict.fromkeys(choice.backend for _, choice in AttentionConfig.from_json(config.attention).choices())
    names += [f"attention {b}" for b in named if b in BACKENDS and BACKENDS[b].lossy]
    return names


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        with contextlib.suppress(Exception):
            self.lines.append(record.getMessage())


@contextlib.contextmanager
def _capture_log(name: str, artifact: str | None = None):
    """The messages of logger `name` inside the block (not propagated to torch's own handlers). Dynamo
    emits an `artifact` (e.g. "recompiles") only when it is enabled in torch's log state: enabled here."""
    logger, handler = logging.getLogger(name), _Lines()
    level, propagate = logger.level, logger.propagate
    state = getattr(getattr(torch._logging, "_internal", None), "log_state", None)
    names = getattr(state, "artifact_names", None)
    added = artifact is not None and isinstance(names, set) and artifact not in names
    if added:
        names.add(artifact)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        if added:
            names.discard(artifact)


def _no_caches(profile_cpu: bool):
    patches = {"fx_graph_cache": False, "autotune_local_cache": False}
    if profile_cpu:
        patches["cpp.enable_kernel_profile"] = True  # a profiler range per generated C++ kernel
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(patches))
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def inspect_model(opts: InspectOptions, workdir: Path, on_stage=lambda msg: None) -> dict[str, Any]:
    from omni_compile.build.session import BuildOptions, BuildSession, sync
    from omni_compile.compiler import compile, compile_state

    bopts = BuildOptions(model=opts.target, shapes=opts.shapes, dtype=opts.dtype, device=opts.device, seed=opts.seed,
                         text_len=opts.text_len, example_inputs=opts.example_inputs, model_config=opts.model_config,
                         regions=opts.regions, compile=opts.compile, mode="jit")  # fmt: skip
    build = BuildSession.resolve(bopts)
    spec, dtype, device, buckets = build.spec, build.dtype, build.device, build.buckets
    on_stage(f"loading {spec.source} ({dtype_name(dtype)}, {device})")
    model = build.load_model()
    root = Path(workdir) / "dumps"
    shutil.rmtree(root, ignore_errors=True)  # only this run's dumps
    config = replace(opts.compile, dump_dir=str(root))
    inputs = {}
    graph_buckets: dict[int, str] = {}
    t0 = time.perf_counter()
    cpu_profile = opts.profile and torch.device(device).type == "cpu"
    lossy = lossy_options(config)
    lossless = {}  # bucket -> the eager output of the model as given: what a lossy option's cost is measured on
    if lossy:
        on_stage(f"{', '.join(lossy)} (lossy): the eager output of the model as given, for the cost")
        with torch.no_grad():
            for bucket in buckets:
                inputs[str(bucket)] = build.example_inputs(model, bucket)
                lossless[str(bucket)] = bucket_output(model(**inputs[str(bucket)])).detach().clone()
    quality = None
    with _no_caches(cpu_profile), capture_output_code(), _capture_log(RECOMPILES_LOGGER, "recompiles") as recompiles:
        compile(model, config, regions=spec.block_names(model), adapter=spec.adapter)
        state = compile_state(model)
        examples = _ExampleCalls(state.regions)
        for bucket in buckets:
            on_stage(f"bucket {bucket}: tracing and compiling each distinct region once")
            inputs.setdefault(str(bucket), build.example_inputs(model, bucket))
            before = len(state.records)
            with torch.no_grad(), examples:
                out = model(**inputs[str(bucket)])
            sync(device)
            if lossy:
                quality = quality or {"lossy": lossy, "buckets": {}}
                err = rel_l2(bucket_output(out), lossless[str(bucket)])
                quality["buckets"][str(bucket)] = {"rel_l2_vs_lossless": err}
            for i in range(before, len(state.records)):
                graph_buckets[i] = str(bucket)
        compile_seconds = time.perf_counter() - t0
        profile = None
        if opts.profile:
            from omni_compile.inspect.profile import profile_buckets

            on_stage("profiling one step per bucket")
            profile = profile_buckets(model, state.regions, inputs, device)
    regions = []
    for region in state.regions:
        graphs = []
        for i, rec in enumerate(state.records):
            if rec.region != region.name:
                continue
            key = rec.graph_hash[:12]
            graphs.append(_graph_entry(root / region.name / key, key, rec.graph_hash, [graph_buckets.get(i, "?")],
                                       None, rec.passes, rec.resolutions, rec.attention))  # fmt: skip
        cls = f"{region.cls.__module__}.{region.cls.__qualname__}"
        regions.append({"name": region.name, "kind": "block", "class": cls, "instances": region.paths,
                        "graphs": graphs})  # fmt: skip
    dynamo = None
    if opts.dynamo:
        from omni_compile.inspect.dynamo import dynamo_view

        on_stage("Dynamo view: decompiled entry points, graph breaks")
        dynamo = dynamo_view(state, examples.calls, recompiles)
    from omni_compile.build.report import summarize

    total = summarize([rec.to_json() for rec in state.records])
    return {
        "schema": SCHEMA,
        "target": {"kind": "model", "source": spec.source},
        "model": {"source": spec.source, "family": spec.adapter.family, "class": spec.adapter.model_class().__name__},
        "dtype": dtype_name(dtype),
        "device": device,
        "buckets": [str(b) for b in buckets],
        "platform": state.platform.to_json(),
        "passes": {"enabled": state.pass_manager.enabled, "uuid": state.pass_uuid, "matches": total["matches"]},
        "attention": total["attention"],
        "fused_op_implementations": total["fused_op_implementations"],
        "regions": regions,
        "dynamo": dynamo,
        "profile": profile,
        "quality": quality,
        "compile_seconds": round(compile_seconds, 3),
        "omni_compile_version": omni_compile.__version__,
    }


class _ExampleCalls:
    """Forward pre-hooks on the first instance of each region: its first call's (module, args, kwargs)."""

    def __init__(self, regions):
        self.regions = regions
        self.calls: dict[str, tuple] = {}
        self._handles = []

    def __enter__(self):
        for r in self.regions:
            if r.name in self.calls:
                continue
            module = r.instances[0][1]
            self._handles.append(module.register_forward_pre_hook(self._hook(r.name), with_kwargs=True))
        return self

    def _hook(self, name):
        def hook(module, args, kwargs):
            self.calls.setdefault(name, (module, args, kwargs))

        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False
