"""`omni-compile serve ART` and `omni-compile pipeline PRESET --out DIR`: options and the commands.

Kept light at import (the CLI builds its parser from here): FastAPI, uvicorn and torch load only when a
command runs. `serve` checks first that it can listen on --host:--port, then the artifact (manifest,
platform, every file's sha256), and exits 2 with one line when one fails, before anything slow loads and
before the HTTP server starts; uvicorn then handles SIGTERM/SIGINT by
closing the listening socket, letting requests in flight finish, and running the lifespan's shutdown,
which lets the engine finish what it holds.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import socket

from omni_compile.errors import ConfigError


def add_serve_arguments(p) -> None:
    p.add_argument("artifact", nargs="?", default="out/flux-tiny",
                   help="an artifact directory written by `omni-compile build`: a FLUX model is served as text-to-image "
                   "(/v1/images/generations), a Wan model as text-to-video (/v1/videos); default out/flux-tiny, "
                   "what a bare `omni-compile build` writes")
    p.add_argument("--pipeline", metavar="DIR", help="diffusers pipeline directory for the text encoders, tokenizers, "
                   "VAE and scheduler (default: the one the artifact was built from; a preset's random one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--device", help="device to run on (default: the one the artifact was built for)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting at most; more get 429 (default 16)")
    p.add_argument("--max-batch", type=int, default=1, help="images of compatible requests run together, when the "
                   "artifact has a bucket of that batch size (default 1)")
    p.add_argument("--max-n", type=int, default=4, help="images per request at most (default 4)")
    p.add_argument("--max-steps", type=int, default=100, help="num_inference_steps at most (default 100)")
    p.add_argument("--default-steps", type=int, default=28, help="steps when a request does not say (default 28)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of the warm-up run per bucket (default 2)")
    p.add_argument("--jit-fallback", action="store_true", help="on another platform, compile the model here "
                   "instead of refusing the artifact (any size is then served)")
    p.add_argument("--model-name", help="model id in /v1/models (default: the artifact directory's name)")
    p.add_argument("--step-cache", metavar="SETTING", help="lossy step caching for requests that do not set "
                   "'step_cache': first_block[:THRESHOLD] (skip the blocks after the first while its output changes "
                   "little), schedule[:FRACTION[:WARMUP]] (compute FRACTION of the steps after WARMUP) or "
                   "taylor[:FRACTION[:WARMUP]] (the schedule, skipped steps forecast to first order). Requests may "
                   "set their own or 'off'. Turns whole-step CUDA graphs off (default: no step caching)")
    p.add_argument("--weights", metavar="DIR", help="serve this checkpoint of the artifact's architecture (a diffusers "
                   "transformer directory, or a pipeline directory's transformer/) instead of the weights it was "
                   "built from; its config is checked against the artifact's; zero compiles")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="load a LoRA (diffusers/PEFT or kohya safetensors) at start; repeatable. Requests pick one with "
                   "\"lora\": {\"name\": NAME, \"scale\": S}; POST /v1/loras and DELETE /v1/loras/NAME change them "
                   "at run time. Merged into the weights per batch: zero compiles")  # fmt: skip
    p.add_argument("--max-video-jobs", type=int, default=16, help="text-to-video: jobs held at most (queued, running "
                   "and finished); a new one replaces the oldest finished one, and is refused with 429 when all are "
                   "unfinished (default 16)")
    p.add_argument("--video-ttl", type=float, default=3600.0, help="text-to-video: seconds a finished job and its MP4 "
                   "are kept (default 3600)")
    p.add_argument("--video-dir", metavar="DIR", help="text-to-video: where the MP4s are written (a directory made in "
                   "DIR at start, removed at exit; default: in the system's temporary directory)")
    p.add_argument("--video-max-bytes", type=int, default=1 << 30, help="text-to-video: the MP4s on disk together at "
                   "most; the oldest finished jobs are removed to make room (default 1 GiB)")
    p.add_argument("--video-fps", type=int, default=16, help="text-to-video: frames a second of the MP4s; a request's "
                   "seconds are seconds * fps + 1 frames (default 16, Wan 2.1's)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")


def add_pipeline_arguments(p) -> None:
    p.add_argument("preset", help="flux-tiny, flux-dev, wan-tiny or wan-1.3b")
    p.add_argument("--out", required=True, help="directory to write (model_index.json, transformer/, text_encoder/, ...)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0, as `build`'s)")
    p.add_argument("--dtype", default="fp32", help="bf16, fp16 or fp32 (default fp32)")


def serve_config(args):
    from omni_compile.server.config import ServeConfig

    positive = {"--max-queue": args.max_queue, "--max-batch": args.max_batch, "--max-n": args.max_n,
                "--max-steps": args.max_steps, "--default-steps": args.default_steps, "--timeout": args.timeout,
                "--max-body-bytes": args.max_body_bytes, "--max-video-jobs": args.max_video_jobs,
                "--video-ttl": args.video_ttl, "--video-max-bytes": args.video_max_bytes,
                "--video-fps": args.video_fps}  # fmt: skip
    for flag, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if args.default_steps > args.max_steps:
        raise ConfigError(f"--default-steps {args.default_steps} is above --max-steps {args.max_steps}")
    if args.step_cache is not None:
        from omni_compile.runtime.step_cache import StepCacheConfig

        try:
            StepCacheConfig.parse(args.step_cache)
        except ConfigError as e:
            raise ConfigError(f"--step-cache: {e}") from None
    loras = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r}: expected NAME=PATH")
        if name in loras:
            raise ConfigError(f"--lora: the name {name!r} is given twice")
        if not os.path.isfile(path):
            raise ConfigError(f"--lora {item!r}: no file {path}")
        loras[name] = path
    api_key = args.api_key
    return ServeConfig(artifact=args.artifact, pipeline=args.pipeline, device=args.device, api_key=api_key,
                       max_queue=args.max_queue, max_batch=args.max_batch, max_n=args.max_n,
                       max_steps=args.max_steps, default_steps=args.default_steps, timeout_s=args.timeout,
                       max_body_bytes=args.max_body_bytes, jit_fallback=args.jit_fallback,
                       warmup_steps=args.warmup_steps, model_name=args.model_name,
                       step_cache=args.step_cache, loras=loras, weights=args.weights,
                       max_video_jobs=args.max_video_jobs, video_ttl_s=args.video_ttl, video_dir=args.video_dir,
                       video_max_bytes=args.video_max_bytes, video_fps=args.video_fps)  # fmt: skip


def check_port(host: str, port: int) -> None:
    """Raise ConfigError now, before anything slow loads, when uvicorn could not listen on host:port (it binds only
    after the lifespan has loaded the pipeline). Binds the way uvicorn's `loop.create_server(host=, port=)` does:
    every address `host` resolves to, SO_REUSEADDR on POSIX (a port in TIME_WAIT is free, a listening one is
    not), IPv6 sockets IPv6-only; then closes the sockets."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {where}: --host {host!r} does not resolve ({e.strerror}); "
                          "pass an address of this machine, such as 127.0.0.1 or 0.0.0.0") from None  # fmt: skip
    with contextlib.ExitStack() as stack:
        for family, kind, proto, _, address in set(infos):
            try:
                sock = stack.enter_context(socket.socket(family, kind, proto))
            except OSError:  # a family this machine lacks; asyncio skips it too
                continue
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    why = "the port is already in use by another process; stop that process or pick another --port"
                elif e.errno == errno.EACCES:
                    why = "permission denied (ports below 1024 need privileges); pick another --port, e.g. 8000"
                else:
                    why = f"{e.strerror}; check --host (an address of this machine) and --port"
                raise ConfigError(f"cannot listen on {where}: {why}") from None


def run_serve(args, console) -> int:
    config = serve_config(args)
    check_port(args.host, args.port)  # before the imports below, which load torch

    import uvicorn

    from omni_compile.artifact.loader import check, preload
    from omni_compile.server.app import build_app
    from omni_compile.server.pipeline import load_pipeline, pipeline_dir, task_class

    # the manifest read, the platform compared and the sha256s checked once: the load takes the result
    checked = check(config.artifact, device=config.device, jit_fallback=config.jit_fallback)
    task = task_class(checked[0], config.artifact)  # a family no task runs is refused here
    if config.step_cache and not task.supports_step_cache:
        raise ConfigError(f"--step-cache: not available for {task.task} yet; serve without it")
    # a missing or mismatched pipeline directory is reported before anything loads
    pipeline_dir(config, checked[0].model.source, task.pipeline_class)
    if config.weights:
        from omni_compile.server.pipeline import weights_dir

        weights_dir(config.weights)
    console.print(f"serving {config.artifact} ({task.task}) on http://{args.host}:{args.port} (loading; /health is "
                  "503 until warm)")  # fmt: skip
    logging.getLogger("omni_compile.server").setLevel(logging.INFO)
    # the compiled files load on a background thread while the weights are read
    preloaded = preload(config.artifact, checked)
    app = build_app(config, loader=functools.partial(load_pipeline, checked=checked, preloaded=preloaded))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=None))  # fmt: skip
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn drains, then re-raises the signal it caught with the handler it found: this one, so that a
        # drained shutdown ends with exit 0 instead of death by signal.
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        server.run()
    except SystemExit:  # uvicorn's exit after a failed start-up
        pass
    if app.state.startup_error is not None:
        raise app.state.startup_error  # one line and exit 2, like a failed check
    if received:
        console.print(f"omni-compile serve: stopped by {signal.Signals(received[0]).name} after finishing the "
                      "requests in flight")  # fmt: skip
    if not server.started:
        console.print("omni-compile: error: the server did not start (the reason is logged above)")
        return 1
    return 0


def run_pipeline_command(args, console) -> int:
    from omni_compile.config import parse_dtype
    from omni_compile.models import flux_pipeline, wan_pipeline

    module = next((m for m in (flux_pipeline, wan_pipeline) if args.preset in m.PARTS), None)
    if module is None:
        raise ConfigError(f"no pipeline for {args.preset!r}; choose one of "
                          f"{', '.join([*flux_pipeline.PARTS, *wan_pipeline.PARTS])}")  # fmt: skip
    out = module.save_pipeline(args.preset, args.out, seed=args.seed, dtype=parse_dtype(args.dtype))
    console.print(f"wrote {out} ({args.preset} pipeline, random weights seed {args.seed}); build it with "
                  f"`omni-compile build {out}` and serve the artifact")  # fmt: skip
    return 0
