"""Video jobs (OpenAI's videos API): POST /v1/videos, GET /v1/videos[/{id}[/content]], DELETE /v1/videos/{id}.

A job is created by a request and outlives it: the engine runs it like any other job (one video, `frames`
set) and, when it ends, `VideoJobs.finish` writes its MP4 under the server's job directory or records why it
failed. Nobody has to wait on it; clients poll GET /v1/videos/{id} (status and progress, the denoising steps
done) and fetch /content once it is completed. The store is bounded:

- in number (`--max-video-jobs`): a new job takes the place of the oldest finished one; when every job held is
  queued or running, it is refused with 429 and Retry-After;
- in age (`--video-ttl`): a finished job and its file are removed that long after it finished (checked at every
  call of these routes and when a job ends);
- in disk (`--video-max-bytes`): the MP4s together stay under the bound, the oldest finished jobs removed first;
  a video larger than the whole bound fails.

DELETE cancels a queued or running job (the engine drops it, or stops its batch at the next step boundary)
and removes a finished one with its file. At shutdown the unfinished jobs are cancelled and the directory
removed: jobs do not survive the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from omni_compile.server.engine import Job, split_batch, usable_batch_sizes
from omni_compile.server.schemas import (RequestError, Video, VideoDeleted, VideoError, VideoList, VideoRequest,
                                         check_common, check_model, check_size, lora_setting, step_cache_report,
                                         step_cache_setting)  # fmt: skip

logger = logging.getLogger("omni_compile.server")
VIDEOS = "/v1/videos"
RETRY_AFTER_FULL = "5"  # seconds: a hint; a slot frees when a job finishes or its client deletes it
_FAILURE_CODES = {400: "invalid_request", 500: "generation_failed", 503: "server_unavailable", 504: "deadline_exceeded"}


@dataclass(eq=False)
class VideoJob:
    id: str
    job: Job  # what the engine runs
    model: str
    seconds: str
    fps: int
    created_at: int
    finished_at: float | None = None  # time.time() when it completed or failed
    failure: VideoError | None = None
    path: Path | None = None  # the MP4, once completed
    nbytes: int = 0

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def status(self) -> str:
        if self.finished:
            return "failed" if self.failure is not None else "completed"
        return "in_progress" if self.job.started else "queued"

    def progress(self) -> int:
        """Steps done over steps in percent; 100 only once the MP4 is written."""
        if self.finished and self.failure is None:
            return 100
        return min(99, 100 * self.job.steps_done // self.job.steps)

    def describe(self, ttl_s: float) -> Video:
        job = self.job
        return Video(id=self.id, model=self.model, status=self.status(), progress=self.progress(),
                     created_at=self.created_at,
                     completed_at=int(self.finished_at) if self.finished else None,
                     expires_at=int(self.finished_at + ttl_s) if self.finished else None,
                     size=f"{job.width}x{job.height}", seconds=self.seconds, prompt=job.prompt, error=self.failure,
                     seed=job.seed, num_frames=job.frames, fps=self.fps, num_inference_steps=job.steps,
                     steps_done=job.steps_done, guidance_scale=job.guidance,
                     step_cache=step_cache_report(job))  # fmt: skip


class VideoJobs:
    """The jobs of one server, their files under `root` (made here, removed by `close`). Thread-safe: the routes
    call it from the event loop, `finish` runs on the engine's worker thread."""

    def __init__(self, parent: str | None, *, max_jobs: int, ttl_s: float, max_bytes: int, timeout_s: float,
                 metrics):  # fmt: skip
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="omni-videos-", dir=parent))
        self.max_jobs, self.ttl_s, self.max_bytes, self.timeout_s = max_jobs, ttl_s, max_bytes, timeout_s
        self.metrics = metrics
        self.jobs: dict[str, VideoJob] = {}  # in creation order
        self.lock = threading.Lock()

    # --- the routes' side ----------------------------------------------------------------------------
    def reserve(self, video: VideoJob) -> None:
        """Hold `video` (before the engine gets it): room made by removing the oldest finished job if needed; 429
        when every job held is unfinished."""
        with self.lock:
            self._sweep()
            if len(self.jobs) >= self.max_jobs:
                oldest = min((v for v in self.jobs.values() if v.finished), key=lambda v: v.finished_at, default=None)
                if oldest is None:
                    raise RequestError(429, f"the video job store is full ({self.max_jobs} jobs queued or running, "
                                       "--max-video-jobs); retry later, or DELETE a job you no longer need",
                                       type="overloaded_error", headers={"Retry-After": RETRY_AFTER_FULL})  # fmt: skip
                self._remove(oldest, "evicted")
            self.jobs[video.id] = video

    def release(self, video: VideoJob) -> None:
        """Forget a reserved job the engine refused."""
        with self.lock:
            self.jobs.pop(video.id, None)

    def get(self, video_id: str) -> VideoJob:
        with self.lock:
            self._sweep()
            video = self.jobs.get(video_id)
        if video is None:
            raise RequestError(404, f"no video job {video_id!r}: it never existed, was deleted, or finished more than "
                               f"{self.ttl_s:g} s ago (--video-ttl) or was removed to make room for newer ones",
                               type="not_found_error", param="video_id")  # fmt: skip
        return video

    def listing(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        with self.lock:
            self._sweep()
            videos = list(self.jobs.values())
        if order == "desc":
            videos.reverse()
        if after is not None:
            ids = [v.id for v in videos]
            if after not in ids:
                raise RequestError(400, f"after: no video job {after!r} (it may have been removed)", param="after")
            videos = videos[ids.index(after) + 1:]
        return videos[:limit], len(videos) > limit

    def content(self, video_id: str) -> bytes:
        """The MP4 of a completed job; 409 naming its status otherwise."""
        with self.lock:
            self._sweep()
            video = self.jobs.get(video_id)
            if video is not None and video.path is not None:
                return video.path.read_bytes()  # under the lock: no expiry removes it while read
        video = self.get(video_id)  # 404
        status = video.status()
        if status == "failed":
            raise RequestError(409, f"video job {video_id!r} failed ({video.failure.message}); it has no content",
                               type="conflict_error", param="video_id", code="video_failed")  # fmt: skip
        raise RequestError(409, f"video job {video_id!r} is {status} ({video.progress()}%): its content is ready when "
                           f"its status is completed; poll GET {VIDEOS}/{video_id}", type="conflict_error",
                           param="video_id", code="video_not_ready")  # fmt: skip

    def delete(self, video_id: str) -> VideoJob:
        """Remove a job (404 if unknown): a finished one with its file; an unfinished one is returned for the caller
        to cancel in the engine."""
        with self.lock:
            video = self.jobs.get(video_id)
            if video is not None:
                self._remove(video, None)
        if video is None:
            return self.get(video_id)  # raises 404
        if not video.finished:
            video.job.gone = "cancelled"
            self.metrics.video_job_done("cancelled")
        return video

    def close(self) -> list[VideoJob]:
        """At shutdown: the unfinished jobs (cancelled: the caller tells the engine) and the directory removed."""
        with self.lock:
            unfinished = [v for v in self.jobs.values() if not v.finished]
            self.jobs.clear()
        for video in unfinished:
            video.job.gone = "cancelled"
            self.metrics.video_job_done("cancelled")
        shutil.rmtree(self.root, ignore_errors=True)
        return unfinished

    # --- the engine's side ---------------------------------------------------------------------------
    def finish(self, video: VideoJob, outcome) -> None:
        """`video`'s engine job ended (a future's done callback): write the MP4, or record the failure."""
        error = outcome.exception()
        mp4 = None if error is not None else outcome.result()[0][1]
        with self.lock:
            if self.jobs.get(video.id) is not video:  # deleted (cancelled) meanwhile
                return
            if error is None and len(mp4) > self.max_bytes:
                error = RequestError(500, f"the video is {len(mp4)} bytes, more than --video-max-bytes "
                                     f"{self.max_bytes} allows for all videos together; raise it")  # fmt: skip
            if error is None:
                try:
                    self._write(video, mp4)
                except OSError as e:
                    error = RequestError(500, f"cannot write the video under {self.root}: {e.strerror or e}")
            if error is not None:
                video.failure = _failure(video, error, self.timeout_s)
            video.finished_at = time.time()
            self._sweep()
        self.metrics.video_job_done(video.status())
        if error is not None:
            logger.info("video job %s failed: %s", video.id, video.failure.message)

    # --- under self.lock -----------------------------------------------------------------------------
    def _write(self, video: VideoJob, mp4: bytes) -> None:
        used = sum(v.nbytes for v in self.jobs.values())
        for old in sorted((v for v in self.jobs.values() if v.path is not None), key=lambda v: v.finished_at):
            if used + len(mp4) <= self.max_bytes:
                break
            used -= old.nbytes
            self._remove(old, "evicted")
        path = self.root / f"{video.id}.mp4"
        partial = path.with_suffix(".partial")
        partial.write_bytes(mp4)
        os.replace(partial, path)
        video.path, video.nbytes = path, len(mp4)

    def _sweep(self) -> None:
        now = time.time()
        for video in [v for v in self.jobs.values() if v.finished and now - v.finished_at > self.ttl_s]:
            self._remove(video, "expired")

    def _remove(self, video: VideoJob, reason: str | None) -> None:
        self.jobs.pop(video.id, None)
        if video.path is not None:
            with contextlib.suppress(FileNotFoundError):
                video.path.unlink()
            video.path = None
        if reason:
            self.metrics.video_job_done(reason)


def _failure(video: VideoJob, error: BaseException, timeout_s: float) -> VideoError:
    if video.job.gone == "deadline":
        return VideoError(code="deadline_exceeded", message=f"the job did not finish within {timeout_s:g} s of its "
                          "creation (--timeout); ask for fewer steps or frames, or raise --timeout")  # fmt: skip
    if isinstance(error, RequestError):
        return VideoError(code=_FAILURE_CODES.get(error.status, "server_error"), message=error.body.message)
    return VideoError(code="server_error", message=f"{type(error).__name__}: {error}")


async def read_video_request(request: Request) -> VideoRequest:
    """The body as JSON (strict types) or as a form (multipart/form-data, what OpenAI's client sends, or
    urlencoded: numbers read from their text); 422 through the app's handler when it does not fit."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
            try:
                form = await request.form()
            except (HTTPException, MultiPartException, ValueError) as e:  # Starlette's 400 for a malformed form
                why = getattr(e, "detail", None) or getattr(e, "message", None) or str(e)
                raise RequestError(400, f"the body is not a readable {kind} form ({why}); send JSON or a valid form",
                                   code="invalid_form") from None  # fmt: skip
            return VideoRequest.model_validate(dict(form.multi_items()))
        return VideoRequest.model_validate_json(await request.body() or b"", strict=True)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def video_frames(req: VideoRequest, pipe, height: int, width: int) -> tuple[int, str]:
    """The frames a request asks for (num_frames, else seconds * fps + 1, else the first served at its size) and the
    parameter that said it; raises RequestError (400) for frames not served here."""
    from_seconds = None
    if req.seconds is not None:
        try:
            seconds = float(req.seconds)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise RequestError(400, f"seconds must be a positive number, got {req.seconds!r}", param="seconds")
        from_seconds = round(seconds * pipe.fps) + 1
    if req.num_frames is not None and from_seconds is not None and req.num_frames != from_seconds:
        raise RequestError(400, f"seconds {req.seconds} is {from_seconds} frames at {pipe.fps} fps, not num_frames "
                           f"{req.num_frames}; give one of them", param="seconds")  # fmt: skip
    param = "num_frames" if req.num_frames is not None else "seconds"
    frames = req.num_frames if req.num_frames is not None else from_seconds
    served = pipe.frames(height, width)
    if not pipe.compiled:  # JIT fallback: any frame count Wan takes
        frames = 81 if frames is None else frames
        if frames % 4 != 1 or not 1 <= frames <= 1025:
            raise RequestError(400, f"{param}: {frames} frames; Wan takes 4k+1 frames from 1 to 1025 (e.g. 81)",
                               param=param)  # fmt: skip
        return frames, param
    frames = served[0] if frames is None else frames
    if frames not in served:
        offered = ", ".join(f"{f} frames ({pipe.duration(f):g} s)" for f in served)
        raise RequestError(400, f"{param}: {frames} frames ({pipe.duration(frames):g} s at {pipe.fps} fps) are not "
                           f"served at {width}x{height}: the artifact was compiled for {offered} there; ask "
                           "for one of them with num_frames or seconds, or rebuild the artifact with "
                           f"{height}x{width}x{frames} added to --shapes", param=param,
                           code="unsupported_frames")  # fmt: skip
    return frames, param


def validate_video(req: VideoRequest, pipe, *, max_steps: int, default_steps: int, model_name: str):
    """The request's (height, width, frames, steps, guidance) after the value checks; raises RequestError (400)."""
    check_model(req, model_name)
    if req.input_reference is not None:
        raise RequestError(400, "input_reference: image-to-video is not served; this server makes videos from the "
                           "prompt alone", param="input_reference")  # fmt: skip
    steps = check_common(req, max_steps=max_steps, default_steps=default_steps, seed_room=1)
    height, width = check_size(req.size or pipe.sizes[0], pipe.sizes, any_size=not pipe.compiled,
                               dynamic=pipe.dynamic)  # fmt: skip
    frames, _ = video_frames(req, pipe, height, width)
    guidance = float(pipe.default_guidance if req.guidance_scale is None else req.guidance_scale)
    return height, width, frames, steps, guidance


def add_video_routes(app: FastAPI, config, auth, model_name: str, served) -> None:
    """The /v1/videos routes; `served(request, task)` returns the loaded pipeline when it runs `task` (else 400)."""

    def store(request: Request) -> VideoJobs:
        served(request, "text-to-video")
        return request.app.state.videos

    # the body is read by hand (JSON or a form): its schema for /openapi.json (LoraRef is there through ImageRequest)
    schema = VideoRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    body_doc = {"requestBody": {"required": True, "content": {kind: {"schema": schema} for kind in (
        "application/json", "multipart/form-data", "application/x-www-form-urlencoded")}}}  # fmt: skip

    @app.post(VIDEOS, dependencies=[auth], response_model=Video, openapi_extra=body_doc)
    async def create_video(request: Request):
        pipe = served(request, "text-to-video")
        body = await read_video_request(request)
        height, width, frames, steps, guidance = validate_video(
            body, pipe, max_steps=config.max_steps, default_steps=config.default_steps, model_name=model_name)
        why = pipe.prompt_error(body.prompt)
        if why:
            raise RequestError(400, why, param="prompt", code="prompt_too_long")
        lora = lora_setting(body, pipe.loras)
        step_cache = step_cache_setting(body, config.step_cache)
        sizes = usable_batch_sizes(pipe, height, width, config.max_batch, frames)
        if split_batch(1, sizes) is None:
            raise RequestError(400, f"{width}x{height} with {frames} frames is compiled for batches of {sizes} only; "
                               "a video job is one video: rebuild with a batch-1 bucket (HxWxF@1)",
                               param="size")  # fmt: skip
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(6), "big")
        job = Job(prompt=body.prompt, n=1, seed=seed, height=height, width=width, steps=steps, guidance=guidance,
                  deadline=time.monotonic() + config.timeout_s, lora=lora, frames=frames,
                  step_cache=step_cache)  # fmt: skip
        videos: VideoJobs = request.app.state.videos
        video = VideoJob(id=f"video_{secrets.token_hex(12)}", job=job, model=model_name,
                         seconds=f"{pipe.duration(frames):g}", fps=pipe.fps, created_at=int(time.time()))  # fmt: skip
        videos.reserve(video)
        try:
            future = request.app.state.engine.submit(job)
        except RequestError:
            videos.release(video)
            raise
        future.add_done_callback(lambda f: videos.finish(video, f))
        logger.info("video job %s: %dx%d, %d frames, %d steps", video.id, width, height, frames, steps)
        return video.describe(videos.ttl_s)

    @app.get(VIDEOS, dependencies=[auth], response_model=VideoList)
    async def list_videos(request: Request, after: str | None = None, limit: int = 20, order: str = "desc"):
        if not 1 <= limit <= 100:
            raise RequestError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise RequestError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        videos = store(request)
        page, more = videos.listing(after, limit, order)
        data = [v.describe(videos.ttl_s) for v in page]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=more)  # fmt: skip

    @app.get(VIDEOS + "/{video_id}", dependencies=[auth], response_model=Video)
    async def retrieve_video(video_id: str, request: Request):
        videos = store(request)
        return videos.get(video_id).describe(videos.ttl_s)

    @app.get(VIDEOS + "/{video_id}/content", dependencies=[auth], response_class=Response,
             responses={200: {"content": {"video/mp4": {}}, "description": "the MP4"}})  # fmt: skip
    async def video_content(video_id: str, request: Request, variant: str = "video"):
        videos = store(request)
        if variant != "video":
            raise RequestError(400, f"variant {variant!r} is not served; only 'video' (the MP4)", param="variant")
        mp4 = await asyncio.to_thread(videos.content, video_id)
        return Response(mp4, media_type="video/mp4",
                        headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})  # fmt: skip

    @app.delete(VIDEOS + "/{video_id}", dependencies=[auth], response_model=VideoDeleted)
    async def delete_video(video_id: str, request: Request):
        video = store(request).delete(video_id)
        if not video.finished:
            request.app.state.engine.forget(video.job)
            logger.info("video job %s cancelled", video.id)
        return VideoDeleted(id=video.id)
