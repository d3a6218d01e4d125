"""Serving benchmark: `omni-compile serve` start-up, per-request latency, a burst of concurrent requests, and
the same pipeline in eager diffusers and with stock regional torch.compile, in one command.

    python -P bench/serve.py --artifact ART --steps 28 --reps 3 --concurrent 32 --json results/serve.json   # GPU (W1)
    python -P bench/serve.py --artifact WAN_ART --steps 20 --reps 1 --modes server --json results/video.json  # Wan video
    python -P bench/serve.py --artifact out/flux-tiny --steps 4 --reps 3 --concurrent 8 --json /tmp/serve.json  # CPU

ART is an artifact built for a preset (`omni-compile build flux-dev --shapes 1024x1024 --out ART`, or a Wan one:
`omni-compile build wan-1.3b --shapes 480x832x81 --out WAN_ART`); the size is its first bucket unless --size
WxH[xFRAMES] says otherwise. A FLUX artifact is served as text-to-image (`POST /v1/images/generations`, one
request = one PNG), a Wan one as text-to-video (a job: `POST /v1/videos`, polled until completed, then its MP4
downloaded and checked; one request = all of that). Steps, in this order, so that only one copy of the
pipeline is in device memory at a time:

  server   `omni-compile serve ART` in a subprocess: spawn -> /health 200 (split into Python start and
           imports, transformer weight creation, other parts' weight creation, artifact load, warm-up, from
           the server's /v1/models), then --warmup requests and --reps timed requests (client side: HTTP,
           the pipeline, PNG or MP4 encoding and base64 included); then --concurrent requests sent at once
           (each its own connection): every answer's status (429s are the server's admission control, with
           Retry-After), latency percentiles of the answered ones, the burst's wall time; then SIGTERM and
           wait for the exit
  eager    the same pipeline (same preset, seeds and random weights) in this process, diffusers as is
  stock    the same pipeline object with `pipe.transformer.compile_repeated_blocks(fullgraph=True)`; the
           first call (compile included) is reported apart

In-process modes time the pipeline call plus PNG or MP4 encoding, so that they do the same work as a server
request. Times: median and [min-max] over --reps after --warmup; JSON to --json; a short table printed last.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "a red cat"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(port: int, path: str, body: dict | None = None, timeout: float = 600, raw: bool = False,
          headers: dict | None = None, method: str | None = None) -> tuple[int, dict | bytes]:  # fmt: skip
    """(status, the JSON answer, or its bytes with `raw`); `headers`, if given, receives the answer's headers (names
    in lower case, as HTTP/1.1 leaves their case free)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if headers is not None:
                headers.update({k.lower(): v for k, v in r.headers.items()})
            payload = r.read()
            return r.status, payload if raw else json.loads(payload)
    except urllib.error.HTTPError as e:
        if headers is not None:
            headers.update({k.lower(): v for k, v in e.headers.items()})
        return e.code, json.loads(e.read() or b"{}")


def _summary(times: list[float]) -> dict:
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4), "reps": len(times), "all_s": [round(t, 4) for t in times]}  # fmt: skip


def _percentiles(times: list[float]) -> dict:
    if not times:
        return {}
    q = sorted(times)

    def pct(p: float) -> float:  # nearest rank
        return round(q[min(len(q) - 1, max(0, int(-(-p * len(q) // 100)) - 1))], 4)

    return {"p50_s": pct(50), "p90_s": pct(90), "p99_s": pct(99), "max_s": round(q[-1], 4), "min_s": round(q[0], 4),
            "mean_s": round(statistics.fmean(q), 4)}  # fmt: skip


def _image_request(port: int, body: dict, headers: dict | None = None) -> tuple[int, bytes | dict]:
    """One image request: (status, the PNG's bytes) or (status, the error answer)."""
    status, resp = _call(port, "/v1/images/generations", body, headers=headers)
    if status != 200:
        return status, resp
    return status, base64.b64decode(resp["data"][0]["b64_json"])


def _video_request(port: int, body: dict, headers: dict | None = None, poll: float = 0.25,
                   limit: float = 3600) -> tuple[int, bytes | dict]:  # fmt: skip
    """One video job: created, polled until it ends, its MP4 downloaded, the job deleted: (200, the MP4's bytes),
    or (status, the error answer) of the creation, or (500, the failed job). Polls every 10 ms at first, then
    less often, up to every `poll` seconds (a client's polling interval adds to a short job's time)."""
    status, job = _call(port, "/v1/videos", body, headers=headers)
    if status != 200:
        return status, job
    t0, wait = time.perf_counter(), 0.01
    while job["status"] in ("queued", "in_progress"):
        if time.perf_counter() - t0 > limit:
            return 504, job
        time.sleep(wait)
        wait = min(poll, wait * 1.5)
        status, job = _call(port, f"/v1/videos/{job['id']}")
        if status != 200:
            return status, job
    if job["status"] != "completed":
        return 500, job
    status, mp4 = _call(port, f"/v1/videos/{job['id']}/content", raw=True)
    _call(port, f"/v1/videos/{job['id']}", timeout=60, method="DELETE")  # the job store stays small over many requests
    return status, mp4


def _check_output(task: str, payload) -> int:
    """The output's size in bytes, after checking it is a PNG or an MP4."""
    magic = (b"\x89PNG\r\n\x1a\n", 0) if task == "image" else (b"ftyp", 4)
    if isinstance(payload, bytes) and payload[magic[1] : magic[1] + len(magic[0])] == magic[0]:
        return len(payload)
    raise RuntimeError(f"the answer is not a{' PNG' if task == 'image' else 'n MP4'}: {str(payload)[:200]}")


def burst(port: int, task: str, body: dict, n: int) -> dict:
    """`n` requests sent at once, each on its own thread and connection: statuses, latency percentiles of the
    answered ones (200), 429s with their Retry-After, and the burst's wall time."""
    results: list[tuple[int, float, str | None, str]] = [None] * n  # type: ignore[list-item]
    start = threading.Barrier(n + 1)
    request = _image_request if task == "image" else _video_request

    def one(i: int) -> None:
        start.wait()
        t = time.perf_counter()
        headers: dict = {}
        try:
            status, payload = request(port, body, headers)
            note = "" if status == 200 else json.dumps(payload)[:200]
            if status == 200:
                _check_output(task, payload)
        except (OSError, RuntimeError, ValueError, KeyError) as e:  # a dropped connection: an error, not a crash
            status, note = -1, f"{type(e).__name__}: {e}"
        results[i] = (status, time.perf_counter() - t, headers.get("retry-after"), note)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for status, _, _, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    ok = [dt for status, dt, _, _ in results if status == 200]
    errors = [note for status, _, _, note in results if status not in (200, 429)]
    return {"requests": n, "statuses": statuses, "answered": len(ok), "latency": _percentiles(ok),
            "rejected_429_latency": _percentiles([dt for s, dt, _, _ in results if s == 429]),
            "retry_after": sorted({ra for s, _, ra, _ in results if s == 429 and ra is not None}),
            "wall_s": round(wall, 3), "outputs_per_s": round(len(ok) / wall, 4) if wall else None,
            "errors_other_than_429": len(errors), "error_examples": errors[:3]}  # fmt: skip


def bench_server(args, task: str, size: tuple[int, int, int | None], log: Path) -> dict:
    width, height, frames = size
    port = _port()
    cmd = [sys.executable, "-P", "-m", "omni_compile.cli", "serve", args.artifact, "--host", "127.0.0.1",
           "--port", str(port), "--max-steps", str(max(100, args.steps)), "--timeout", "3600"]  # fmt: skip
    if args.max_queue is not None:
        cmd += ["--max-queue", str(args.max_queue)]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            ready = None
            while ready is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
                try:
                    if _call(port, "/health", timeout=5)[0] == 200:
                        ready = time.perf_counter() - t0
                except OSError:
                    pass
                if ready is None and time.perf_counter() - t0 > args.start_limit:
                    raise RuntimeError(f"the server was not healthy after {args.start_limit} s; see {log}")
                time.sleep(0.1)
            _, models = _call(port, "/v1/models")
            startup = models["data"][0]["startup_seconds"]
            body = {"prompt": PROMPT, "size": f"{width}x{height}", "num_inference_steps": args.steps, "seed": 0}
            if frames is not None:
                body["num_frames"] = frames
            request = _image_request if task == "image" else _video_request
            times, first, first_request = [], None, None
            for i in range(args.warmup + args.reps):
                t = time.perf_counter()
                status, payload = request(port, body)
                if status != 200:
                    raise RuntimeError(f"request failed with {status}: {payload}")
                dt = time.perf_counter() - t
                if first is None:
                    first, first_request = _check_output(task, payload), round(dt, 3)
                if i >= args.warmup:
                    times.append(dt)
            concurrent = burst(port, task, body, args.concurrent) if args.concurrent else None
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    res = {"start_to_health_s": round(ready, 3), "startup_seconds": startup, "exit_code_after_sigterm": code,
           "first_call_s": first_request, "request": _summary(times), "output_bytes": first,
           "concurrent": concurrent}  # fmt: skip
    pre = ready - startup.get("load_total", 0) - (startup.get("warmup") or 0)
    res["process_start_and_imports_s"] = round(pre, 3)  # also the artifact check and the last /health poll
    parts = ("transformer_weights", "artifact_load", "other_parts")
    res["rest_of_loading_s"] = round(startup.get("load_total", 0) - sum(startup.get(k, 0) for k in parts), 3)
    return res


def _pipeline(manifest: dict, device: str):
    """The served pipeline of the artifact's preset (the server's own task class builds it) with the build's
    seeded random weights, run as diffusers runs it."""
    import torch
    from omni_compile.models import resolve_model
    from omni_compile.server.pipeline import task_class

    from omni_compile.artifact.manifest import read_manifest

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[manifest["build"]["dtype"]]
    preset = manifest["model"]["source"].removeprefix("preset:")
    seed = manifest["weights"].get("seed", 0)
    cls = task_class(read_manifest(Path(manifest["_root"])), manifest["_root"])
    t0 = time.perf_counter()
    spec = resolve_model(preset, model_config=manifest["model"]["config"])
    transformer = spec.load(dtype=dtype, device=device, seed=seed)
    pipe = cls.random_pipeline(preset, transformer, text_len=int(manifest["build"]["text_len"]), dtype=dtype,
                               device=device, seed=seed)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return pipe, cls.default_guidance, round(time.perf_counter() - t0, 3)


def _request(pipe, manifest, device, size, steps, guidance) -> bytes:
    import torch

    width, height, frames = size
    common = {"prompt": [PROMPT], "height": height, "width": width, "num_inference_steps": steps,
              "guidance_scale": guidance, "max_sequence_length": int(manifest["build"]["text_len"]),
              "generator": [torch.Generator(device).manual_seed(0)]}  # fmt: skip
    with torch.no_grad():  # as the CUDA-graph runtime is tested (not inference mode)
        if frames is None:
            out = pipe(**common, output_type="pil")
            buf = io.BytesIO()
            out.images[0].save(buf, format="PNG")
            return buf.getvalue()
        from omni_compile.server.text_to_video import encode_mp4, to_uint8

        out = pipe(**common, num_frames=frames, output_type="np")
        return encode_mp4(to_uint8(out.frames[0]), 16)


def bench_in_process(args, manifest, size, modes) -> dict:
    import torch

    device = manifest["build"]["device"]
    pipe, guidance, weights_s = _pipeline(manifest, device)
    results = {"weights_s": weights_s}
    for mode in modes:
        if mode == "stock":
            torch._dynamo.reset()
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        times, first_call = [], None
        for i in range(args.warmup + args.reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            _request(pipe, manifest, device, size, args.steps, guidance)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if i == 0:
                first_call = round(dt, 3)
            if i >= args.warmup:
                times.append(dt)
        results[mode] = {"first_call_s": first_call, "request": _summary(times)}
        print(f"{mode}: median {results[mode]['request']['median_s']:.3f} s", file=sys.stderr, flush=True)
    if device == "cuda":
        results["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--artifact", required=True, help="artifact directory of a preset (flux-dev, flux-tiny, wan-1.3b, ...)"
    )
    p.add_argument("--size", help="WIDTHxHEIGHT[xFRAMES] (default: the artifact's first bucket)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="server,eager,stock", help="comma-separated: server, eager, stock")
    p.add_argument("--concurrent", type=int, default=0, help="server: then this many requests at once (0: none)")
    p.add_argument("--max-queue", type=int, help="server: its --max-queue (default: the server's)")
    p.add_argument("--start-limit", type=float, default=600, help="seconds to wait for /health 200")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log", default=None, help="server log file (default: next to --json, or /tmp)")
    args = p.parse_args(argv)

    manifest = json.loads((Path(args.artifact) / "manifest.json").read_text())
    manifest["_root"] = args.artifact
    task = "video" if manifest["model"].get("family") == "wan" else "image"
    first = [int(v) for v in manifest["build"]["buckets"][0].split("@")[0].split("x")]  # HEIGHTxWIDTH[xFRAMES]
    if args.size:
        dims = [int(v) for v in args.size.lower().split("x")]
        size = (dims[0], dims[1], dims[2] if len(dims) > 2 else (first[2] if len(first) > 2 else None))
    else:
        size = (first[1], first[0], first[2] if len(first) > 2 else None)
    if (task == "video") != (size[2] is not None):
        p.error(f"--size {args.size}: a {task} artifact's size is WIDTHxHEIGHT{'xFRAMES' if task == 'video' else ''}")
    width, height, frames = size
    modes = [m for m in args.modes.split(",") if m]
    log = Path(args.log or (Path(args.json).with_suffix(".server.log") if args.json else "/tmp/serve_bench.server.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    result = {"artifact": args.artifact, "model": manifest["model"]["source"], "device": manifest["build"]["device"],
              "dtype": manifest["build"]["dtype"], "task": task, "size_wxh": f"{width}x{height}", "frames": frames,
              "steps": args.steps, "reps": args.reps, "warmup": args.warmup}  # fmt: skip
    if "server" in modes:
        result["server"] = bench_server(args, task, size, log)
        print(f"server: ready in {result['server']['start_to_health_s']:.2f} s, median "
              f"{result['server']['request']['median_s']:.3f} s", file=sys.stderr, flush=True)  # fmt: skip
    local = [m for m in modes if m in ("eager", "stock")]
    if local:
        result.update(bench_in_process(args, manifest, size, local))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    _table(result, modes)
    return 0


def _table(r: dict, modes: list[str]) -> None:
    what = f"{r['size_wxh']}x{r['frames']} frames (a video job each)" if r.get("frames") else r["size_wxh"]
    print(f"\nserve bench: {r['model']} {r['dtype']} on {r['device']}, {what}, {r['steps']} steps, "
          f"{r['reps']} reps after {r['warmup']} warm-up")  # fmt: skip
    if "server" in r:
        s, st = r["server"], r["server"]["startup_seconds"]
        print(f"server start -> /health 200: {s['start_to_health_s']:.2f} s = process start and imports "
              f"{s['process_start_and_imports_s']:.2f} + transformer weights {st.get('transformer_weights', 0):.2f} + "
              f"other parts' weights {st.get('other_parts', 0):.2f} + artifact load {st.get('artifact_load', 0):.2f} "
              f"+ rest of loading {s['rest_of_loading_s']:.2f} + warm-up {st.get('warmup') or 0:.2f}")  # fmt: skip
        c = s.get("concurrent")
        if c:
            lat = c["latency"]
            print(f"{c['requests']} at once: statuses {c['statuses']}, errors other than 429: {c['errors_other_than_429']}; "
                  f"answered latency p50 {lat.get('p50_s', '-')} p90 {lat.get('p90_s', '-')} p99 {lat.get('p99_s', '-')} "
                  f"max {lat.get('max_s', '-')} s; {c['outputs_per_s']} outputs/s over {c['wall_s']} s"
                  + (f"; 429 Retry-After {c['retry_after']}" if c["retry_after"] else ""))  # fmt: skip
    base = r.get("eager", {}).get("request", {}).get("median_s")
    print(f"{'mode':<8} {'median s':>9} {'min-max s':>17} {'vs eager':>9} {'first call s':>13}")
    for m in modes:
        row = r.get(m)
        if not row:
            continue
        q = row["request"]
        speed = f"{base / q['median_s']:.2f}x" if base else "-"
        first = row.get("first_call_s")
        print(f"{m:<8} {q['median_s']:>9.3f} {q['min_s']:>8.3f}-{q['max_s']:<8.3f} {speed:>9} "
              f"{'-' if first is None else f'{first:.2f}':>13}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
