"""Stock regional compile vs omni-compile on two copies of one model, timed alternately in one
process, so machine noise hits both alike (useful on small shapes and noisy CPUs).

    python bench/ab.py --workload W4-flux --reps 30
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import omni_compile
from omni_compile.config import ShapeBucket, parse_dtype
from omni_compile.models import resolve_model

from e2e import WORKLOADS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W4-flux", choices=list(WORKLOADS))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    preset, shape, dtype_s, device = WORKLOADS[args.workload]
    spec = resolve_model(preset)
    dtype = parse_dtype(dtype_s)
    stock = spec.load(dtype=dtype, device=device, seed=0)
    omni = copy.deepcopy(stock)
    inputs = spec.adapter.example_inputs(
        stock, ShapeBucket.parse(shape), dtype=dtype, device=device, text_len=spec.text_len, seed=0
    )
    stock.compile_repeated_blocks(fullgraph=True)
    omni_compile.compile(omni)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"stock": [], "omni": []}
    with torch.no_grad():
        for model in (stock, omni):  # compile and warm up
            for _ in range(3):
                model(**inputs)
        for _ in range(args.reps):
            for name, model in (("stock", stock), ("omni", omni)):
                sync()
                t0 = time.perf_counter()
                model(**inputs)
                sync()
                times[name].append(1e3 * (time.perf_counter() - t0))
    for name, v in times.items():
        print(
            f"{args.workload} {name:<6} step ms median {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] "
            f"n={len(v)}"
        )
    print(
        f"omni/stock speed ratio of medians: {statistics.median(times['stock']) / statistics.median(times['omni']):.3f}"
    )


if __name__ == "__main__":
    main()
