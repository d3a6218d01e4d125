"""Prometheus metrics of the server, through `prometheus_client` (one registry per app, so that several apps in
one process, as in the tests, keep their own counts). The client's metric objects are thread-safe: they are
updated from the event loop and the worker thread."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
STATUSES = ("200", "400", "401", "413", "422", "429", "500", "503", "504")
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST
_P = "omni_serve"


class Metrics:
    """What /metrics shows. `queue_depth`, `ready` and `worker_alive` are read from the engine when rendering."""

    def __init__(self):
        import prometheus_client

        # no `*_created` series beside every counter and histogram: they only repeat the process start here
        prometheus_client.disable_created_metrics()
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{_P}_requests", "Generation requests (POST /v1/images/generations, POST "
                                "/v1/videos) by HTTP status.", ["status"], registry=r)  # fmt: skip
        for status in STATUSES:  # the usual ones are shown from the start, at 0
            self.requests.labels(status)
        self.latency = Histogram(f"{_P}_request_seconds", "Generation request latency (received to answered; for a "
                                 "video, to the job's creation).", buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue_depth = Gauge(f"{_P}_queue_depth", "Requests waiting for the worker.", registry=r)
        self.step = Histogram(f"{_P}_step_seconds", "Time of one denoising step (transformer call and scheduler).",
                              buckets=STEP_BUCKETS, registry=r)  # fmt: skip
        self.steps = Counter(f"{_P}_transformer_steps", "Denoising steps by path: compiled (the artifact's files) or "
                             "fallback (JIT compile).", ["path"], registry=r)  # fmt: skip
        self.images = Counter(f"{_P}_images", "Images generated.", registry=r)
        self.videos = Counter(f"{_P}_videos", "Videos generated.", registry=r)
        self.video_jobs = Counter(f"{_P}_video_jobs", "Video jobs by how they ended: completed, failed, cancelled "
                                  "(deleted before it finished), expired (--video-ttl) or evicted (the oldest finished "
                                  "ones, to make room).", ["status"], registry=r)  # fmt: skip
        self.batches = Counter(f"{_P}_batches", "Batches the worker ran.", registry=r)
        self.dropped = Counter(f"{_P}_dropped", "Requests stopped before their last step, by reason.", ["reason"],
                               registry=r)  # fmt: skip
        self.cached_calls = Counter(f"{_P}_step_cache_calls", "Transformer calls of step-cached requests: computed "
                                    "(every block ran) or skipped (the blocks after the first reused).", ["result"],
                                    registry=r)  # fmt: skip
        self.ready = Gauge(f"{_P}_ready", "1 once the pipeline is loaded and warm.", registry=r)
        self.worker_alive = Gauge(f"{_P}_worker_alive", "1 while the worker thread runs.", registry=r)
        for counter, labels in ((self.steps, ("compiled", "fallback")),
                                (self.dropped, ("disconnected", "deadline", "cancelled")),
                                (self.cached_calls, ("computed", "skipped")),
                                (self.video_jobs, ("completed", "failed", "cancelled", "expired", "evicted"))):  # fmt: skip
            for label in labels:
                counter.labels(label)

    def request_done(self, status: int, seconds: float) -> None:
        self.requests.labels(str(status)).inc()
        self.latency.observe(seconds)

    def step_done(self, seconds: float, path: str) -> None:
        self.step.observe(seconds)
        self.steps.labels(path).inc()

    def batch_done(self, outputs: int, kind: str = "images") -> None:
        self.batches.inc()
        (self.images if kind == "images" else self.videos).inc(outputs)

    def video_job_done(self, status: str) -> None:
        self.video_jobs.labels(status).inc()

    def step_cache_done(self, calls: int, computed: int) -> None:
        self.cached_calls.labels("computed").inc(computed)
        self.cached_calls.labels("skipped").inc(calls - computed)

    def drop(self, reason: str) -> None:
        self.dropped.labels(reason).inc()

    def count(self, name: str, label: str | None = None) -> int:
        """A counter's value: `count("images")`, `count("dropped", "disconnected")` (its one label's value)."""
        counter = {"requests": self.requests, "transformer_steps": self.steps, "images": self.images,
                   "batches": self.batches, "dropped": self.dropped, "step_cache_calls": self.cached_calls,
                   "videos": self.videos, "video_jobs": self.video_jobs}[name]  # fmt: skip
        labels = {counter._labelnames[0]: label} if label is not None else None
        value = self.registry.get_sample_value(f"{_P}_{name}_total", labels)
        return int(value or 0)

    def render(self, *, queue_depth: int, ready: bool, worker_alive: bool) -> str:
        """The text exposition format (`CONTENT_TYPE`)."""
        self.queue_depth.set(queue_depth)
        self.ready.set(int(ready))
        self.worker_alive.set(int(worker_alive))
        return generate_latest(self.registry).decode()
