"""`omni-compile build` in artifact mode: compile every region x bucket ahead of time and publish.

Steps: resolve the model and buckets (errors before any slow work), load it, record each target's
calls with one eager forward per bucket (`aot.CallRecorder`), compile one file per (target, signature)
(an AOTInductor package, or on CUDA an Inductor standalone artifact: `aot.FORMATS`), check the files against the eager forward on every bucket, and publish the
directory under a temporary name renamed into place (a failed build leaves nothing behind).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import omni_compile
from omni_compile.artifact import aot
from omni_compile.artifact.manifest import (
    MANIFEST,
    SCHEMA,
    Manifest,
    model_config,
    platform_record,
    weights_summary,
)
from omni_compile.artifact.parity import PARITY_BOUND, bucket_output
from omni_compile.build.session import BuildEvents, BuildOptions, BuildSession, check_out
from omni_compile.config import dtype_name
from omni_compile.errors import ConfigError, OmniCompileError
from omni_compile.graphs import find_regions
from omni_compile.build.record import recording as inspect_recording
from omni_compile.passes.lower_fused_ops import record_resolution

logger = logging.getLogger("omni_compile.artifact")

REPORT_DIR = "report"


def build_artifact(opts: BuildOptions, events: BuildEvents) -> dict[str, Any]:
    """Build the artifact described by `opts`; returns the manifest."""
    t_start = time.perf_counter()
    compiles_before = _compilations()
    session = None
    if opts.store:
        from omni_compile.cache.session import StoreSession

        session = StoreSession(opts.store, warn=getattr(events, "on_warning", None))
    if opts.cache_from:
        raise ConfigError("--cache-from warm-starts a JIT build; use it with --mode jit")
    build = BuildSession.resolve(opts)
    spec, dtype, device, buckets, pm = build.spec, build.dtype, build.device, build.buckets, build.pass_manager
    platform = pm.platform
    if opts.out is None:
        raise ConfigError("an artifact build needs --out DIR")
    out = Path(opts.out)
    check_out(out, opts.force)
    fmt = opts.format or aot.default_format(device)
    if fmt not in aot.FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; choose one of {', '.join(aot.FORMATS)}")

    events.on_stage(f"loading {spec.source} ({dtype_name(dtype)}, {device})")
    t0 = time.perf_counter()
    model = build.load_model()
    load_seconds = time.perf_counter() - t0

    # Load-time weight transforms run before the calls are recorded: the compiled files take the transformed
    # weights. The parity reference stays the model as given (its eager output per bucket, taken first).
    transforms = list(opts.compile.weight_transforms)
    references: dict[str, tuple] = {}  # bucket -> (example inputs, eager output of the model as given)
    transformed: dict[str, int] = {}
    if transforms:
        from omni_compile.weights import apply_transforms

        with torch.no_grad():
            for bucket in buckets:
                inputs = build.example_inputs(model, bucket)
                references[str(bucket)] = (inputs, bucket_output(model(**inputs)).clone())
        transformed = apply_transforms(model, transforms)
        events.on_stage("weight transforms: " + ", ".join(f"{n} ({k} modules)" for n, k in transformed.items()))

    regions = find_regions(model, spec.block_names(model))
    if not regions:
        raise OmniCompileError(f"{spec.source}: no repeated blocks found; nothing to compile ahead of time")
    targets = [aot.Target(r.name, "block", list(r.instances)) for r in regions]
    targets += aot.glue_targets(model, {p for r in regions for p in r.paths})
    events.on_stage(
        f"{len(regions)} region(s): " + ", ".join(f"{r.name} x{len(r.instances)}" for r in regions)
        + f"; glue: {', '.join(t.name for t in targets if t.kind == 'glue') or 'none'}"
        + f"; passes: {', '.join(pm.enabled) or 'none'}"
    )

    # 1. Record the calls of every target, and the eager output per bucket (the parity reference).
    recorder = aot.CallRecorder(targets)
    with recorder, torch.no_grad():
        for bucket in buckets:
            recorder.bucket = str(bucket)
            if str(bucket) in references:  # transformed: record with the same inputs, keep the reference
                model(**references[str(bucket)][0])
            else:
                inputs = build.example_inputs(model, bucket)
                references[str(bucket)] = (inputs, bucket_output(model(**inputs)).clone())
    targets = [t for t in targets if recorder.records[t.name].examples]  # glue never called is not compiled

    # 2. Compile one package per (target, signature) into a temporary directory beside `out`.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        jobs = [(t, sig) for t in targets for sig in recorder.records[t.name].examples]
        compiled: dict[tuple[str, str], aot.CompiledFile] = {}
        to_publish = []  # published to the store only once the artifact has passed its checks
        warned: set[str] = set()  # each distinct compiler warning is shown once per build
        for i, (t, sig) in enumerate(jobs, 1):
            rec = recorder.records[t.name]
            module = dict(t.instances)[rec.instances[sig][0]]
            rel = Path("regions") / t.name / f"{sig}{aot.FORMATS[fmt]}"
            label = f"{t.name}@{sig}"
            what = f"{t.kind} {t.name} [{aot.describe_key(rec.keys[sig])}] ({i}/{len(jobs)})"
            try:
                # The region's graph identity: the trace of its recorded call (no export needed to look
                # it up in a store), or, for a call the recorder could not trace, its exported graph.
                exported = None
                if sig in rec.traces:
                    identity = f"trace:{rec.traces[sig]}"
                else:
                    exported = aot.export_region(module, rec.examples[sig])
                    identity = f"export:{exported[1]}"
                key = _cache_key(identity, rec.keys[sig], pm, platform, fmt)
                cf = _from_store(session, key, tmp / rel, identity) if session else None
                if cf is not None:
                    events.on_stage(f"from the store: {what}")
                else:
                    events.on_stage(f"compiling {what}")
                    exported = exported or aot.export_region(module, rec.examples[sig])
                    with inspect_recording(tmp / REPORT_DIR / "inspect"):  # dumps for omni-compile inspect
                        cf = aot.compile_package(module, rec.examples[sig], tmp / rel, pm, label, exported=exported, fmt=fmt)
                    to_publish.append((key, tmp / rel, _entry_meta(cf, label, identity)))
                    fired = ", ".join(f"{k}={n}" for k, n in cf.passes.items() if n) or "no pass matched"
                    events.on_stage(f"  compiled in {cf.seconds:.1f}s: {fired}")
                    for note in cf.notes:
                        logger.info("%s: %s", label, note)
                        if not note.startswith("no C shim") and note not in warned:
                            warned.add(note)
                            events.on_warning(f"while compiling {t.name}: {note}")
                cf.cache_key = key
                cf.identity = identity
            except Exception as e:
                if t.kind == "block":
                    raise OmniCompileError(f"ahead-of-time compile of region {t.name} failed: {type(e).__name__}: {e}") from e
                raise OmniCompileError(
                    f"ahead-of-time compile of the glue module {t.name!r} failed: {type(e).__name__}: {e}"
                ) from e
            cf.file = str(rel)
            compiled[(t.name, sig)] = cf
            logger.info("compiled %s in %.2fs", label, cf.seconds)
        records = recorder.records
        for rec in records.values():
            rec.examples.clear()  # drop the recorded example tensors

        manifest = _manifest(build, model, targets, records, compiled, fmt)
        if transforms:
            manifest["weights"]["transforms"] = transformed

        # 3. Parity: load the packages into this model (as `omni_compile.load` does) and run every bucket.
        # Skipped when every file came from the store and, for every bucket, each file the bucket runs
        # was published by a build that checked that same bucket: the same files in the same places run
        # the same code, and the store verified their bytes (docs/cache.md). `--parity always` checks anyway.
        fresh = {str(path.relative_to(tmp)) for _, path, _ in to_publish}
        inherited = None if fresh or opts.parity == "always" else _inherited_parity(targets, records, compiled, buckets)
        if inherited is not None:
            events.on_stage("parity: every file and bucket was checked by the build that published it; not rerun")
            parity = inherited
        else:
            # the manifest as a load reads it (its results, filled below, not needed to load)
            typed = Manifest.from_json({**manifest, "parity": {}, "timing": {}, "compilations": {}})
            parity = _check_parity(tmp, typed, model, references, fresh, events)
        bad = [b for b, p in parity.items() if not p["finite"] or p["rel_l2_vs_eager"] > PARITY_BOUND[dtype]]
        if bad:
            raise OmniCompileError(
                "the compiled artifact does not match eager on bucket(s) "
                + ", ".join(f"{b} (rel L2 {parity[b]['rel_l2_vs_eager']:.2e})" for b in bad)
                + f"; bound {PARITY_BOUND[dtype]:.0e} for {dtype_name(dtype)}. Nothing was published; "
                "rebuild with --passes=none to see whether a pass is the cause"
            )
        manifest["parity"] = parity
        if session is not None:
            for key, path, meta in to_publish:
                session.publish(key, path.read_bytes(), {**meta, "parity": parity})
            manifest["store"] = session.stats.to_json()
        manifest["timing"] = {
            "model_load_seconds": round(load_seconds, 3),
            "compile_seconds": round(sum(c.seconds for c in compiled.values()), 3),
            "wall_seconds": round(time.perf_counter() - t_start, 3),
        }
        done = _compilations()
        manifest["compilations"] = {k: done[k] - compiles_before[k] for k in done}
        Manifest.from_json(manifest)  # what every reader will read: a field missing or unknown is a bug here
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / REPORT_DIR).mkdir(exist_ok=True)
        (tmp / REPORT_DIR / "build_report.json").write_text(json.dumps(_report(manifest, compiled), indent=2) + "\n")
        _publish(tmp, out, opts.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _check_parity(tmp: Path, manifest, model, references, fresh: set[str], events) -> dict[str, dict]:
    """Load the files in `tmp` into `model` and compare every bucket's output with eager's."""
    from omni_compile.artifact.loader import install, probe_load

    # Files from the store passed this probe on the node that published them (same key: same platform);
    # the files compiled here are probed in a child process before anything loads them here.
    if fresh:
        events.on_stage(f"loading the {len(fresh)} compiled file(s) in a child process")
        probe_load(tmp, manifest, only=fresh)
    events.on_stage("checking the compiled artifact against eager on every bucket")
    installed = install(model, manifest, tmp)
    parity = {}
    try:
        with torch.no_grad():
            for bucket, (inputs, ref) in references.items():
                got = bucket_output(model(**inputs))
                err = float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
                parity[bucket] = {"rel_l2_vs_eager": err, "finite": bool(torch.isfinite(got).all()),
                                  "output_shape": list(got.shape), "checked": "here"}  # fmt: skip
    finally:
        installed.uninstall()
    return parity


def _inherited_parity(targets, records, compiled, buckets) -> dict[str, dict] | None:
    """Each bucket's parity as checked by the builds that published its files, or None when any file
    of any bucket lacks it (then this build checks)."""
    out = {}
    for bucket in map(str, buckets):
        found = None
        for t in targets:
            for sig in records[t.name].buckets.get(bucket, []):
                p = (compiled[(t.name, sig)].parity or {}).get(bucket)
                if p is None:
                    return None
                if found is None or p["rel_l2_vs_eager"] > found["rel_l2_vs_eager"]:
                    found = p
        if found is None:
            return None
        out[bucket] = {**found, "checked": "by the publishing build (store)"}
    return out


# Relative L2 of the artifact's output against eager that a build accepts (bf16 rounds where the
# fused kernels round the unfused graph's bf16 tensors; fp32 differs only by reassociation).

def _compilations() -> dict[str, int]:
    """Files compiled, regions exported and Dynamo graphs traced so far in this process."""
    from torch._dynamo.utils import counters as dynamo_counters

    from omni_compile import counters

    return {"aot_compiles": counters.aot_compiles, "region_exports": counters.region_exports,
            "dynamo_graphs": int(dynamo_counters["stats"].get("unique_graphs", 0))}  # fmt: skip


def _cache_key(identity: str, call_key: tuple, pm, platform, fmt: str = "aoti-package") -> str:
    """The store key of one package (omni_compile.cache.key): graph identity, signature, passes, platform."""
    from omni_compile.cache.key import KeyFactors, device_arch

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
    """The package `key` from the store, written to `path`, or None (a miss, or a store failure)."""
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


def _publish(tmp: Path, out: Path, force: bool) -> None:
    old = None
    if out.exists():
        check_out(out, force)
        old = out.with_name(f".{out.name}.old-{time.time_ns()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _weights_reference(spec, opts) -> dict[str, Any]:
    if spec.weights == "random":
        return {"reference": f"random seed {opts.seed}", "seed": opts.seed}
    root = Path(spec.source)
    files = sorted(root.rglob("*.safetensors")) if root.is_dir() else []
    from omni_compile.artifact.manifest import sha256_file

    return {"reference": str(root), "files": [{"path": str(f.relative_to(root)), "sha256": sha256_file(f)} for f in files]}


def _manifest(build: BuildSession, model, targets, records, compiled, fmt: str) -> dict[str, Any]:
    spec, opts, dtype, device, buckets, pm = build.spec, build.opts, build.dtype, build.device, build.buckets, build.pass_manager
    platform = pm.platform
    # The instantiated model's whole config (defaults included): what a load compares field by field.
    config = model_config(model)
    config_json = json.dumps(spec.config if config is None else config, sort_keys=True, default=str)
    regions = []
    matches: dict[str, int] = {}
    resolutions: dict[str, dict] = {}
    attention: dict[str, dict] = {}
    for t in targets:
        rec = records[t.name]
        files = {}
        for sig in rec.keys:
            cf = compiled[(t.name, sig)]
            files[sig] = {
                "signature": sig,
                "call": aot.describe_key(rec.keys[sig]),
                "key": aot.json_safe(rec.keys[sig]),
                "file": cf.file,
                "sha256": cf.sha256,
                "graph_hash": cf.graph_hash,
                "instances": rec.instances[sig],
                "passes": cf.passes,
                "compile_seconds": round(cf.seconds, 3),
                "cache_key": cf.cache_key,
                "region_identity": cf.identity,
                "source": cf.source,
            }
            if cf.pytree:
                files[sig]["pytree"] = cf.pytree
            for name, n in cf.passes.items():
                matches[name] = matches.get(name, 0) + n
            for op, r in cf.resolutions.items():
                record_resolution(resolutions, op, r["implementation"], r["reason"], r["count"])
            for role, r in cf.attention.items():
                record_resolution(attention, role, r["implementation"], r["reason"], r["count"], r.get("measured"))
        regions.append(
            {
                "name": t.name,
                "kind": t.kind,
                "class": f"{type(t.instances[0][1]).__module__}.{type(t.instances[0][1]).__qualname__}",
                "instances": [p for p, _ in t.instances],
                "buckets": {b: [files[s] for s in sigs] for b, sigs in rec.buckets.items()},
            }
        )
    return {
        "schema": SCHEMA,
        "omni_compile_version": omni_compile.__version__,
        "model": {
            "source": spec.source,
            "family": spec.adapter.family,
            "class": spec.adapter.model_class().__name__,
            "config": json.loads(config_json),
            "config_hash": hashlib.sha256(config_json.encode()).hexdigest(),
        },
        "weights": {**_weights_reference(spec, opts), "tensors": weights_summary(model)},
        "build": {
            "mode": "aot",
            "format": fmt,
            "region_call": aot.REGION_CALL,
            "dtype": dtype_name(dtype),
            "device": device,
            "buckets": [str(b) for b in buckets],
            "text_len": build.text_len,
            "seed": opts.seed,  # of the random weights and the example inputs
            "example_inputs": opts.example_inputs,  # module:function for a model with no adapter (verify uses it)
            "compile_config": aot.json_safe(opts.compile.to_json()),
            "compile_config_hash": opts.compile.compute_hash(),
        },
        "platform": platform_record(platform),
        "pass_uuid": pm.uuid(),
        "regions": regions,
        "attention": {"config": pm.attention_config.to_json(), "per_role": attention,
                      "backends": sorted({r["implementation"] for cf in compiled.values() for r in cf.attention.values()})},
        "fusion": {"passes": pm.enabled, "matches": matches, "fused_op_implementations": resolutions},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _report(manifest: dict[str, Any], compiled: dict) -> dict[str, Any]:
    """report/build_report.json: the manifest's summary plus per-file compile details."""
    return {
        "schema": "omni-compile/artifact-report/1",
        "model": manifest["model"],
        "platform": manifest["platform"],
        "fusion": manifest["fusion"],
        "attention": manifest["attention"],
        "parity": manifest["parity"],
        "timing": manifest["timing"],
        "files": [
            {
                "region": name,
                "signature": sig,
                "file": cf.file,
                "seconds": round(cf.seconds, 3),
                "passes": cf.passes,
                "fused_op_implementations": cf.resolutions,
                "attention": cf.attention,
                "notes": cf.notes,
            }
            for (name, sig), cf in compiled.items()
        ],
    }
