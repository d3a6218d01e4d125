"""The engine: one worker thread owns the device and runs jobs from a bounded queue.

- `submit` answers at once: 429 when the queue is full, 503 while warming up, draining or after the
  worker died. Nothing is queued for a refused request.
- The worker takes the oldest job and, up to `max_batch` images, the queued jobs of the same size, steps,
  guidance and step cache setting; their images run in chunks of the artifact's batch sizes for that size (`split_batch`).
  Image i of a request is drawn from its own generator seeded `seed + i`, so its bytes do not depend on
  which other requests it ran with when the batch size is the same.
- A job whose client went away, whose deadline passed or that was cancelled is dropped before it starts, and
  its chunk stops at the next step boundary when every job in it is gone.
- A job is images (PNG) or, with `frames`, a video (MP4): the runner's task says which; `steps_done` counts
  its finished denoising steps (a video job's progress).
- An error in a chunk (including out-of-memory) fails the jobs in it with 500 and the worker goes on;
  if the worker itself dies, every waiting job fails with 503 and `alive` turns False (/health 503).
"""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from omni_compile.errors import ConfigError
from omni_compile.server.schemas import RequestError

logger = logging.getLogger("omni_compile.server")


@dataclass(eq=False)  # jobs compare by identity
class Job:
    prompt: str
    n: int
    seed: int
    height: int
    width: int
    steps: int
    guidance: float
    deadline: float  # time.monotonic() by which the job must be done
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    gone: str | None = None  # "disconnected", "deadline" or "cancelled" once nobody waits for it
    images: dict[int, bytes] = field(default_factory=dict)
    step_cache: str | None = None  # the setting (`schemas.step_cache_setting`); None: the server has none
    computed: list[tuple[int, int]] = field(default_factory=list)  # (calls, computed calls) per chunk it ran in
    lora: tuple[str, float] | None = None  # (name, scale) merged for this job (`schemas.lora_setting`)
    frames: int | None = None  # a video's frames (None: images)
    started: bool = False  # the worker has taken it
    steps_done: int = 0  # denoising steps finished (of its latest chunk)

    @property
    def key(self) -> tuple:
        return (self.height, self.width, self.steps, float(self.guidance), self.step_cache, self.lora, self.frames)

    def stopped(self) -> bool:
        if self.gone is None and time.monotonic() > self.deadline:
            self.gone = "deadline"
        return self.gone is not None or self.future.done()


class _Stop(Exception):
    """Raised at a step boundary when nobody waits for the chunk any more."""


def split_batch(n: int, sizes: list[int]) -> list[int] | None:
    """`n` images as a sum of the compiled batch sizes, fewest calls first; None when impossible."""
    best: list[list[int] | None] = [[]] + [None] * n
    for total in range(1, n + 1):
        for s in sorted(sizes, reverse=True):
            prev = best[total - s] if s <= total else None
            if prev is not None and (best[total] is None or len(prev) + 1 < len(best[total])):
                best[total] = [*prev, s]
    return None if best[n] is None else sorted(best[n], reverse=True)


def usable_batch_sizes(runner, height: int, width: int, max_batch: int, frames: int | None = None) -> list[int]:
    """The compiled batch sizes at this size (and frames, for a video) up to `max_batch`; the smallest one when
    none is that small."""
    sizes = runner.batch_sizes(height, width) if frames is None else runner.batch_sizes(height, width, frames)
    return [b for b in sizes if b <= max_batch] or sizes[:1]


class Engine:
    def __init__(self, runner, metrics, *, max_queue: int, max_batch: int,
                 warmup: Callable[[], None] | None = None):  # fmt: skip
        self.runner = runner  # LoadedPipeline, or anything with .run, .batch_sizes and .compiled
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.warmup = warmup
        self.queue: collections.deque[Job] = collections.deque()
        self.cv = threading.Condition()
        self.state = "starting"  # starting -> ready -> draining -> stopped; or dead
        self.error: str | None = None
        self.warmup_seconds: float | None = None
        self.current: list[Job] = []  # jobs taken by the worker and not finished
        self.thread = threading.Thread(target=self._main, name="omni-serve-worker", daemon=True)

    # --- called from the event loop -------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.thread.is_alive()

    @property
    def alive(self) -> bool:
        return self.state != "dead" and (self.thread.is_alive() or self.state == "starting")

    def depth(self) -> int:
        return len(self.queue)

    def submit(self, job: Job) -> concurrent.futures.Future:
        with self.cv:
            if self.state == "starting":
                raise RequestError(503, "the server is warming up; retry in a few seconds", type="overloaded_error",
                                   headers={"Retry-After": "2"})  # fmt: skip
            if not self.ready:
                why = "shutting down" if self.state in ("draining", "stopped") else f"its worker failed ({self.error})"
                raise RequestError(503, f"the server is {why}; it takes no new requests", type="server_error")
            if len(self.queue) >= self.max_queue:
                raise RequestError(429, f"the queue is full ({self.max_queue} requests waiting); retry later",
                                   type="overloaded_error", headers={"Retry-After": "1"})  # fmt: skip
            self.queue.append(job)
            self.cv.notify()
        return job.future

    def forget(self, job: Job) -> None:
        """The caller stopped waiting (`job.gone` set): take the job out of the queue if it is still there; a running
        one stops at its chunk's next step boundary once every job of the chunk is gone."""
        with self.cv:
            if job in self.queue:
                self.queue.remove(job)
                self.metrics.drop(job.gone or "deadline")
        _fail(job, RequestError(504, "nobody waits for this request any more", type="timeout_error"))

    def stop(self, timeout: float | None = None) -> None:
        """Take no new jobs, finish the queued and running ones, then end the worker."""
        with self.cv:
            if self.state in ("ready", "starting"):
                self.state = "draining"
            self.cv.notify_all()
        self.thread.join(timeout)

    # --- the worker thread ------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.warmup is not None:
                t0 = time.perf_counter()
                self.warmup()
                self.warmup_seconds = round(time.perf_counter() - t0, 3)
                logger.info("warm-up done in %.2f s", self.warmup_seconds)
            with self.cv:
                if self.state == "starting":
                    self.state = "ready"
            while True:
                jobs = self._take()
                if jobs is None:
                    break
                self._run(jobs)
            self.state = "stopped"
        except BaseException as e:  # noqa: BLE001 - the worker must never vanish silently
            logger.exception("the worker died")
            with self.cv:
                self.state, self.error = "dead", f"{type(e).__name__}: {e}"
                waiting = [*self.current, *self.queue]
                self.queue.clear()
            for job in waiting:
                _fail(job, RequestError(503, f"the worker failed ({self.error}); the server cannot run requests",
                                        type="server_error"))  # fmt: skip

    def _take(self) -> list[Job] | None:
        with self.cv:
            while not self.queue and self.state == "ready":
                self.cv.wait()
            if not self.queue:
                return None
            first = self.queue.popleft()
            jobs, images = [first], first.n
            for job in list(self.queue):
                if job.key == first.key and images + job.n <= self.max_batch:
                    self.queue.remove(job)
                    jobs.append(job)
                    images += job.n
            self.current = jobs
            return jobs

    def _run(self, jobs: list[Job]) -> None:
        live = []
        for job in jobs:
            if job.stopped():
                self._drop(job)
            else:
                job.started = True
                live.append(job)
        images = [(job, i) for job in live for i in range(job.n)]
        height, width, steps, guidance, step_cache, lora, frames = jobs[0].key
        chunks = split_batch(len(images), usable_batch_sizes(self.runner, height, width, self.max_batch, frames))
        assert chunks is not None, "each job's n was checked to be a sum of the usable batch sizes"
        start = 0
        for size in chunks:
            chunk = images[start:start + size]  # the compiled batch: a stopped job's images still fill it
            start += size
            if all(job.stopped() for job, _ in chunk):
                continue
            self._run_chunk(chunk, height, width, steps, guidance, step_cache, lora, frames)
        for job in live:
            if job.stopped() and not job.future.done():
                self._drop(job)
        with self.cv:
            self.current = []

    def _run_chunk(self, chunk: list[tuple[Job, int]], height, width, steps, guidance, step_cache=None,
                   lora=None, frames=None) -> None:  # fmt: skip
        owners = {id(j): j for j, _ in chunk}.values()
        last = [time.perf_counter()]
        path = "compiled" if self.runner.compiled else "fallback"

        def on_step(i: int) -> None:
            now = time.perf_counter()
            self.metrics.step_done(now - last[0], path)
            last[0] = now
            for j in owners:
                j.steps_done = i + 1
            if all(j.stopped() for j in owners) and i + 1 < steps:
                raise _Stop()

        cached = {} if step_cache is None else {"step_cache": step_cache}
        if lora is not None:
            cached["lora"] = lora
        if frames is not None:
            cached["frames"] = frames
        try:
            pngs = self.runner.run([j.prompt for j, _ in chunk], [j.seed + i for j, i in chunk], height, width,
                                   steps, guidance, on_step, **cached)  # fmt: skip
        except _Stop:
            for job in owners:
                self._drop(job)
            return
        except ConfigError as e:  # the LoRA it asked for was unloaded while it waited
            for job in owners:
                _fail(job, RequestError(400, str(e), param="lora"))
            return
        except Exception as e:  # one request's failure (OOM included) must not end the worker
            logger.exception("a batch of %d %s failed", len(chunk), "image(s)" if frames is None else "video(s)")
            _free_device_memory(e)
            for job in owners:
                _fail(job, RequestError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
            return
        self.metrics.batch_done(len(chunk), "images" if frames is None else "videos")
        if step_cache is not None:
            calls = getattr(self.runner, "last_calls", None)  # (calls, computed) of this run
            if calls is not None:
                self.metrics.step_cache_done(*calls)
                for job in owners:
                    job.computed.append(calls)
        for (job, i), png in zip(chunk, pngs):
            job.images[i] = png
            if len(job.images) == job.n and not job.future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    job.future.set_result([(job.seed + k, job.images[k]) for k in range(job.n)])

    def _drop(self, job: Job) -> None:
        job.stopped()
        self.metrics.drop(job.gone or "deadline")
        _fail(job, RequestError(504, "the request passed its deadline before it finished", type="timeout_error"))


def _fail(job: Job, err: RequestError) -> None:
    if not job.future.done():
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            job.future.set_exception(err)


def _free_device_memory(e: Exception) -> None:
    import torch

    if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()
