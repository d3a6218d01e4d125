"""Prebuilt artifact vs stock regional torch.compile vs omni-compile JIT, side by side (issue 5).

    python bench/artifact.py --workloads W1,W3 --json results/artifact.json     # the H200 run
    python bench/artifact.py --workloads W4-flux,W4-flux-64                      # CPU smoke run

The workloads must share one model (preset, dtype, device); their shapes are the artifact's buckets.
One command; each mode runs in its own subprocess with its own empty Inductor cache directory, and the
parent prints one table:

  build     `omni-compile build PRESET --shapes B1,B2,... --out ART` (the CLI a user runs): wall time of
            the process, the build's model-load and compile seconds, files and bytes. If the build with
            the default kernels fails, the failure is recorded and the build is retried with
            `--kernels *=native` (the run goes on with that artifact, labelled so).
  artifact  the model is created first (weights in memory, timed apart), then `omni_compile.load(ART,
            weights=model)` and the first step of the first workload: "load -> first step ready"
            (CUDA-graph capture included on a GPU). Then per workload the step latency with CUDA graphs
            on, then, in the same process with the graph wrapper taken off, with CUDA graphs off.
            Dynamo graphs and omni-compile region compiles in this process are counted (must be 0).
  artifact-preload
            as artifact, with the compiled files loading on a background thread (`loader.preload`, as the
            server does) from before the model is created: "load" is what is left after the weights
  stock     eager step latency, then diffusers' `compile_repeated_blocks(fullgraph=True)`: first call
            (compile included) and step latency per workload
  omni      `omni_compile.compile(model)` (JIT, our passes): first call and step latency per workload
  build-dynamic, dynamic
            as build and artifact for `build --dynamic RANGE` (--dynamic; the workloads' sizes must lie in the
            range): one file per region with symbolic sequence lengths, against the static files of `build`
  load-profile
            where "load -> first step ready" goes: the artifact mode's cold load and first step under
            cProfile (slower than without it), each compiled file's load seconds, and the functions that took
            the most time (cumulative and own), each with its heaviest callers; no step timing

Step latency: median/min/max over --steps calls after --warmup (CUDA events on a GPU). Every output is
compared (relative L2) with the eager output of the same weights and inputs in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import WORKLOADS as E2E_WORKLOADS
from e2e import _rel_l2, measure, summary

WORKLOADS = dict(E2E_WORKLOADS, **{"W4-flux-64": ("flux-tiny", "64x64", "fp32", "cpu")})
MODES = ("build", "artifact", "artifact-preload", "stock", "omni", "build-dynamic", "dynamic", "load-profile")


def _setup(workloads: list[str], seed: int):
    import torch

    from omni_compile.config import ShapeBucket, parse_dtype
    from omni_compile.models import resolve_model

    preset, _, dtype_s, device = WORKLOADS[workloads[0]]
    dtype = parse_dtype(dtype_s)
    spec = resolve_model(preset)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    model = spec.load(dtype=dtype, device=device, seed=seed)
    sync()
    init_s = time.perf_counter() - t0
    inputs = {}
    for w in workloads:
        bucket = ShapeBucket.parse(WORKLOADS[w][1])
        inputs[w] = spec.adapter.example_inputs(model, bucket, dtype=dtype, device=device, text_len=spec.text_len,
                                                seed=seed)  # fmt: skip
    return model, inputs, device, sync, init_s


def _timed_first(fn, sync) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def run_child(mode: str, workloads: list[str], art: Path, steps: int, warmup: int, seed: int) -> dict:
    import torch

    import omni_compile
    from omni_compile.artifact.parity import bucket_output
    from omni_compile.artifact.loader import _compilations

    preloaded = checked = None
    if mode == "artifact-preload":  # the compiled files load on a background thread while the model is made
        from omni_compile.artifact.loader import check, preload

        checked = check(art)
        preloaded = preload(art, checked)
    model, inputs, device, sync, init_s = _setup(workloads, seed)

    def stepper(w):
        def step():
            with torch.no_grad():
                return bucket_output(model(**inputs[w]))

        return step

    res: dict = {"mode": mode, "init_s": round(init_s, 2), "device": device, "torch": torch.__version__,
                 "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu", "per_workload": {}}  # fmt: skip
    outs = {}

    def run(label, w):
        out, first = _timed_first(stepper(w), sync)
        outs[(label, w)] = out.clone()
        times = measure(stepper(w), device, steps, warmup)
        res["per_workload"].setdefault(w, {})[label] = {"first_call_s": round(first, 3), "step_ms": summary(times)}

    def eager_refs():
        return {w: stepper(w)().clone() for w in workloads}

    if mode == "stock":
        refs = eager_refs()
        for w in workloads:
            run("eager", w)
        model.compile_repeated_blocks(fullgraph=True)
        for w in workloads:
            run("stock", w)
    elif mode == "omni":
        refs = eager_refs()
        omni_compile.compile(model)
        for w in workloads:
            run("omni", w)
        state = omni_compile.compile_state(model)
        res["attention"] = {r.region: r.attention for r in state.records}
    elif mode in ("artifact", "dynamic", "artifact-preload"):
        # Nothing has run on the device yet but the model's creation: the load and first step are cold,
        # as in a server that has just read its weights. The eager references come last.
        before = _compilations()
        t0 = time.perf_counter()
        loaded = omni_compile.load(art, weights=model, device=device, checked=checked, preloaded=preloaded)
        sync()
        res["load_s"] = round(time.perf_counter() - t0, 3)
        _, first = _timed_first(stepper(workloads[0]), sync)
        res["first_step_s"] = round(first, 3)
        res["ready_s"] = round(res["load_s"] + first, 3)
        installed = loaded._omni_artifact
        graphs = installed.cuda_graphs
        timed = workloads if mode != "artifact-preload" else []  # the preload's steps are the artifact mode's
        for w in timed:
            run(f"{mode}+graphs" if graphs is not None else mode, w)
        if graphs is not None:
            res["cuda_graphs"] = dict(graphs.stats, graphs=graphs.graphs)
        if graphs is not None and timed:
            loaded.__dict__.pop("forward")  # the same packages, called from Python each step
            for w in workloads:
                run(f"{mode}-nographs", w)
        res["compilations"] = _compilations() - before
        res["compiled_calls"] = installed.stats.get("compiled_calls", 0)
        res["packages"] = installed.stats["packages"]
        res["load_breakdown_s"] = dict(installed.seconds)
        installed.uninstall()
        refs = eager_refs()
    elif mode == "load-profile":
        res.update(_profile_load(art, model, device, stepper(workloads[0]), sync))
    else:
        raise ValueError(mode)
    for (label, w), out in outs.items():
        res["per_workload"][w][label]["rel_l2_vs_eager"] = _rel_l2(out, refs[w])
    if device == "cuda":
        res["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return res


def _top(prof, key: str, n: int = 25) -> list[dict]:
    """The `n` functions with the most `key` time, each with `via`: its heaviest callers, nearest first."""
    import pstats

    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def name(func) -> str:
        file, line, fn = func
        return f"{Path(file).name}:{line}({fn})"

    def via(func, depth: int = 10) -> list[str]:
        chain, seen = [], {func}
        while len(chain) < depth:
            callers = stats.get(func, (0, 0, 0, 0, {}))[4]
            # the caller that spent the most cumulative time in this function (pstats: (cc, nc, tt, ct) per caller)
            func = max(callers, key=lambda c: callers[c][3], default=None)
            if func is None or func in seen:
                break
            seen.add(func)
            chain.append(name(func))
        return chain

    rows = []
    for func, (_, ncalls, tottime, cumtime, _) in stats.items():
        rows.append({"function": name(func), "calls": ncalls, "own_s": round(tottime, 4),
                     "cumulative_s": round(cumtime, 4), "_func": func})  # fmt: skip
    top = sorted(rows, key=lambda r: -r[key])[:n]
    for r in top:
        r["via"] = via(r.pop("_func"))
    return top


def _profile_load(art: Path, model, device: str, step, sync) -> dict:
    """The cold load and first step under cProfile, with each compiled file's load time."""
    import cProfile

    import omni_compile
    from omni_compile.artifact import loader

    files: list[dict] = []
    original = loader.load_package

    def timed(path, *a, **k):
        t = time.perf_counter()
        try:
            return original(path, *a, **k)
        finally:
            files.append({"file": "/".join(Path(path).parts[-2:]), "s": round(time.perf_counter() - t, 4)})

    loader.load_package = timed
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    loaded = omni_compile.load(art, weights=model, device=device)
    sync()
    prof.disable()
    load_s = time.perf_counter() - t0
    loader.load_package = original
    first_prof = cProfile.Profile()
    t1 = time.perf_counter()
    first_prof.enable()
    step()
    sync()
    first_prof.disable()
    first_s = time.perf_counter() - t1
    loaded._omni_artifact.uninstall()
    return {"profiled_load_s": round(load_s, 3), "profiled_first_step_s": round(first_s, 3), "files": files,
            "load_top_cumulative": _top(prof, "cumulative_s"), "load_top_own": _top(prof, "own_s", 15),
            "first_step_top_cumulative": _top(first_prof, "cumulative_s"), "first_step_top_own": _top(first_prof, "own_s", 15)}  # fmt: skip


def build(workloads: list[str], art: Path, env: dict, timeout: int, dynamic: str | None = None) -> dict:
    preset, _, dtype_s, device = WORKLOADS[workloads[0]]
    shapes = ",".join(WORKLOADS[w][1] for w in workloads)
    base = [sys.executable, "-P", "-m", "omni_compile.cli", "build", preset, "--shapes", shapes, "--dtype", dtype_s,
            "--device", device, "--out", str(art), "--force"] + (["--dynamic", dynamic] if dynamic else [])  # fmt: skip
    attempts = []
    for extra in ([], ["--kernels", "*=native"]):
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(base + extra, env=env, capture_output=True, text=True, timeout=timeout)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        wall = round(time.perf_counter() - t0, 1)
        attempt = {"args": " ".join(base[3:] + extra), "rc": rc, "process_s": wall}
        attempts.append(attempt)
        print(f"# build {' '.join(extra) or '(default kernels)'}: rc={rc} in {wall}s", file=sys.stderr, flush=True)
        if rc == 0:
            m = json.loads((art / "manifest.json").read_text())
            files = [e for r in m["regions"] for es in r["buckets"].values() for e in es]
            unique = {e["file"]: e for e in files}
            attempt.update(
                timing=m["timing"],
                files=len(unique),
                bytes=sum((art / f).stat().st_size for f in unique),
                parity=m["parity"],
                fused_op_implementations=m["fusion"]["fused_op_implementations"],
                attention=m["attention"]["per_role"],
                compile_seconds={f"{r['name']}@{b}": [e["compile_seconds"] for e in es]
                                 for r in m["regions"] for b, es in r["buckets"].items()},  # fmt: skip
            )
            break
        attempt["stderr_tail"] = err[-4000:]
        print(err[-4000:], file=sys.stderr)
    return {"mode": "build-dynamic" if dynamic else "build", "attempts": attempts, "ok": attempts[-1]["rc"] == 0, "kernels": "default"
            if len(attempts) == 1 else "*=native"}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W4-flux,W4-flux-64", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--art", help="artifact directory (default: a temporary one); kept after the run")
    ap.add_argument("--dynamic", metavar="LOW-HIGH[:STEP]", default="768-1280:64",
                    help="the range of the build-dynamic and dynamic modes (default 768-1280:64)")
    ap.add_argument("--build-timeout", type=int, default=1800, help="seconds per build attempt")
    ap.add_argument("--json", help="write all results here (after every mode)")
    ap.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    if len({(WORKLOADS[w][0], WORKLOADS[w][2], WORKLOADS[w][3]) for w in workloads}) != 1:
        ap.error("the workloads must share one model, dtype and device (they become one artifact's buckets)")
    work = Path(tempfile.mkdtemp(prefix="omni-artifact-bench-"))
    art = Path(args.art) if args.art else work / "art"

    art_dynamic = art.with_name(art.name + "-dynamic")
    if args.child:
        res = run_child(args.child, workloads, art_dynamic if args.child == "dynamic" else art, args.steps,
                        args.warmup, args.seed)  # fmt: skip
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    results = []
    for i, mode in enumerate(args.modes.split(",")):
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{i}-{mode}"), PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        if mode == "build":
            res = build(workloads, art, env, args.build_timeout)
        elif mode == "build-dynamic":
            res = build(workloads, art_dynamic, env, args.build_timeout, args.dynamic)
        else:
            cmd = [sys.executable, __file__, "--workloads", args.workloads, "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--seed", str(args.seed), "--art", str(art), "--child", mode]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if proc.returncode == 0 and lines else {"mode": mode, "error": proc.stderr[-4000:]}
        res["process_s"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        print(f"# {mode}: done in {res['process_s']}s" + (" (ERROR)" if "error" in res else ""), file=sys.stderr,
              flush=True)  # fmt: skip
        if "error" in res:
            print(res["error"], file=sys.stderr)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"workloads": workloads, "results": results}, indent=2) + "\n")
    print_table(workloads, results)
    return 1 if any("error" in r or r.get("ok") is False for r in results) else 0


def print_table(workloads: list[str], results: list[dict]) -> None:
    rows = {}
    for r in results:
        for w, labels in r.get("per_workload", {}).items():
            for label, v in labels.items():
                rows.setdefault(w, {})[label] = v
    print(f"{'workload':<11} {'mode':<18} {'step ms median [min-max]':<28} {'vs stock':>8} {'first call s':>12} "
          f"{'rel L2 vs eager':>15}")  # fmt: skip
    for w in workloads:
        stock = rows.get(w, {}).get("stock", {}).get("step_ms", {}).get("median")
        for label in ("eager", "stock", "omni", "artifact+graphs", "artifact", "artifact-nographs", "dynamic+graphs",
                      "dynamic", "dynamic-nographs"):  # fmt: skip
            v = rows.get(w, {}).get(label)
            if v is None:
                continue
            s = v["step_ms"]
            ratio = f"{stock / s['median']:.3f}x" if stock else "-"
            span = f"{s['median']:9.2f} [{s['min']:.2f}-{s['max']:.2f}]"
            print(f"{w:<11} {label:<18} {span:<28} {ratio:>8} {v['first_call_s']:>12.2f} {v['rel_l2_vs_eager']:>15.2e}")
    for r in results:
        if r["mode"] in ("build", "build-dynamic"):
            last = r["attempts"][-1]
            extra = f", {last['files']} files, {last['bytes'] / 2**20:.1f} MiB, timing {last['timing']}" if r["ok"] else ""
            print(f"{r['mode']}: {'ok' if r['ok'] else 'FAILED'} (kernels {r['kernels']}) in {last['process_s']}s{extra}")
        elif r["mode"] in ("artifact", "dynamic", "artifact-preload") and "load_s" in r:
            print(f"{r['mode']}: model created in {r['init_s']}s (apart); load {r['load_s']}s + first step "
                  f"{r['first_step_s']}s = ready {r['ready_s']}s (load: {r.get('load_breakdown_s')}); compilations {r['compilations']}; "
                  f"packages {r['packages']}; cuda graphs {r.get('cuda_graphs', 'off')}")  # fmt: skip
        elif r["mode"] == "load-profile" and "profiled_load_s" in r:
            print(f"load-profile (under cProfile): load {r['profiled_load_s']}s, first step {r['profiled_first_step_s']}s; "
                  "files " + ", ".join(f"{f['file']} {f['s']}s" for f in r["files"]))  # fmt: skip
            for part in ("load", "first_step"):
                print(f"  {part}, most cumulative time: " + "; ".join(
                    f"{t['function']} {t['cumulative_s']}s" for t in r[f"{part}_top_cumulative"][:12]))  # fmt: skip
                print(f"  {part}, most own time: " + "; ".join(
                    f"{t['function']} {t['own_s']}s x{t['calls']}" for t in r[f"{part}_top_own"][:8]))  # fmt: skip
                for t in r[f"{part}_top_own"][:3]:
                    print(f"    {t['function']} <- " + " <- ".join(t["via"]))
        elif "error" in r:
            print(f"{r['mode']}: ERROR (see stderr / the JSON)")


if __name__ == "__main__":
    sys.exit(main())
