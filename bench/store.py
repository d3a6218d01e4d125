"""Second-node build time with a shared store vs a cold build, side by side (issue 6).

    python bench/store.py --model flux-tiny --shapes 64x64 --store file:///tmp/omni-store [--repeat 3]
    python bench/store.py --model flux-dev --shapes 1024x1024 --dtype bf16 --device cuda \
        --store file:///tmp/s --modes first,second --keep DIR      # W1 on a GPU: two builds, artifacts kept

Per repetition, each a fresh CLI process with its own empty Inductor cache and output directory:
`cold` (no store), `first` (empty store: compiles and publishes), `second` (the store is full: a second
node). Reports the process wall time, the build's own wall time and model-load time from the manifest,
"build work besides reading weights" (build wall - model load), the AOT compiles and the store summary;
then median [min-max] per mode. The store is emptied (its entries deleted) before each `first`.
`--modes` picks modes (default cold,first,second); `--keep DIR` writes the builds' artifacts under DIR
(DIR/MODE-REPETITION) and keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args, mode: str, work: Path, i: int) -> dict:
    out = work / f"{mode}-{i}"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor-{mode}-{i}"), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-P", "-m", "omni_compile.cli", "build", args.model, "--shapes", args.shapes, "--out",
           str(out), "-q"] + (["--dtype", args.dtype] if args.dtype else []) + (["--device", args.device] if args.device
           else []) + ([] if mode == "cold" else ["--store", args.store])  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"mode": mode, "error": proc.stderr[-3000:]}
    m = json.loads((out / "manifest.json").read_text())
    t = m["timing"]
    return {"mode": mode, "process_s": round(wall, 2), "build_wall_s": t["wall_seconds"],
            "model_load_s": t["model_load_seconds"], "work_s": round(t["wall_seconds"] - t["model_load_seconds"], 2),
            "compilations": m["compilations"], "store": m.get("store")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flux-tiny")
    ap.add_argument("--shapes", default="64x64")
    ap.add_argument("--dtype")
    ap.add_argument("--device")
    ap.add_argument("--store", required=True)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--modes", default="cold,first,second")
    ap.add_argument("--keep", metavar="DIR", help="write the artifacts under DIR and keep them")
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"cold", "first", "second"}:
        ap.error("--modes: a comma list of cold, first, second")
    from omni_compile.cache import open_store

    store = open_store(args.store)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="omni-store-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(args.repeat):
        for mode in modes:
            if mode == "first":
                for e in store.list():
                    store.delete(e.key)
            r = run(args, mode, work, i)
            results.append(r)
            print(f"# {mode} {i}: " + (f"{r['process_s']}s" if "error" not in r else "ERROR\n" + r["error"]),
                  file=sys.stderr, flush=True)  # fmt: skip
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'mode':<8} {'process s':>22} {'build work s (besides weights)':>32} {'AOT compiles':>13} {'store hits':>10}")
    for mode in modes:
        rows = [r for r in results if r["mode"] == mode and "error" not in r]
        if not rows:
            print(f"{mode:<8} ERROR")
            continue

        def fmt(v):
            return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

        hits = rows[0]["store"]["hits"] if rows[0]["store"] else "-"
        print(f"{mode:<8} {fmt([r['process_s'] for r in rows]):>22} {fmt([r['work_s'] for r in rows]):>32} "
              f"{rows[0]['compilations']['aot_compiles']:>13} {hits:>10}")  # fmt: skip
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
