"""Prometheus metrics of the server, written in the text exposition format (no client library).

Counters and histograms are updated from the event loop and the worker thread, under one lock."""

from __future__ import annotations

import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
STATUSES = ("200", "400", "401", "413", "422", "429", "500", "503", "504")
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.bounds, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.total}"]
        return out


class Metrics:
    """What /metrics shows. `queue_depth` is read from the engine when rendering."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = defaultdict(int)  # by HTTP status of /v1/images/generations
        self.latency = Histogram(LATENCY_BUCKETS)
        self.step = Histogram(STEP_BUCKETS)
        self.steps: dict[str, int] = defaultdict(int)  # transformer calls by path: compiled or fallback
        self.images = 0
        self.batches = 0
        self.dropped: dict[str, int] = defaultdict(int)  # requests stopped early, by reason
        self.cached_calls: dict[str, int] = defaultdict(int)  # step cache: transformer calls computed or skipped

    def request_done(self, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[str(status)] += 1
            self.latency.observe(seconds)

    def step_done(self, seconds: float, path: str) -> None:
        with self.lock:
            self.step.observe(seconds)
            self.steps[path] += 1

    def batch_done(self, images: int) -> None:
        with self.lock:
            self.batches += 1
            self.images += images

    def step_cache_done(self, calls: int, computed: int) -> None:
        with self.lock:
            self.cached_calls["computed"] += computed
            self.cached_calls["skipped"] += calls - computed

    def drop(self, reason: str) -> None:
        with self.lock:
            self.dropped[reason] += 1

    def render(self, *, queue_depth: int, ready: bool, worker_alive: bool) -> str:
        p = "omni_serve"
        with self.lock:
            lines = [f"# HELP {p}_requests_total Image generation requests by HTTP status.",
                     f"# TYPE {p}_requests_total counter"]  # fmt: skip
            counts = {**dict.fromkeys(STATUSES, 0), **self.requests}  # the usual ones are shown from the start
            lines += [f'{p}_requests_total{{status="{s}"}} {n}' for s, n in sorted(counts.items())]
            lines += [f"# HELP {p}_request_seconds Image generation request latency (received to answered).",
                      f"# TYPE {p}_request_seconds histogram", *self.latency.lines(f"{p}_request_seconds")]  # fmt: skip
            lines += [f"# HELP {p}_queue_depth Requests waiting for the worker.", f"# TYPE {p}_queue_depth gauge",
                      f"{p}_queue_depth {queue_depth}"]  # fmt: skip
            lines += [f"# HELP {p}_step_seconds Time of one denoising step (transformer call and scheduler).",
                      f"# TYPE {p}_step_seconds histogram", *self.step.lines(f"{p}_step_seconds")]  # fmt: skip
            lines += [f"# HELP {p}_transformer_steps_total Denoising steps by path: compiled (the artifact's "
                      "files) or fallback (JIT compile).", f"# TYPE {p}_transformer_steps_total counter"]  # fmt: skip
            lines += [f'{p}_transformer_steps_total{{path="{k}"}} {self.steps.get(k, 0)}' for k in ("compiled", "fallback")]
            lines += [f"# TYPE {p}_images_total counter", f"{p}_images_total {self.images}",
                      f"# TYPE {p}_batches_total counter", f"{p}_batches_total {self.batches}"]  # fmt: skip
            lines += [f"# HELP {p}_dropped_total Requests stopped before their last step, by reason.",
                      f"# TYPE {p}_dropped_total counter"]  # fmt: skip
            lines += [f'{p}_dropped_total{{reason="{k}"}} {self.dropped.get(k, 0)}' for k in ("disconnected", "deadline")]
            lines += [f"# HELP {p}_step_cache_calls_total Transformer calls of step-cached requests: computed (every "
                      "block ran) or skipped (the blocks after the first reused).",
                      f"# TYPE {p}_step_cache_calls_total counter"]  # fmt: skip
            lines += [f'{p}_step_cache_calls_total{{result="{k}"}} {self.cached_calls.get(k, 0)}'
                      for k in ("computed", "skipped")]  # fmt: skip
            lines += [f"# TYPE {p}_ready gauge", f"{p}_ready {int(ready)}",
                      f"# TYPE {p}_worker_alive gauge", f"{p}_worker_alive {int(worker_alive)}"]  # fmt: skip
        return "\n".join(lines) + "\n"
