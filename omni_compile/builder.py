"""The `omni-compile build` driver.

Resolves the model, compiles its regions for every shape bucket (one forward per bucket triggers the
JIT compile of each region), and publishes an output directory holding `build_report.json` and
Inductor's compiled-cache bundle (`inductor_cache.bin`, from `torch.compiler.save_cache_artifacts`),
so a second process started with `--cache-from` warm-starts. The directory is written under a
temporary name and renamed into place: a failed build never leaves a partial output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import omni_compile
from omni_compile.build.session import BuildEvents, BuildOptions, BuildSession, check_out, sync
from omni_compile.compiler import RegionCompile, compile, compile_state
from omni_compile.config import dtype_name
from omni_compile.errors import ConfigError, OmniCompileError
from omni_compile.graphs.regions import count_parameters
from omni_compile.passes.lower_fused_ops import record_resolution

__all__ = ["BuildEvents", "BuildOptions", "build", "build_report"]

logger = logging.getLogger("omni_compile.builder")

REPORT = "build_report.json"
CACHE_BUNDLE = "inductor_cache.bin"


def build(opts: BuildOptions, events: BuildEvents | None = None) -> dict[str, Any]:
    events = events or BuildEvents()
    if opts.mode not in ("aot", "jit"):
        raise ConfigError(f"unknown build mode {opts.mode!r}; use aot (a prebuilt artifact) or jit")
    if opts.store and opts.mode != "aot" and not opts.store.startswith(("redis://", "rediss://")):
        raise ConfigError(
            "--mode jit --store needs a redis:// store: it points Inductor's own remote caches (FX graph, "
            "autotune), which speak Redis only, at it. A file:// store shares artifact builds (--mode aot)"
        )
    if opts.format and opts.mode != "aot":
        raise ConfigError("--format chooses an artifact build's compiled-file format; use it with --mode aot")
    if opts.mode == "aot":
        from omni_compile.artifact.build import build_artifact

        return build_artifact(opts, events)
    t_start = time.perf_counter()
    session = BuildSession.resolve(opts)
    out = Path(opts.out) if opts.out else None
    if out is not None:
        check_out(out, opts.force)

    warm = None
    if opts.cache_from:
        warm = _load_cache_bundle(Path(opts.cache_from))
        events.on_stage(f"loaded Inductor cache bundle from {opts.cache_from} ({warm['bytes']} bytes)")

    events.on_stage(f"loading {session.spec.source} ({dtype_name(session.dtype)}, {session.device})")
    t0 = time.perf_counter()
    model = session.load_model()
    load_seconds = time.perf_counter() - t0

    before = _remote_counts()
    remote = _inductor_remote_caches(opts.store, events) if opts.store else contextlib.nullcontext()
    with remote as store_report:
        report = _build_jit(session, events, model, load_seconds, warm, t_start)
    if store_report is not None:
        now = _remote_counts()
        report["store"] = {**store_report, **{k: now[k] - before[k] for k in now}}
    if out is not None:
        _publish(out, report, opts.force)
    return report


@contextlib.contextmanager
def _inductor_remote_caches(url: str, events: BuildEvents):
    """Point Inductor's remote FX-graph and autotune caches (and AOTAutograd's) at the Redis of `url`
    for the build: the environment variables torch's Redis backend reads, and the config switches.
    An unreachable Redis warns and the build goes on with the local caches only. Yields the store
    summary for the report (the build adds its cache counts)."""
    from urllib.parse import urlsplit, urlunsplit

    from omni_compile.cache.store import open_store, redacted_url

    shown = redacted_url(url)
    try:
        open_store(url).client.ping()
    except Exception as e:  # any failure to reach it: warn, compile with the local caches
        msg = f"store {shown} unreachable ({type(e).__name__}: {e}); compiling with the local Inductor caches only"
        logger.warning(msg)
        events.on_warning(msg)
        yield {"url": shown, "kind": "inductor-remote-caches", "reachable": False}
        return
    parts = urlsplit(url)
    env = {
        "TORCHINDUCTOR_REDIS_URL": urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")),
        "TORCHINDUCTOR_REDIS_HOST": parts.hostname or "localhost",
        "TORCHINDUCTOR_REDIS_PORT": str(parts.port or 6379),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with torch._inductor.config.patch(fx_graph_remote_cache=True, autotune_remote_cache=True), \
                torch._functorch.config.patch(enable_remote_autograd_cache=True):  # fmt: skip
            yield {"url": shown, "kind": "inductor-remote-caches", "reachable": True}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _remote_counts() -> dict[str, int]:
    """Inductor's FX-graph cache hits and misses so far (a hit with an empty local cache came from Redis)."""
    from torch._dynamo.utils import counters as dynamo_counters

    return {k: int(dynamo_counters["inductor"].get(k, 0)) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


def _build_jit(session: BuildSession, events: BuildEvents, model, load_seconds, warm, t_start) -> dict[str, Any]:
    spec, device = session.spec, session.device
    compile(
        model,
        session.opts.compile,
        regions=spec.block_names(model),
        on_region_compiled=events.on_region_compiled,
        adapter=spec.adapter,
    )
    state = compile_state(model)
    events.on_stage(
        f"{len(state.regions)} region(s): "
        + ", ".join(f"{r.name} x{len(r.instances)}" for r in state.regions)
        + f"; passes: {', '.join(state.pass_manager.enabled) or 'none'}"
    )

    bucket_reports = []
    for i, bucket in enumerate(session.buckets, 1):
        events.on_stage(f"bucket {bucket} ({i}/{len(session.buckets)}): tracing and compiling each region")
        inputs = session.example_inputs(model, bucket)
        before = len(state.records)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            output = model(**inputs)
        sync(device)
        first_call = time.perf_counter() - t0
        sample = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        finite = bool(torch.isfinite(sample).all())
        if not finite:
            logger.warning("bucket %s: the compiled forward produced non-finite values", bucket)
        compiles = len(state.records) - before
        events.on_bucket_done(bucket, first_call, compiles)
        bucket_reports.append(
            {
                "bucket": str(bucket),
                "first_call_seconds": round(first_call, 3),
                "region_compiles": compiles,
                "output_shape": list(sample.shape),
                "output_finite": finite,
            }
        )

    return build_report(session, model, state, bucket_reports, load_seconds, warm, time.perf_counter() - t_start)


def _load_cache_bundle(path: Path) -> dict[str, Any]:
    bundle = path / CACHE_BUNDLE if path.is_dir() else path
    if not bundle.exists():
        raise ConfigError(
            f"--cache-from {path}: no {CACHE_BUNDLE} there; point it at an `omni-compile build --out` directory"
        )
    data = bundle.read_bytes()
    t0 = time.perf_counter()
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # a foreign or corrupt bundle is a user-facing problem
        raise OmniCompileError(f"--cache-from {bundle}: cannot load the Inductor cache bundle ({e})") from None
    seeded = _seed_pass_logs(path / REPORT) if path.is_dir() else 0
    return {
        "path": str(bundle),
        "bytes": len(data),
        "pass_logs": seeded,
        "load_seconds": round(time.perf_counter() - t0, 3),
        "artifacts": _cache_info(info),
    }


def _seed_pass_logs(report_path: Path) -> int:
    """Seed `pass_log_cache` from a previous build's report (its regions' compiles and pass uuid), so a
    warm start, whose Inductor cache hits skip the passes, reports what they matched. Returns the
    number of entries; a missing or unreadable report seeds none (the build report then shows those
    compiles' passes as unknown)."""
    from omni_compile.compiler import pass_log_cache

    try:
        report = json.loads(report_path.read_text())
        uuid = report["passes"]["uuid"]
        compiles = [c for r in report["regions"] for c in r["compiles"]]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    n = 0
    for c in compiles:
        if isinstance(c, dict) and isinstance(c.get("passes"), dict) and c.get("graph_hash"):
            entry = {k: c.get(k) or {} for k in ("passes", "fused_op_implementations", "attention")}
            pass_log_cache.put(c["graph_hash"], uuid, entry, persist=False)
            n += 1
    return n


def _cache_info(info) -> dict[str, int]:
    if info is None:
        return {}
    kinds = (
        "inductor_artifacts",
        "aot_autograd_artifacts",
        "autotune_artifacts",
        "pgo_artifacts",
        "precompile_artifacts",
    )
    return {k: len(getattr(info, k)) for k in kinds if isinstance(getattr(info, k, None), list)}


def _sum_matches(records: list[RegionCompile]) -> dict[str, int]:
    total: Counter = Counter()
    for rec in records:
        total.update(rec.passes)
    return dict(total)


def build_report(session: BuildSession, model, state, bucket_reports, load_seconds, warm, total) -> dict[str, Any]:
    """The JIT build report (schema build-report/1) of a compiled `model` (`compile_state` is `state`)."""
    spec, opts = session.spec, session.opts
    records = state.records
    regions = []
    for region in state.regions:
        recs = [r for r in records if r.region == region.name]
        regions.append(
            {
                **region.to_json(),
                "parameters_per_instance": count_parameters(region.instances[0][1]),
                "matches": _sum_matches(recs),
                "compiles": [r.to_json() for r in recs],
            }
        )
    resolutions: dict[str, dict] = {}
    attention: dict[str, dict] = {}
    for rec in records:
        for op, res in rec.resolutions.items():
            record_resolution(resolutions, op, res["implementation"], res["reason"], res["count"])
        for role, res in rec.attention.items():
            record_resolution(attention, role, res["implementation"], res["reason"], res["count"], res.get("measured"))
    config_json = json.dumps(spec.config, sort_keys=True, default=str)
    return {
        "schema": "omni-compile/build-report/1",
        "omni_compile_version": omni_compile.__version__,
        "model": {
            "source": spec.source,
            "family": spec.adapter.family,
            "class": spec.adapter.model_class().__name__,
            "config": json.loads(config_json),
            "config_hash": hashlib.sha256(config_json.encode()).hexdigest(),
            "weights": spec.weights if spec.weights != "random" else f"random seed {opts.seed}",
            "parameters": count_parameters(model),
        },
        "dtype": dtype_name(session.dtype),
        "device": session.device,
        "platform": state.platform.to_json(),
        "compile_config": state.config.to_json(),
        "compile_config_hash": state.config.compute_hash(),
        "passes": {"enabled": state.pass_manager.enabled, "uuid": state.pass_uuid, "matches": _sum_matches(records)},
        "fused_op_implementations": resolutions,
        "attention": {"config": state.pass_manager.attention_config.to_json(), "per_role": attention},
        "regions": regions,
        "buckets": bucket_reports,
        "totals": {
            "regions": len(state.regions),
            "region_compiles": len(records),
            "cache_hits": sum(r.cache_hit for r in records),
            "compile_seconds": round(sum(r.seconds for r in records), 3),
            "model_load_seconds": round(load_seconds, 3),
            "wall_seconds": round(total, 3),
        },
        "warm_start": warm,
        "host": socket.gethostname(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _publish(out: Path, report: dict[str, Any], force: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            data, info = saved
            (tmp / CACHE_BUNDLE).write_bytes(data)
            report["cache_bundle"] = {
                "file": CACHE_BUNDLE,
                "bytes": len(data),
                "artifacts": _cache_info(info),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        else:
            report["cache_bundle"] = None
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        old = None
        if out.exists():
            check_out(out, force)
            old = out.with_name(f".{out.name}.old-{time.time_ns()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
