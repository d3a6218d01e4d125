"""`omni-compile run`: compile a model just in time and time its step, in one process or on N ranks together.

    omni-compile run flux-tiny --shapes 64x64                                   # one process
    torchrun --nproc-per-node 4 -m omni_compile run wan-1.3b --shapes 480x832x81 --parallel ulysses=4

Every rank loads the same seeded weights and inputs, checks the compiled step against the eager model (the
whole sequence, in the rank's own process, before anything is split), compiles its regions for its share of
the tokens, and times the step; rank 0 prints one summary (and writes --json) with every rank's compile count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="preset name, local diffusers directory, or module:Class (default: flux-tiny)")  # fmt: skip
    p.add_argument("--shapes", help="the bucket HxW[xFRAMES][@BATCH] to run (default: the preset's first)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default: the preset's)")
    p.add_argument("--device", help="cuda or cpu (default: the preset's, else cuda when available); under torchrun "
                                    "each rank takes the GPU of its LOCAL_RANK")  # fmt: skip
    p.add_argument("--text-len", type=int, default=None, help="text tokens per prompt (default: the preset's)")
    p.add_argument("--model-config", help="JSON (inline or a file) of model config keys over the preset's")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")
    p.add_argument("--parallel", default=None, metavar="ulysses=N",
                   help="run each step on N ranks started together (torchrun --nproc-per-node N), each on 1/N of "
                        "the tokens (docs/parallel.md)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call (default 2)")
    p.add_argument("--no-check", action="store_true", help="skip the eager reference step and the parity check")
    p.add_argument("--json", default=None, help="write the summary here as JSON (rank 0)")


def run(args, console) -> int:
    import torch

    from omni_compile.build.session import BuildOptions, BuildSession, sync
    from omni_compile.config import ShapeBucket, json_arg
    from omni_compile.errors import ConfigError
    from omni_compile.parallel import ParallelConfig, init_parallel

    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps must be at least 1 and --warmup at least 0 (got {args.steps}, {args.warmup})")
    parallel = ParallelConfig.parse(args.parallel)
    session = BuildSession.resolve(BuildOptions(model=args.model, shapes=args.shapes, dtype=args.dtype,
                                                device=args.device, seed=args.seed, text_len=args.text_len,
                                                model_config=json_arg(args.model_config, "--model-config")))  # fmt: skip
    device_type = torch.device(session.device).type
    state = init_parallel(parallel, device_type) if parallel is not None and parallel.ulysses > 1 else None
    rank = state.rank if state is not None else 0
    say = console.print if rank == 0 else (lambda *a, **k: None)
    bucket: ShapeBucket = session.buckets[0]
    model = session.load_model()
    inputs = session.example_inputs(model, bucket, seed=args.seed + 1)

    import omni_compile

    def step():
        with torch.no_grad():
            out = model(**inputs)
        return out[0] if isinstance(out, (tuple, list)) else out.sample

    reference = None if args.no_check else step().double()
    say(f"run: {session.spec.source} {bucket} {str(session.dtype).removeprefix('torch.')} on {session.device}"
        + (f", parallel {parallel} ({state.world_size} ranks)" if state is not None else ""))  # fmt: skip
    omni_compile.compile(model, parallel=parallel)
    sync(session.device)
    t0 = time.perf_counter()
    out = step()
    sync(session.device)
    first = time.perf_counter() - t0
    rel = None if reference is None else float((out.double() - reference).norm() / reference.norm())
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if state is not None:
            torch.distributed.barrier(group=state.sp_group)  # every rank starts the step together
        sync(session.device)
        t = time.perf_counter()
        step()
        sync(session.device)
        times.append((time.perf_counter() - t) * 1e3)
    records = omni_compile.compile_state(model).records
    from omni_compile.counters import counters

    mine = {"rank": rank, "compiles": len(records), "ulysses_exchanges": counters.ulysses_exchanges, "rel_l2_vs_eager": rel, "first_call_s": round(first, 3),
            "step_ms": times, "attention": {k: v for r in records for k, v in r.attention.items()}}  # fmt: skip
    ranks = [mine]
    if state is not None:
        ranks = [None] * state.world_size
        torch.distributed.all_gather_object(ranks, mine)
    if rank != 0:
        return 0
    all_times = [max(r["step_ms"][i] for r in ranks) for i in range(args.steps)]  # a step ends when every rank's does
    summary = {
        "model": session.spec.source, "bucket": str(bucket), "dtype": str(session.dtype).removeprefix("torch."),
        "device": session.device, "parallel": str(parallel) if state is not None else None,
        "world_size": state.world_size if state is not None else 1,
        "step_ms": {"median": round(statistics.median(all_times), 3), "min": round(min(all_times), 3),
                    "max": round(max(all_times), 3), "steps": args.steps},
        "first_call_s": max(r["first_call_s"] for r in ranks),
        "compiles_per_rank": [r["compiles"] for r in ranks],
        "ulysses_exchanges_per_rank": [r["ulysses_exchanges"] for r in ranks],  # attention calls x steps run
        "rel_l2_vs_eager": [r["rel_l2_vs_eager"] for r in ranks],
        "attention": ranks[0]["attention"],
    }  # fmt: skip
    st = summary["step_ms"]
    check = "" if rel is None else f"; rel L2 vs eager {max(summary['rel_l2_vs_eager']):.2e}"
    say(f"step {st['median']:.2f} ms [{st['min']:.2f}-{st['max']:.2f}] over {args.steps} steps"
        f"{' x ' + str(summary['world_size']) + ' ranks' if state is not None else ''}; first call "
        f"{summary['first_call_s']:.2f} s; compiles per rank {summary['compiles_per_rank']}{check}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0
