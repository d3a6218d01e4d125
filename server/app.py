"""`build_app(config)`: the FastAPI app of `omni-compile serve` (routes in docs/serving.md).

The lifespan loads the pipeline (an artifact that fails its checks stops the start-up), then starts the
engine, whose worker warms up every bucket before /health turns 200; at shutdown it lets the engine
finish the requests it holds. Every error leaves as `{"error": {"message", "type", "param", "code"}}`
from the handlers in `_install_error_handlers`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import os
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from omni_compile.errors import ConfigError, OmniCompileError
from omni_compile.server.config import ServeConfig
from omni_compile.server.engine import Engine, Job, split_batch, usable_batch_sizes
from omni_compile.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from omni_compile.server.schemas import (ImageData, ImageRequest, ImageResponse, LoraLoad, RequestError,
                                         lora_setting, step_cache_report, step_cache_setting, validate)  # fmt: skip
from omni_compile.server.videos import VIDEOS, VideoJobs, add_video_routes

logger = logging.getLogger("omni_compile.server")
GENERATIONS = "/v1/images/generations"


def build_app(config: ServeConfig, *, loader=None) -> FastAPI:
    """The app. `loader(config)` returns the loaded pipeline (default: `pipeline.load_pipeline`)."""
    metrics = Metrics()
    model_name = config.model_name or Path(config.artifact).name

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if loader is None:
            from omni_compile.server.pipeline import load_pipeline as load
        else:
            load = loader
        t0 = time.perf_counter()
        try:
            pipe = await asyncio.to_thread(load, config)
        except OmniCompileError as e:  # `omni-compile serve` reports it on one line after uvicorn stops
            app.state.startup_error = e
            raise
        app.state.load_seconds = round(time.perf_counter() - t0, 3)
        logger.info("pipeline loaded in %.2f s (%s): %s", app.state.load_seconds, pipe.source, pipe.seconds)
        engine = Engine(pipe, metrics, max_queue=config.max_queue, max_batch=config.max_batch,
                        warmup=lambda: _warmup(pipe, config))  # fmt: skip
        videos = None
        if _task(pipe) == "text-to-video":
            videos = VideoJobs(config.video_dir, max_jobs=config.max_video_jobs, ttl_s=config.video_ttl_s,
                               max_bytes=config.video_max_bytes, timeout_s=config.timeout_s, metrics=metrics)  # fmt: skip
            logger.info("video jobs are written under %s", videos.root)
        app.state.pipe, app.state.engine, app.state.videos, app.state.started = pipe, engine, videos, time.time()
        engine.start()
        try:
            yield
        finally:
            if videos is not None:  # nobody could fetch them after the exit: cancel, so that the drain is short
                for video in videos.close():
                    engine.forget(video.job)
            await asyncio.to_thread(engine.stop)

    # No docs pages (a browser cannot send the Bearer key); /openapi.json is a route below, behind the key.
    app = FastAPI(title="omni-compile", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config, app.state.metrics, app.state.model_name = config, metrics, model_name
    app.state.startup_error = None
    _install_error_handlers(app)
    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(_Count, metrics=metrics)  # outermost: it counts the 413s too
    auth = Depends(_require_key(config.api_key))

    @app.get("/openapi.json", dependencies=[auth], include_in_schema=False)
    async def openapi():
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health(request: Request):
        engine = getattr(request.app.state, "engine", None)
        if engine is not None and engine.ready:
            return {"status": "ok"}
        state = "loading" if engine is None else engine.state
        body = {"status": state}
        if engine is not None and engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=503)

    @app.get("/v1/models", dependencies=[auth])
    async def models(request: Request):
        pipe = served(request)
        entry = {
            "id": model_name, "object": "model", "owned_by": "omni-compile", "created": int(request.app.state.started),
            "task": _task(pipe), "sizes": pipe.sizes,
            "max_sequence_length": pipe.text_len, "compiled": pipe.compiled, "pipeline": pipe.source,
            "startup_seconds": {**pipe.seconds, "load_total": request.app.state.load_seconds,
                                "warmup": request.app.state.engine.warmup_seconds},
        }  # fmt: skip
        if pipe.dynamic is not None:  # besides the sizes: every width and height of the range
            entry["dynamic"] = pipe.dynamic.to_json()
        if _task(pipe) == "text-to-video":
            entry["frames"] = {s: pipe.frames(*_hw(s)) for s in pipe.sizes}
            entry["batch_sizes"] = {f"{s}x{f}": pipe.batch_sizes(*_hw(s), f) for s in pipe.sizes
                                    for f in pipe.frames(*_hw(s))}  # fmt: skip
            entry["fps"] = pipe.fps
        else:
            entry["batch_sizes"] = {s: pipe.batch_sizes(*_hw(s)) for s in pipe.sizes}
        return {"object": "list", "data": [entry]}

    def served(request: Request, task: str | None = None):
        """The loaded pipeline (503 while it loads); 400 when it does not run `task`."""
        pipe = getattr(request.app.state, "pipe", None)
        if pipe is None:
            raise RequestError(503, "the server is warming up; retry in a few seconds", type="overloaded_error",
                               headers={"Retry-After": "2"})  # fmt: skip
        if task is not None and _task(pipe) != task:
            route = VIDEOS if _task(pipe) == "text-to-video" else GENERATIONS
            raise RequestError(400, f"this server runs {_task(pipe)} ({model_name}), not {task}; use POST {route}",
                               code="unsupported_task")  # fmt: skip
        return pipe

    def loaded_loras(request: Request):
        pipe = served(request)
        if pipe.loras is None:
            raise RequestError(400, "this server's model takes no LoRA", param="name")
        return pipe.loras

    @app.get("/v1/loras", dependencies=[auth])
    async def list_loras(request: Request):
        return loaded_loras(request).describe()

    @app.post("/v1/loras", dependencies=[auth], status_code=201)
    def load_lora(body: LoraLoad, request: Request):  # a plain def: the file is read in the thread pool
        loras = loaded_loras(request)
        try:
            adapter = loras.load(body.name, body.path)
        except ConfigError as e:
            raise RequestError(409 if "already loaded" in str(e) else 400, str(e),
                               param="name" if "name" in str(e).split(":")[0] else "path") from None  # fmt: skip
        logger.info("LoRA %s loaded from %s (%d modules, rank %d)", adapter.name, adapter.path, len(adapter.deltas),
                    adapter.rank)  # fmt: skip
        return {"name": adapter.name, "modules": len(adapter.deltas), "rank": adapter.rank}

    @app.delete("/v1/loras/{name}", dependencies=[auth])
    def unload_lora(name: str, request: Request):  # a plain def: it waits for a batch running with it
        try:
            loaded_loras(request).unload(name)
        except ConfigError as e:
            raise RequestError(404, str(e), type="not_found_error") from None
        logger.info("LoRA %s unloaded", name)
        return {"name": name, "deleted": True}

    @app.get("/metrics", dependencies=[auth])
    async def metrics_route(request: Request):
        engine = getattr(request.app.state, "engine", None)
        text = metrics.render(queue_depth=engine.depth() if engine else 0, ready=bool(engine and engine.ready),
                              worker_alive=bool(engine and engine.alive))  # fmt: skip
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)

    @app.post(GENERATIONS, dependencies=[auth], response_model=ImageResponse, response_model_exclude_none=True)
    async def generate(body: ImageRequest, request: Request):
        pipe, engine = served(request, "text-to-image"), request.app.state.engine
        height, width, steps = validate(
            body, sizes=pipe.sizes, default_size=pipe.sizes[0], max_n=config.max_n, max_steps=config.max_steps,
            default_steps=config.default_steps, model_name=model_name, any_size=not pipe.compiled,
            dynamic=pipe.dynamic,
        )
        step_cache = step_cache_setting(body, config.step_cache)
        lora = lora_setting(body, pipe.loras)
        why = pipe.prompt_error(body.prompt)
        if why:
            raise RequestError(400, why, param="prompt", code="prompt_too_long")
        sizes = usable_batch_sizes(pipe, height, width, config.max_batch)
        if split_batch(body.n, sizes) is None:
            raise RequestError(400, f"n={body.n} cannot be made of the compiled batch sizes {sizes} for "
                               f"{width}x{height}; ask for a multiple of them", param="n")  # fmt: skip
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(6), "big")
        job = Job(prompt=body.prompt, n=body.n, seed=seed, height=height, width=width, steps=steps,
                  guidance=float(body.guidance_scale), deadline=time.monotonic() + config.timeout_s,
                  step_cache=step_cache, lora=lora)  # fmt: skip
        future = asyncio.wrap_future(engine.submit(job))
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                job.gone = "disconnected"
                _abandon(future)
                engine.forget(job)
                raise RequestError(499, "the client disconnected")
            if time.monotonic() > job.deadline:
                job.gone = "deadline"
                _abandon(future)
                engine.forget(job)
                raise RequestError(504, f"the request did not finish within {config.timeout_s:g} s; retry, "
                                   "or ask for fewer steps or images", type="timeout_error")  # fmt: skip
        images = future.result()
        report = step_cache_report(job)
        return ImageResponse(created=int(time.time()), data=[
            ImageData(b64_json=base64.b64encode(png).decode(), revised_prompt=body.prompt, seed=s) for s, png in images
        ], step_cache=report)  # fmt: skip

    add_video_routes(app, config, auth, model_name, served)
    return app


def _task(pipe) -> str:
    return getattr(pipe, "task", "text-to-image")


def _abandon(future: asyncio.Future) -> None:
    """Nobody will read `future`: retrieve its outcome when it comes, so asyncio does not log it as lost."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _hw(size: str) -> tuple[int, int]:
    w, h = size.split("x")
    return int(h), int(w)


def _warmup(pipe, config: ServeConfig) -> None:
    """One small run per bucket and batch size (on CUDA this also captures the bucket's CUDA graph)."""
    guidance = getattr(pipe, "default_guidance", 3.5)
    for b in pipe.buckets:
        video = {} if getattr(b, "frames", None) is None else {"frames": b.frames}
        pipe.run(["warm up"] * b.batch, list(range(b.batch)), b.height, b.width, max(config.warmup_steps, 1), guidance,
                 **video)  # fmt: skip


def _require_key(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        # RFC 7235: the scheme is case-insensitive; extra spaces before the token are tolerated. Starlette
        # decodes header values as latin-1: encoding back gives the bytes sent, compared in constant time.
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode()):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               type="authentication_error", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    return check


def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error body is made here."""

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        b = e.body
        return _error(e.status, b.message, b.type, b.param, b.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error(422, "the body is not valid JSON; send a JSON object such as {\"prompt\": \"a cat\"}",
                          "invalid_request_error", None, "invalid_json")  # fmt: skip
        problems, params = [], []
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            problems.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
            params.append(loc[0] if loc else None)
        return _error(422, "invalid request: " + "; ".join(problems), "invalid_request_error",
                      params[0] if params else None, "invalid_type")  # fmt: skip

    @app.exception_handler(404)
    async def not_found(request: Request, e):
        return _error(404, f"no route {request.method} {request.url.path}; see /v1/models, {GENERATIONS} and "
                      f"{VIDEOS}", "not_found_error")  # fmt: skip

    @app.exception_handler(405)
    async def wrong_method(request: Request, e):
        return _error(405, f"{request.method} is not allowed on {request.url.path}", "invalid_request_error")

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class _Count:
    """ASGI middleware: counts and times every answer of POST /v1/images/generations and POST /v1/videos by status
    (a plain ASGI wrapper, not `BaseHTTPMiddleware`, so that the route still sees a client's disconnect)."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in (GENERATIONS, VIDEOS) or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.request_done(status, time.perf_counter() - t0)


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413. With a Content-Length the server delivers no more
    than it says, so the header decides; a body without one (`Transfer-Encoding: chunked`) is read here first
    and handed on whole, so the route never reads past the limit (an exception raised from `receive` inside
    FastAPI's body parsing would turn into its own 400 "There was an error parsing the body")."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > self.limit:
                await _drain(receive, 8 * self.limit)
                return await _too_large(self.limit, send)
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the route sees its disconnect
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                if more:
                    await _drain(receive, 8 * self.limit)
                return await _too_large(self.limit, send)
            if not more:
                message = {"type": "http.request", "body": bytes(body), "more_body": False}
                break
        first = [message]

        async def replay():
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)


async def _drain(receive, cap: int) -> None:
    """Read (and drop) what the client is still sending, up to `cap` bytes, so that it reads the 413 instead of
    failing on a closed socket; a body larger than that is cut off."""
    seen = 0
    while seen <= cap:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


async def _too_large(limit: int, send) -> None:
    resp = _error(413, f"the request body is larger than {limit} bytes (--max-body-bytes)", "invalid_request_error")
    await send({"type": "http.response.start", "status": 413, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})
