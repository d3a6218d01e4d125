"""Diagnose AOTInductor packages of our regions on a GPU, one package at a time (which one fails, and how).

    python -X faulthandler bench/diag_aoti.py compile DIR [--model flux-tiny --shapes 64x64 --dtype bf16]
    python -X faulthandler bench/diag_aoti.py run DIR --loader direct|public

`compile` records each region's calls with one eager forward, writes one package per (region, signature)
into DIR with the example inputs and the eager output beside it. `run` loads each package with the given
loader and runs it on its example, printing (flushed) before each step, so a crash names the package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def compile_all(root: Path, model_name: str, shapes: str, dtype: str, passes: str | None, device: str) -> None:
    from omni_compile.artifact import aot
    from omni_compile.builder import BuildOptions, resolve_build
    from omni_compile.config import CompileConfig
    from omni_compile.graphs import find_regions

    cfg = CompileConfig(passes=[passes]) if passes else CompileConfig()
    opts = BuildOptions(model=model_name, shapes=shapes, dtype=dtype, device=device, out=str(root), compile=cfg)
    spec, dt, device, buckets, pm = resolve_build(opts)
    model = spec.load(dtype=dt, device=device, seed=0)
    regions = find_regions(model, spec.adapter.block_names(model) or None)
    targets = [aot.Target(r.name, "block", list(r.instances)) for r in regions]
    targets += aot.glue_targets(model, {p for r in regions for p in r.paths})
    rec = aot.CallRecorder(targets)
    with rec, torch.no_grad():
        for b in buckets:
            rec.bucket = str(b)
            model(**spec.adapter.example_inputs(model, b, dtype=dt, device=device, text_len=spec.text_len, seed=0))
    root.mkdir(parents=True, exist_ok=True)
    index = []
    for t in targets:
        r = rec.records[t.name]
        for sig, (args, kwargs) in r.examples.items():
            module = dict(t.instances)[r.instances[sig][0]]
            path = root / f"{t.name}-{sig}.pt2"
            t0 = time.perf_counter()
            print(f"compile {t.name} [{aot.describe_key(r.keys[sig])}]", flush=True)
            try:
                cf = aot.compile_package(module, (args, kwargs), path, pm, t.name)
            except Exception as e:
                print(f"  FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
                continue
            with torch.no_grad():
                ref = module(*args, **kwargs)
            torch.save({"state": {k: v for k, v in aot.module_state(module).items()}, "args": args, "kwargs": kwargs,
                        "ref": ref}, root / f"{t.name}-{sig}.inputs")  # fmt: skip
            index.append({"name": t.name, "sig": sig, "file": path.name, "passes": cf.passes,
                          "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
            print(f"  ok in {time.perf_counter() - t0:.1f}s passes {cf.passes}", flush=True)
    (root / "index.json").write_text(json.dumps(index, indent=1))


def _leaves(x):
    from torch.utils import _pytree as pytree

    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)]


def run_all(root: Path, loader: str) -> None:
    import omni_compile  # noqa: F401  (registers our ops)
    from omni_compile.artifact.loader import load_package

    print(f"torch {torch.__version__}; AOTIModelPackageLoader: {torch._C._aoti.AOTIModelPackageLoader.__init__.__doc__}",
          flush=True)  # fmt: skip
    for e in json.loads((root / "index.json").read_text()):
        print(f"load {e['name']} {e['sig']} ({loader})", flush=True)
        runner = load_package(root / e["file"], "cuda" if loader == "direct" else "cpu")
        d = torch.load(root / f"{e['name']}-{e['sig']}.inputs", weights_only=False)
        print("  run", flush=True)
        with torch.no_grad():
            out = runner(d["state"], d["args"], d["kwargs"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        errs = [float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                for a, b in zip(_leaves(out), _leaves(d["ref"]))]  # fmt: skip
        print(f"  ok rel L2 {['%.2e' % x for x in errs]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["compile", "run"])
    ap.add_argument("dir")
    ap.add_argument("--model", default="flux-tiny")
    ap.add_argument("--shapes", default="64x64")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--passes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loader", default="direct", choices=["direct", "public"])
    a = ap.parse_args()
    if a.what == "compile":
        compile_all(Path(a.dir), a.model, a.shapes, a.dtype, a.passes, a.device)
    else:
        run_all(Path(a.dir), a.loader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
