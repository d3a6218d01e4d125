"""Where a server's start-up goes before it loads anything: Python and each import, in fresh processes (issue 22).

    python -P bench/imports.py                                  # this machine, 3 fresh processes per line
    python -P bench/imports.py --pycache-prefix /tmp/pyc        # with a writable bytecode cache elsewhere

Each line imports one more thing than the line before (`python -P -c "import ..."`), so the differences are
what each import adds once the ones above it are loaded. The bytecode cache is reported too: a package whose
folder has no compiled `.pyc` files and cannot be written to is compiled from source by every process (an
installation made with `pip --no-compile` into a read-only place, say), which PYTHONPYCACHEPREFIX or
`python -m compileall` fixes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = [  # (label, the package it needs, statement)
    ("python", None, ""),
    ("torch", "torch", "import torch"),
    ("torch._dynamo", "torch", "import torch._dynamo"),
    ("torch._inductor.compile_fx", "torch", "import torch._inductor.compile_fx"),
    ("diffusers pipelines", "diffusers", "from diffusers import FluxPipeline, WanPipeline"),
    ("fastapi, uvicorn", "fastapi", "import fastapi, uvicorn"),
    (
        "omni_compile server",
        "omni_compile",
        "import omni_compile.server.app, omni_compile.server.pipeline, omni_compile.artifact.loader",
    ),
]
PACKAGES = ("torch", "diffusers", "transformers", "triton", "fastapi", "omni_compile")


def bytecode_cache(name: str) -> dict:
    """Whether `name`'s folder holds compiled bytecode for this Python and whether it can be written."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return {"package": name, "found": False}
    folder = Path(next(iter(spec.submodule_search_locations)))
    tag = sys.implementation.cache_tag
    cache = folder / "__pycache__"
    return {"package": name, "folder": str(folder), "pyc": any(cache.glob(f"*.{tag}.pyc")) if cache.is_dir() else False,
            "writable": os.access(cache if cache.is_dir() else folder, os.W_OK)}  # fmt: skip


def timed(code: str, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-P", "-c", code or "pass"], env=env, capture_output=True, text=True,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{code!r} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per line (default 3)")
    ap.add_argument("--pycache-prefix", help="run with PYTHONPYCACHEPREFIX=DIR (a bytecode cache outside the packages)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.pycache_prefix:
        env["PYTHONPYCACHEPREFIX"] = args.pycache_prefix
    caches = [bytecode_cache(p) for p in PACKAGES]
    rows, code = [], []
    for label, package, stmt in STEPS:
        if package and importlib.util.find_spec(package) is None:
            print(f"{label}: not installed here, skipped", file=sys.stderr)
            continue
        if stmt:
            code.append(stmt)
        times = [timed("; ".join(code), env) for _ in range(args.reps)]
        rows.append({"imports": label, "median_s": round(statistics.median(times), 3),
                     "min_s": round(min(times), 3), "max_s": round(max(times), 3)})  # fmt: skip
        print(f"# {label}: {rows[-1]['median_s']} s", file=sys.stderr, flush=True)
    result = {"python": sys.version.split()[0], "pycache_prefix": args.pycache_prefix,
              "dont_write_bytecode": bool(sys.flags.dont_write_bytecode or env.get("PYTHONDONTWRITEBYTECODE")),
              "bytecode": caches, "cumulative": rows}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"fresh process, cumulative imports (median of {args.reps}; PYTHONPYCACHEPREFIX={args.pycache_prefix or '-'}, "
          f"don't write bytecode: {result['dont_write_bytecode']})")  # fmt: skip
    prev = 0.0
    for r in rows:
        print(
            f"  {r['imports']:<28} {r['median_s']:7.3f} s [{r['min_s']:.3f}-{r['max_s']:.3f}]  +{r['median_s'] - prev:.3f}"
        )
        prev = r["median_s"]
    for c in caches:
        if c.get("found", True):
            print(f"  {c['package']:<14} bytecode cached: {c['pyc']}, writable: {c['writable']}  ({c['folder']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
