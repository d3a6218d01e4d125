"""The build report, schema `omni-compile/build-report/2` (`report.schema.json` beside this file): one
function, `build_report`, for every region compiler. The shared sections say what was built and how it
went; `compiler` holds what only the region compiler knows (the JIT cache bundle and warm start; the
ahead-of-time format, files and manifest). `summarize` adds up pass matches and implementation choices."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import omni_compile
from omni_compile.artifact.aot import json_safe
from omni_compile.artifact.manifest import model_config
from omni_compile.artifact.parity import PARITY_BOUND
from omni_compile.config import dtype_name
from omni_compile.graphs.regions import count_parameters
from omni_compile.passes.lower_fused_ops import record_resolution

SCHEMA = "omni-compile/build-report/2"
SCHEMA_FILE = Path(__file__).with_name("report.schema.json")


def summarize(compiles: list[dict[str, Any]]) -> dict[str, dict]:
    """Pass matches summed over `compiles` (a compile whose passes are unknown, None, adds none), and the
    fused-op implementations and attention backends they resolved, as report tables (`record_resolution`)."""
    matches: Counter = Counter()
    resolutions: dict[str, dict] = {}
    attention: dict[str, dict] = {}
    for c in compiles:
        matches.update(c.get("passes") or {})
        for op, r in (c.get("fused_op_implementations") or {}).items():
            record_resolution(resolutions, op, r["implementation"], r["reason"], r["count"])
        for role, r in (c.get("attention") or {}).items():
            record_resolution(attention, role, r["implementation"], r["reason"], r["count"], r.get("measured"))
    return {"matches": dict(matches), "fused_op_implementations": resolutions, "attention": attention}


def model_summary(spec, model) -> dict[str, Any]:
    """Source, family, class and the instantiated model's whole config (defaults included: what a load
    compares field by field) with its hash."""
    config = model_config(model)
    config_json = json.dumps(spec.config if config is None else config, sort_keys=True, default=str)
    return {"source": spec.source, "family": spec.adapter.family, "class": spec.adapter.model_class().__name__,
            "config": json.loads(config_json),
            "config_hash": hashlib.sha256(config_json.encode()).hexdigest()}  # fmt: skip


def build_report(build) -> dict[str, Any]:
    """The report of a finished `build.pipeline.BuildPipeline` (its stages up to the parity check done)."""
    session, model, compiles = build.session, build.model, build.compiles
    spec, opts, pm = session.spec, session.opts, session.pass_manager
    total = summarize(compiles)
    structure = {r.name: r.structure_hash for r in build.regions}
    regions = []
    for t in build.targets:
        mine = [c for c in compiles if c["region"] == t.name]
        cls = type(t.instances[0][1])
        regions.append({"name": t.name, "kind": t.kind, "class": f"{cls.__module__}.{cls.__qualname__}",
                        "structure_hash": structure.get(t.name), "instances": [p for p, _ in t.instances],
                        "parameters_per_instance": count_parameters(t.instances[0][1]),
                        "matches": summarize(mine)["matches"], "compiles": mine})  # fmt: skip
    weights = spec.weights if spec.weights != "random" else f"random seed {opts.seed}"
    return {
        "schema": SCHEMA,
        "omni_compile_version": omni_compile.__version__,
        "model": {**model_summary(spec, model), "weights": weights, "parameters": count_parameters(model)},
        "dtype": dtype_name(session.dtype),
        "device": session.device,
        "platform": pm.platform.to_json(),
        "compile_config": json_safe(opts.compile.to_json()),
        "compile_config_hash": opts.compile.compute_hash(),
        "weight_transforms": build.transformed,
        "passes": {"enabled": pm.enabled, "uuid": pm.uuid(), "matches": total["matches"]},
        "fused_op_implementations": total["fused_op_implementations"],
        "attention": {"config": pm.attention_config.to_json(), "per_role": total["attention"]},
        "regions": regions,
        "buckets": build.bucket_reports,
        "parity": {"bound": PARITY_BOUND[session.dtype], "buckets": build.parity},
        "timing": build.timing,
        "compilations": build.compilations,
        "compiler": build.compiler.section(build),
        "host": socket.gethostname(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
