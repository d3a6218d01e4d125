"""The `manifest.json` an ahead-of-time build writes (schema `artifact.manifest.SCHEMA`, read by every load):
what was built, from which model and weights, on which platform, and each region's files per bucket."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import omni_compile
from omni_compile.artifact import aot
from omni_compile.artifact.manifest import SCHEMA, platform_record, sha256_file, weights_summary
from omni_compile.build.report import model_summary, summarize
from omni_compile.config import dtype_name


def manifest(build, targets: list[aot.Target], records: dict[str, aot.CallRecord], groups: dict[str, list],
             compiled: dict[tuple[str, str], aot.CompiledFile], fmt: str) -> dict[str, Any]:  # fmt: skip
    """The manifest of `build` (a `build.pipeline.BuildPipeline`) without its results (parity, timing,
    compilations, store), which the build fills in once it has them. `groups`: target -> the
    `build.compilers.aot.FileGroup`s of its files (one per call signature, or per family with --dynamic)."""
    session, model = build.session, build.model
    spec, opts, pm = session.spec, session.opts, session.pass_manager
    regions = []
    for t in targets:
        rec = records[t.name]
        entries = {g.sig: _file_entry(g, rec, compiled[(t.name, g.sig)]) for g in groups[t.name]}
        file_of = {m: g.sig for g in groups[t.name] for m in g.members}
        cls = type(t.instances[0][1])
        buckets = {b: [entries[f] for f in dict.fromkeys(file_of[s] for s in sigs)] for b, sigs in rec.buckets.items()}
        regions.append({"name": t.name, "kind": t.kind, "class": f"{cls.__module__}.{cls.__qualname__}",
                        "instances": [p for p, _ in t.instances], "buckets": buckets})  # fmt: skip
    done = [{"passes": cf.passes, "fused_op_implementations": cf.resolutions, "attention": cf.attention}
            for cf in compiled.values()]  # fmt: skip
    total = summarize(done)
    return {
        "schema": SCHEMA,
        "omni_compile_version": omni_compile.__version__,
        "model": model_summary(spec, model),
        "weights": {**_weights_reference(spec, opts), "tensors": weights_summary(model)},
        "build": {
            "mode": "aot",
            "format": fmt,
            "region_call": aot.REGION_CALL,
            "dtype": dtype_name(session.dtype),
            "device": session.device,
            "buckets": [str(b) for b in session.buckets],
            **_dynamic_record(session),
            "text_len": session.text_len,
            "seed": opts.seed,  # of the random weights and the example inputs
            "example_inputs": opts.example_inputs,  # module:function for a model with no adapter (verify uses it)
            "compile_config": aot.json_safe(opts.compile.to_json()),
            "compile_config_hash": opts.compile.compute_hash(),
        },
        "platform": platform_record(pm.platform),
        "pass_uuid": pm.uuid(),
        "regions": regions,
        "attention": {"config": pm.attention_config.to_json(), "per_role": total["attention"],
                      "backends": sorted({r["implementation"] for c in done for r in c["attention"].values()})},
        "fusion": {"passes": pm.enabled, "matches": total["matches"],
                   "fused_op_implementations": total["fused_op_implementations"]},  # fmt: skip
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _dynamic_record(session) -> dict[str, Any]:
    """`build.dynamic` of a --dynamic build: the range and the sizes checked that no forward recorded."""
    if session.dynamic is None:
        return {}
    return {"dynamic": {**session.dynamic.to_json(), "checked": [str(b) for b in session.check_buckets]}}


def _file_entry(g, rec: aot.CallRecord, cf: aot.CompiledFile) -> dict[str, Any]:
    key = rec.keys[g.example]
    instances = list(dict.fromkeys(p for m in g.members for p in rec.instances[m]))
    entry = {"signature": g.sig, "call": g.describe(rec), "key": aot.json_safe(key),
             "file": cf.file, "sha256": cf.sha256, "graph_hash": cf.graph_hash, "instances": instances,
             "passes": cf.passes, "compile_seconds": round(cf.seconds, 3), "cache_key": cf.cache_key,
             "region_identity": cf.identity, "source": cf.source}  # fmt: skip
    if cf.pytree:
        entry["pytree"] = cf.pytree
    if cf.dynamic:
        entry["dynamic"] = cf.dynamic
    return entry


def _weights_reference(spec, opts) -> dict[str, Any]:
    if spec.weights == "random":
        return {"reference": f"random seed {opts.seed}", "seed": opts.seed}
    root = Path(spec.source)
    files = sorted(root.rglob("*.safetensors")) if root.is_dir() else []
    return {"reference": str(root),
            "files": [{"path": str(f.relative_to(root)), "sha256": sha256_file(f)} for f in files]}
