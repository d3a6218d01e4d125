"""`AotiPackage` and `InductorStandalone`: every region compiled ahead of time into one file per call
signature (`artifact.aot.compile_package`), published as a prebuilt artifact (docs/artifact.md): the
files under `regions/`, `manifest.json` (`build.compilers.aot_manifest`) and the inspection dumps.

The traced forwards run eagerly under `artifact.aot.CallRecorder`, which records each region's calls;
`compile` then compiles one file per (region, signature), or takes it from a shared store (docs/cache.md);
the parity check loads the files into the model as `omni_compile.load` does."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import omni_compile
from omni_compile.artifact import aot
from omni_compile.artifact.dynamic import DynamicSpec, families
from omni_compile.artifact.manifest import MANIFEST, Manifest
from omni_compile.artifact.parity import bucket_output
from omni_compile.build.compilers.aot_manifest import manifest as make_manifest
from omni_compile.build.compilers.base import register
from omni_compile.build.record import recording
from omni_compile.errors import ConfigError, OmniCompileError

logger = logging.getLogger("omni_compile.artifact")

REPORT_DIR = "report"


class AotCompiler:
    """The ahead-of-time compilers; a subclass names its file format (`artifact.aot.FORMATS`)."""

    name: str
    format: str
    mode = "aot"
    report_path = f"{REPORT_DIR}/build_report.json"
    eager_trace = True
    compiles_glue = True
    trace_stage = "recording each region's calls"

    def __init__(self):
        self.store = None  # cache.session.StoreSession of --store
        self.recorder: aot.CallRecorder | None = None
        self.compiled: dict[tuple[str, str], aot.CompiledFile] = {}
        self.fresh: set[str] = set()  # files compiled here (not from the store), relative to the output
        self.to_publish: list[tuple[str, Path, dict]] = []  # to the store, once the artifact passed its checks
        self.manifest: dict[str, Any] | None = None
        self.groups: dict[str, list[FileGroup]] = {}  # target -> its compiled files' calls

    @classmethod
    def default_for(cls, device: str) -> bool:
        return aot.default_format(device) == cls.format

    def check(self, opts) -> None:
        if opts.cache_from:
            raise ConfigError("--cache-from warm-starts a JIT build; use it with --mode jit")
        if opts.out is None:
            raise ConfigError("an artifact build needs --out DIR")

    @contextlib.contextmanager
    def open(self, build):
        if build.opts.store:
            from omni_compile.cache.session import StoreSession

            self.store = StoreSession(build.opts.store, warn=build.events.on_warning)
        yield

    def targets(self, build) -> list[aot.Target]:
        blocks = [aot.Target(r.name, "block", list(r.instances)) for r in build.regions]
        return blocks + aot.glue_targets(build.model, {p for r in build.regions for p in r.paths})

    def tracing(self, build) -> aot.CallRecorder:
        self.recorder = aot.CallRecorder(build.targets)
        return self.recorder

    def compile(self, build, tmp: Path) -> list[dict[str, Any]]:
        records = self.recorder.records
        self.groups = {t.name: _groups(records[t.name], build.session.dynamic is not None) for t in build.targets}
        jobs = [(t, g) for t in build.targets for g in self.groups[t.name]]
        warned: set[str] = set()  # each distinct compiler warning is shown once per build
        for i, (t, g) in enumerate(jobs, 1):
            rec = records[t.name]
            rel = Path("regions") / t.name / f"{g.sig}{aot.FORMATS[self.format]}"
            what = f"{t.kind} {t.name} [{g.describe(rec)}] ({i}/{len(jobs)})"
            try:
                cf = self._compile_one(build, t, g, tmp, rel, what, warned)
            except Exception as e:
                which = f"region {t.name}" if t.kind == "block" else f"the glue module {t.name!r}"
                where = model_frame(e)
                raise OmniCompileError(f"ahead-of-time compile of {which} failed"
                                       + (f" in the model's code at {where}" if where else "")
                                       + f": {type(e).__name__}: {e}") from e  # fmt: skip
            cf.file = str(rel)
            self.compiled[(t.name, g.sig)] = cf
            logger.info("compiled %s@%s in %.2fs", t.name, g.sig, cf.seconds)
        for rec in records.values():
            rec.examples.clear()  # drop the recorded example tensors
        called = [t for t in build.targets if records[t.name].keys]
        self.manifest = make_manifest(build, called, records, self.groups, self.compiled, self.format)
        if build.transformed:
            self.manifest["weights"]["transforms"] = build.transformed
        return [_compile_record(name, g, records[name], self.compiled[(name, g.sig)])
                for name, gs in self.groups.items() for g in gs]  # fmt: skip

    def _compile_one(self, build, t: aot.Target, g: FileGroup, tmp: Path, rel: Path, what: str, warned: set[str]):
        rec = self.recorder.records[t.name]
        sig = g.example
        pm, label = build.session.pass_manager, f"{t.name}@{g.sig}"
        module = dict(t.instances)[rec.instances[sig][0]]
        example = rec.examples[sig]
        # The region's graph identity: the trace of its recorded call (no export needed to look it up in a
        # store), or, for a call the recorder could not trace, its exported graph.
        exported = None
        if sig in rec.traces:
            identity = f"trace:{rec.traces[sig]}"
        else:
            exported = aot.export_region(module, example, g.spec, t.name)
            identity = f"export:{exported[1]}"
        signature = rec.keys[sig] if g.spec is None else (rec.keys[sig], json.dumps(g.spec.to_json()))
        key = _cache_key(identity, signature, pm, self.format)
        cf = _from_store(self.store, key, tmp / rel, identity) if self.store else None
        if cf is not None:
            build.events.on_stage(f"from the store: {what}")
            cf.dynamic = g.spec.to_json() if g.spec else None
        else:
            build.events.on_stage(f"compiling {what}")
            exported = exported or aot.export_region(module, example, g.spec, t.name)
            with recording(tmp / REPORT_DIR / "inspect"):  # dumps for omni-compile inspect
                cf = aot.compile_package(module, example, tmp / rel, pm, label, exported=exported, fmt=self.format,
                                         dynamic=g.spec)  # fmt: skip
            self.fresh.add(str(rel))
            self.to_publish.append((key, tmp / rel, _entry_meta(cf, label, identity)))
            fired = ", ".join(f"{k}={n}" for k, n in cf.passes.items() if n) or "no pass matched"
            build.events.on_stage(f"  compiled in {cf.seconds:.1f}s: {fired}")
            for note in cf.notes:
                logger.info("%s: %s", label, note)
                if not note.startswith("no C shim") and note not in warned:
                    warned.add(note)
                    build.events.on_warning(f"while compiling {t.name}: {note}")
        cf.cache_key = key
        cf.identity = identity
        return cf

    def inherited_parity(self, build) -> dict[str, dict] | None:
        """Skipped when every file came from the store and, for every bucket, each file the bucket runs was
        published by a build that checked that same bucket: the same files in the same places run the same
        code, and the store verified their bytes (docs/cache.md). `--parity always` checks anyway."""
        if self.fresh or build.opts.parity == "always" or build.session.check_buckets:
            return None  # (a --dynamic build's middle size is no bucket a publisher recorded: always checked here)
        out = {}
        for bucket in map(str, build.session.buckets):
            found = None
            for name, rec in self.recorder.records.items():
                for sig in rec.buckets.get(bucket, []):
                    file_sig = next(g.sig for g in self.groups[name] if sig in g.members)
                    p = (self.compiled[(name, file_sig)].parity or {}).get(bucket)
                    if p is None:
                        return None
                    if found is None or p["rel_l2_vs_eager"] > found["rel_l2_vs_eager"]:
                        found = p
            if found is None:
                return None
            out[bucket] = {**found, "checked": "by the publishing build (store)"}
        build.events.on_stage("parity: every file and bucket was checked by the build that published it; not rerun")
        return out

    def compiled_outputs(self, build, tmp: Path) -> dict[str, torch.Tensor]:
        """Load the files in `tmp` into the model (as `omni_compile.load` does) and run every bucket."""
        from omni_compile.artifact.loader import install, probe_load

        # the manifest as a load reads it (its results, filled later, are not needed to load)
        typed = Manifest.from_json({**self.manifest, "parity": {}, "timing": {}, "compilations": {}})
        # Files from the store passed this probe on the node that published them (same key: same platform);
        # the files compiled here are probed in a child process before anything loads them here.
        if self.fresh:
            build.events.on_stage(f"loading the {len(self.fresh)} compiled file(s) in a child process")
            probe_load(tmp, typed, only=self.fresh)
        build.events.on_stage("checking the compiled artifact against eager on every bucket")
        installed = install(build.model, typed, tmp)
        try:
            with torch.no_grad():
                return {b: bucket_output(build.model(**inputs)) for b, (inputs, _) in build.references.items()}
        finally:
            installed.uninstall()

    def write(self, build, tmp: Path) -> None:
        m = self.manifest
        m["parity"] = build.parity
        if self.store is not None:
            for key, path, meta in self.to_publish:
                self.store.publish(key, path.read_bytes(), {**meta, "parity": build.parity})
            m["store"] = self.store.stats.to_json()
        m["timing"] = dict(build.timing)
        m["compilations"] = {k: build.compilations[k] for k in ("aot_compiles", "region_exports", "dynamo_graphs")}
        Manifest.from_json(m)  # what every reader will read: a field missing or unknown is a bug here
        (tmp / MANIFEST).write_text(json.dumps(m, indent=2) + "\n")

    def section(self, build) -> dict[str, Any]:
        return {"name": self.name, "mode": self.mode, "format": self.format, "manifest": MANIFEST,
                "region_call": aot.REGION_CALL, "files": sorted({cf.file for cf in self.compiled.values()}),
                "store": self.manifest.get("store")}  # fmt: skip

    def result(self, build, report: dict[str, Any]) -> dict[str, Any]:
        return self.manifest


def model_frame(exc: BaseException) -> str | None:
    """Where in the model's own code (not torch's, not ours, not Python's) an error from tracing it was raised, as
    `file.py:LINE (function)`: the line a user changes (a `.numpy()` or `.tolist()` of a tensor that export cannot
    trace, say). None when no frame of the traceback is the model's."""
    import sys
    import sysconfig

    skip = {Path(sysconfig.get_paths()["stdlib"])}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("torch", "omni_compile", "sympy", "numpy", "triton") and getattr(module, "__file__", None):
            skip.add(Path(module.__file__).parent)
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if frame.filename.startswith("<") or any(path.is_relative_to(d) for d in skip):
            continue
        found = f"{path.name}:{frame.lineno} ({frame.name})"
    return found


@register
class AotiPackage(AotCompiler):
    """AOTInductor packages (.pt2): a shared library per file that the loader maps; no compiler at load."""

    name = format = "aoti-package"


@register
class InductorStandalone(AotCompiler):
    """Inductor standalone artifacts (.bin): the FX-graph cache entry with its wrapper and, on CUDA, the
    compiled Triton kernels; loading runs no Dynamo and compiles no Triton kernel (CUDA's default)."""

    name = format = "inductor-standalone"


@dataclass
class FileGroup:
    """The calls of one region that one compiled file serves: its signature id (the file's name), the call it
    is exported at, the recorded calls it serves, and its symbolic dimensions (None: a static file)."""

    sig: str
    example: str
    members: list[str]
    spec: DynamicSpec | None = None

    def describe(self, rec: aot.CallRecord) -> str:
        """The call it is exported at, readable, its symbolic sizes as '*'."""
        return aot.describe_key(rec.keys[self.example], self.spec.shape if self.spec else ())


def _groups(rec: aot.CallRecord, dynamic: bool) -> list[FileGroup]:
    """One file per recorded call; with `dynamic`, one per family of calls (`artifact.dynamic.families`),
    exported at its largest call (a size of 1 would be specialized, and the largest is what kernels are tuned
    for)."""
    if not dynamic:
        return [FileGroup(sig, sig, [sig]) for sig in rec.keys]
    out = []
    for members in families(rec.keys):
        spec = DynamicSpec.of([rec.keys[s] for s in members])
        if spec is None:
            out.extend(FileGroup(sig, sig, [sig]) for sig in members)
            continue
        example = max(members, key=lambda s: sum(math.prod(t.shape) for t in aot.tensor_leaves(*rec.examples[s])))
        sig = aot.signature_id(("dynamic", rec.keys[example], json.dumps(spec.to_json())))
        out.append(FileGroup(sig, example, members, spec))
    return out


def _compile_record(name: str, g: FileGroup, rec: aot.CallRecord, cf: aot.CompiledFile) -> dict[str, Any]:
    """One file's line in the report's region compiles."""
    return {"region": name, "graph_hash": cf.graph_hash, "seconds": round(cf.seconds, 3), "passes": cf.passes,
            "fused_op_implementations": cf.resolutions, "attention": cf.attention, "signature": g.sig,
            "call": g.describe(rec), "file": cf.file, "sha256": cf.sha256, "source": cf.source,
            "cache_key": cf.cache_key, "notes": cf.notes}  # fmt: skip


def _cache_key(identity: str, call_key: tuple, pm, fmt: str) -> str:
    """The store key of one file (omni_compile.cache.key): graph identity, signature, passes, platform."""
    from omni_compile.cache.key import KeyFactors, device_arch

    platform = pm.platform
    return KeyFactors(
        graph_hash=identity,
        signature=repr(call_key),
        pass_uuid=pm.uuid(),
        torch_version=platform.torch_version,
        triton_version=platform.triton_version,
        device_arch=device_arch(platform),
        omni_compile_version=omni_compile.__version__,
        build_options={"mode": "aot", "format": fmt},
    ).key()


def _entry_meta(cf: aot.CompiledFile, label: str, identity: str) -> dict[str, Any]:
    return {"label": label, "region_identity": identity, "graph_hash": cf.graph_hash, "passes": cf.passes,
            "resolutions": cf.resolutions, "attention": cf.attention, "compile_seconds": round(cf.seconds, 3),
            "pytree": cf.pytree}  # fmt: skip


def _from_store(session, key: str, path: Path, identity: str) -> aot.CompiledFile | None:
    """The file `key` from the store, written to `path`, or None (a miss, or a store failure)."""
    entry = session.fetch(key, identity)
    if entry is None:
        return None
    meta = entry.meta
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(entry.data)  # the store verified the bytes' sha256 (entry.sha256) when it read them
    return aot.CompiledFile(file=str(path), sha256=entry.sha256, graph_hash=meta.get("graph_hash", ""), seconds=0.0,
                            passes=meta.get("passes", {}), resolutions=meta.get("resolutions", {}),
                            attention=meta.get("attention", {}), source="store", pytree=meta.get("pytree"),
                            parity=meta.get("parity"))  # fmt: skip
