"""Serving benchmark: `omni-compile serve` start-up, and per-request latency of the server vs the same
pipeline in eager diffusers and with stock regional torch.compile, in one command.

    python -P bench/serve.py --artifact ART --steps 28 --reps 3 --json results/serve.json     # GPU (W1: flux-dev 1024x1024)
    python -P bench/serve.py --artifact out/flux-tiny --steps 4 --reps 3 --json /tmp/serve.json  # CPU smoke (flux-tiny)

ART is an artifact built for a preset (`omni-compile build flux-dev --shapes 1024x1024 --out ART`); the
size is its first bucket unless --size WxH says otherwise. Steps, in this order, so that only one copy
of the pipeline is in device memory at a time:

  server   `omni-compile serve ART` in a subprocess: spawn -> /health 200 (split into Python start and
           imports, transformer weight creation, other parts' weight creation, artifact load, warm-up, from
           the server's /v1/models), then --warmup requests and --reps timed requests (client side: HTTP,
           the pipeline, PNG encoding and base64 included); then SIGTERM and wait for the exit
  eager    the same pipeline (same preset, seeds and random weights) in this process, diffusers as is
  stock    the same pipeline object with `pipe.transformer.compile_repeated_blocks(fullgraph=True)`; the
           first call (compile included) is reported apart

In-process modes time `pipe(...)` plus PNG encoding, so that they do the same work as a server request.
Times: median and [min-max] over --reps after --warmup; JSON to --json; a short table printed last.
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
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "a red cat"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(port: int, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _summary(times: list[float]) -> dict:
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4), "reps": len(times), "all_s": [round(t, 4) for t in times]}  # fmt: skip


def bench_server(args, width: int, height: int, log: Path) -> dict:
    port = _port()
    cmd = [sys.executable, "-P", "-m", "omni_compile.cli", "serve", args.artifact, "--host", "127.0.0.1",
           "--port", str(port), "--max-steps", str(max(100, args.steps)), "--timeout", "3600"]  # fmt: skip
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
            times, first, first_request = [], None, None
            for i in range(args.warmup + args.reps):
                t = time.perf_counter()
                status, resp = _call(port, "/v1/images/generations", body)
                if status != 200:
                    raise RuntimeError(f"request failed with {status}: {resp}")
                dt = time.perf_counter() - t
                if first is None:
                    first, first_request = base64.b64decode(resp["data"][0]["b64_json"]), round(dt, 3)
                if i >= args.warmup:
                    times.append(dt)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    res = {"start_to_health_s": round(ready, 3), "startup_seconds": startup, "exit_code_after_sigterm": code,
           "first_call_s": first_request, "request": _summary(times), "png_bytes": len(first)}  # fmt: skip
    pre = ready - startup.get("load_total", 0) - (startup.get("warmup") or 0)
    res["process_start_and_imports_s"] = round(pre, 3)  # also the artifact check and the last /health poll
    parts = ("transformer_weights", "artifact_load", "other_parts")
    res["rest_of_loading_s"] = round(startup.get("load_total", 0) - sum(startup.get(k, 0) for k in parts), 3)
    return res


def _pipeline(manifest: dict, device: str):
    import torch

    from omni_compile.models import resolve_model
    from omni_compile.models.flux_pipeline import random_pipeline

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[manifest["build"]["dtype"]]
    preset = manifest["model"]["source"].removeprefix("preset:")
    seed = manifest["weights"].get("seed", 0)
    t0 = time.perf_counter()
    spec = resolve_model(preset, model_config=manifest["model"]["config"])
    transformer = spec.load(dtype=dtype, device=device, seed=seed)
    pipe = random_pipeline(preset, transformer, dtype=dtype, device=device, seed=seed)
    pipe.set_progress_bar_config(disable=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return pipe, round(time.perf_counter() - t0, 3)


def _request(pipe, manifest, device, width, height, steps) -> bytes:
    import torch

    with torch.no_grad():  # as the CUDA-graph runtime is tested (not inference mode)
        out = pipe(prompt=[PROMPT], height=height, width=width, num_inference_steps=steps, guidance_scale=3.5,
                   max_sequence_length=int(manifest["build"]["text_len"]),
                   generator=[torch.Generator(device).manual_seed(0)], output_type="pil")  # fmt: skip
    buf = io.BytesIO()
    out.images[0].save(buf, format="PNG")
    return buf.getvalue()


def bench_in_process(args, manifest, width, height, modes) -> dict:
    import torch

    device = manifest["build"]["device"]
    pipe, weights_s = _pipeline(manifest, device)
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
            _request(pipe, manifest, device, width, height, args.steps)
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
    p.add_argument("--artifact", required=True, help="artifact directory of a preset (flux-dev, flux-tiny)")
    p.add_argument("--size", help="WIDTHxHEIGHT (default: the artifact's first bucket)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="server,eager,stock", help="comma-separated: server, eager, stock")
    p.add_argument("--start-limit", type=float, default=600, help="seconds to wait for /health 200")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log", default=None, help="server log file (default: next to --json, or /tmp)")
    args = p.parse_args(argv)

    manifest = json.loads((Path(args.artifact) / "manifest.json").read_text())
    if args.size:
        width, height = (int(v) for v in args.size.lower().split("x"))
    else:
        first = manifest["build"]["buckets"][0].split("@")[0]
        height, width = (int(v) for v in first.split("x"))  # buckets are HEIGHTxWIDTH
    modes = [m for m in args.modes.split(",") if m]
    log = Path(args.log or (Path(args.json).with_suffix(".server.log") if args.json else "/tmp/serve_bench.server.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    result = {"artifact": args.artifact, "model": manifest["model"]["source"], "device": manifest["build"]["device"],
              "dtype": manifest["build"]["dtype"], "size_wxh": f"{width}x{height}", "steps": args.steps,
              "reps": args.reps, "warmup": args.warmup}  # fmt: skip
    if "server" in modes:
        result["server"] = bench_server(args, width, height, log)
        print(f"server: ready in {result['server']['start_to_health_s']:.2f} s, median "
              f"{result['server']['request']['median_s']:.3f} s", file=sys.stderr, flush=True)  # fmt: skip
    local = [m for m in modes if m in ("eager", "stock")]
    if local:
        result.update(bench_in_process(args, manifest, width, height, local))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    _table(result, modes)
    return 0


def _table(r: dict, modes: list[str]) -> None:
    print(f"\nserve bench: {r['model']} {r['dtype']} on {r['device']}, {r['size_wxh']}, {r['steps']} steps, "
          f"{r['reps']} reps after {r['warmup']} warm-up")  # fmt: skip
    if "server" in r:
        s, st = r["server"], r["server"]["startup_seconds"]
        print(f"server start -> /health 200: {s['start_to_health_s']:.2f} s = process start and imports "
              f"{s['process_start_and_imports_s']:.2f} + transformer weights {st.get('transformer_weights', 0):.2f} + "
              f"other parts' weights {st.get('other_parts', 0):.2f} + artifact load {st.get('artifact_load', 0):.2f} "
              f"+ rest of loading {s['rest_of_loading_s']:.2f} + warm-up {st.get('warmup') or 0:.2f}")  # fmt: skip
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
