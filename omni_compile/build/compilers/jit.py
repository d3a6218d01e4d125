"""`InductorJit`: the regions `torch.compile`d in place (`omni_compile.compile`), compiled by the first forward
of each bucket, published as the build report and Inductor's compiled-cache bundle (`inductor_cache.bin`,
from `torch.compiler.save_cache_artifacts`), so a second process started with `--cache-from` warm-starts."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from omni_compile.artifact.aot import Target
from omni_compile.build.compilers.base import register
from omni_compile.errors import ConfigError, OmniCompileError

logger = logging.getLogger("omni_compile.build")

REPORT = "build_report.json"
CACHE_BUNDLE = "inductor_cache.bin"


class _Tracer:
    """The compiled model's forwards compile its regions; a compile is a record in its `CompileState`."""

    def __init__(self, state):
        self.state = state
        self.bucket: str | None = None

    def compiles(self) -> int:
        return len(self.state.records)


@register
class InductorJit:
    """Inductor JIT: each region a `torch.compile`d function (Dynamo, then Inductor with the pass manager as
    post-grad pass), one compile per region and call signature on the first forward of each bucket."""

    name = "inductor-jit"
    mode = "jit"
    format = None
    report_path = REPORT
    eager_trace = False
    compiles_glue = False
    trace_stage = "tracing and compiling each region"

    def __init__(self):
        self.warm: dict[str, Any] | None = None  # the --cache-from bundle loaded
        self.bundle: dict[str, Any] | None = None  # the bundle written
        self._summary: dict[str, Any] | None = None  # --store: Inductor's remote caches
        self._before: dict[str, int] = {}
        self._state = None

    @classmethod
    def default_for(cls, device: str) -> bool:
        return True

    def check(self, opts) -> None:
        if opts.dynamic:
            raise ConfigError("--dynamic compiles regions with symbolic sizes into an artifact; use it with --mode aot "
                              "(the default)")  # fmt: skip
        if opts.store and not opts.store.startswith(("redis://", "rediss://")):
            raise ConfigError(
                "--mode jit --store needs a redis:// store: it points Inductor's own remote caches (FX graph, "
                "autotune), which speak Redis only, at it. A file:// store shares artifact builds (--mode aot)"
            )

    @contextlib.contextmanager
    def open(self, build):
        opts = build.opts
        if opts.cache_from:
            self.warm = load_cache_bundle(Path(opts.cache_from))
            build.events.on_stage(f"loaded Inductor cache bundle from {opts.cache_from} ({self.warm['bytes']} bytes)")
        if not opts.store:
            yield
            return
        self._before = _remote_counts()
        with _inductor_remote_caches(opts.store, build.events) as self._summary:
            yield

    def targets(self, build) -> list[Target]:
        return [Target(r.name, "block", list(r.instances)) for r in build.regions]

    @contextlib.contextmanager
    def tracing(self, build):
        from omni_compile.compiler import compile, compile_state

        spec = build.session.spec
        compile(build.model, build.opts.compile, regions=spec.block_names(build.model),
                on_region_compiled=build.events.on_region_compiled, adapter=spec.adapter)  # fmt: skip
        self._state = compile_state(build.model)
        yield _Tracer(self._state)

    def compile(self, build, tmp) -> list[dict[str, Any]]:
        return [r.to_json() for r in self._state.records]  # the traced forwards compiled every region

    def inherited_parity(self, build) -> None:
        return None

    def compiled_outputs(self, build, tmp) -> dict[str, torch.Tensor]:
        return dict(build.traced)  # the outputs of the forwards that compiled the regions

    def write(self, build, tmp) -> None:
        if tmp is None:
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, info = saved
        (tmp / CACHE_BUNDLE).write_bytes(data)
        self.bundle = {"file": CACHE_BUNDLE, "bytes": len(data), "artifacts": _cache_info(info),
                       "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip

    def section(self, build) -> dict[str, Any]:
        store = None
        if self._summary is not None:  # with the FX-graph cache's hits and misses of this build
            now = _remote_counts()
            store = {**self._summary, **{k: now[k] - self._before[k] for k in now}}
        return {"name": self.name, "mode": self.mode, "cache_bundle": self.bundle, "warm_start": self.warm,
                "store": store}  # fmt: skip

    def result(self, build, report: dict[str, Any]) -> dict[str, Any]:
        return report


def load_cache_bundle(path: Path) -> dict[str, Any]:
    """Load the Inductor cache bundle of an `omni-compile build --mode jit --out` directory (or the file)
    into this process, and seed the pass logs from its report; returns the report's warm_start entry."""
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
    kinds = ("inductor_artifacts", "aot_autograd_artifacts", "autotune_artifacts", "pgo_artifacts",
             "precompile_artifacts")  # fmt: skip
    return {k: len(getattr(info, k)) for k in kinds if isinstance(getattr(info, k, None), list)}


@contextlib.contextmanager
def _inductor_remote_caches(url: str, events):
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
