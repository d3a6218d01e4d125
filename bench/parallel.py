"""Scaling of one step over ranks: `omni-compile run` in one process and under torchrun with Ulysses-N, side by
side, in one command (docs/parallel.md).

    python bench/parallel.py --model wan-1.3b --shapes 480x832x81 --ranks 1,2,4 --json wan.json    # W2, 4 GPUs
    python bench/parallel.py --model flux-tiny --shapes 64x64 --ranks 1,2 --model-config '{"num_attention_heads": 4,
        "attention_head_dim": 8, "axes_dims_rope": [2, 2, 4]}'                                      # CPU smoke

Each world size runs in fresh processes (`torchrun --standalone --nproc-per-node N -m omni_compile run ...
--parallel ulysses=N`; 1: the same command without torchrun), with the same seeded weights and inputs, the
eager step as reference on every rank, --warmup steps, then --steps timed steps (a step's time is its slowest
rank's). The table: step median [min-max], speed-up over one process, first call (compile included), compiles
per rank, worst relative L2 against eager.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_world(args, n: int, out: Path) -> dict:
    cmd = ["-m", "omni_compile", "run", args.model, "--shapes", args.shapes, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--json", str(out)]  # fmt: skip
    for flag in ("dtype", "device", "model_config"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    if n > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *cmd, "--parallel", f"ulysses={n}"]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0:
        return {"ranks": n, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"ranks": n, **json.loads(out.read_text())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan-1.3b")
    p.add_argument("--shapes", default="480x832x81")
    p.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--dtype")
    p.add_argument("--device")
    p.add_argument("--model-config")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(r) for r in args.ranks.split(",")):
            rows.append(run_world(args, n, Path(tmp) / f"run{n}.json"))
            print(f"ranks {n}: {rows[-1].get('error') or rows[-1]['step_ms']}", file=sys.stderr, flush=True)
    base = next((r["step_ms"]["median"] for r in rows if r["ranks"] == 1 and "step_ms" in r), None)
    print(f"{args.model} {args.shapes}, {args.steps} steps after {args.warmup} warm-up, Ulysses over N ranks")
    print(f"{'ranks':>5}  {'step ms (median [min-max])':<28} {'vs 1':>6} {'first call s':>12} {'compiles/rank':>14} "
          f"{'rel L2 vs eager':>16}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['ranks']:>5}  ERROR {r['error']}")
            continue
        st, rel = r["step_ms"], max((x for x in r["rel_l2_vs_eager"] if x is not None), default=None)
        speed = f"{base / st['median']:.2f}x" if base else "-"
        print(f"{r['ranks']:>5}  {st['median']:>8.2f} [{st['min']:.2f}-{st['max']:.2f}]{'':<6} {speed:>6} "
              f"{r['first_call_s']:>12.2f} {r['compiles_per_rank']!s:>14} {rel if rel is None else f'{rel:.2e}':>16}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
