"""Step caching: speed and quality of each setting against the lossless pipeline, in one command.

    python -P bench/step_cache.py --preset flux-dev --size 1024x1024 --steps 28 --dtype bf16 --device cuda \
        --json results/step_cache.json                                                  # GPU: the W1-sized pipeline
    python -P bench/step_cache.py --json /tmp/step_cache.json                          # CPU smoke: flux-tiny
    ... --fp8                                                  # every setting again with fp8 GEMMs (sm89+ GPUs)

One FLUX pipeline of a preset (seeded random weights: `omni_compile.models.flux_pipeline`), its transformer
compiled by `omni_compile.compile` (JIT, no whole-step CUDA graphs: step caching cannot run under them).
Settings, each on the same prompt and seed (--settings; `off` is the lossless reference and comes first):
`off`, `first_block[:THRESHOLD[:WARMUP]]`, `schedule[:FRACTION[:WARMUP]]`, `taylor[:FRACTION[:WARMUP]]`. With
random weights a threshold's
skip rate says little about a trained model's, so fixed schedules (100/75/50% of the steps after the warm-up)
are measured beside the default threshold.

Per setting: seconds per image (median [min-max] of --reps after a warm-up call; the pipeline as a user calls
it, text encoders and VAE included), the share of transformer calls computed, and against `off`:
- one-step rel L2: the transformer output of the first call that reused the cache, against computing that
  call (its input is the same: every earlier call was computed);
- final-latent rel L2: the latents the scheduler ends with;
- PSNR of the decoded image (8-bit, dB; inf when equal).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

PROMPT = "a red cat sitting on a house"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flux-tiny", help="flux-tiny (CPU) or flux-dev (FLUX.1-dev sized)")
    ap.add_argument("--size", default=None, help="HEIGHTxWIDTH (default 64x64 for flux-tiny, 1024x1024 otherwise)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 8 for flux-tiny, 28 otherwise)")
    ap.add_argument("--dtype", default=None, help="fp32 or bf16 (default fp32 on a CPU, bf16 on a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--settings", default="off,first_block,schedule:1,schedule:0.75,schedule:0.5,taylor:0.5")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="compile with the lossy weight transform fp8 (sm89+ GPUs); "
                    "the reference stays the lossless bf16 pipeline, so every row includes fp8's cost")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import omni_compile
    from omni_compile.config import parse_dtype
    from omni_compile.models import resolve_model
    from omni_compile.models.flux_pipeline import random_pipeline
    from omni_compile.ops.fp8 import has_fp8
    from omni_compile.runtime.step_cache import EVERY_STEP, StepCacheConfig, enable_step_cache

    tiny = args.preset == "flux-tiny"
    height, width = map(int, (args.size or ("64x64" if tiny else "1024x1024")).split("x"))
    steps = args.steps or (8 if tiny else 28)
    dtype = parse_dtype(args.dtype or ("fp32" if args.device == "cpu" else "bf16"))
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if settings[0] != "off":
        settings.insert(0, "off")
    spec = resolve_model(args.preset)
    model = spec.load(dtype=dtype, device=args.device, seed=0)
    pipe = random_pipeline(args.preset, model, dtype=dtype, device=args.device, seed=0)
    pipe.set_progress_bar_config(disable=True)
    omni_compile.compile(model)
    if args.fp8:  # every setting in bf16 first (the lossless reference leads), then again with fp8 GEMMs
        settings = [*settings, *[f"fp8+{s}" for s in settings]]
    decisions: list[bool] = []  # per transformer call: every block ran

    def watched_cache():
        cache = enable_step_cache(pipe, EVERY_STEP)
        record = cache.stats.record
        cache.stats.record = lambda computed: (decisions.append(computed), record(computed))[1]
        return cache

    cache = watched_cache()
    outputs: list[torch.Tensor] = []
    model.register_forward_hook(lambda m, a, kw, out: outputs.append(out[0].detach().float().cpu()), with_kwargs=True)

    def run():
        final = {}

        def keep(p, i, t, kw):
            final["latents"] = kw["latents"].detach().float().cpu()
            return {}

        g = torch.Generator(args.device).manual_seed(args.seed)
        image = pipe(prompt=PROMPT, height=height, width=width, num_inference_steps=steps, generator=g,
                     max_sequence_length=spec.text_len or 512, output_type="np", callback_on_step_end=keep,
                     callback_on_step_end_tensor_inputs=["latents"]).images[0]  # fmt: skip
        return image, final["latents"]

    t0 = time.perf_counter()
    run()  # compiles
    print(f"# first call (compile) {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    results, reference = [], None
    for setting in settings:
        if setting.startswith("fp8+") and not has_fp8(model):
            omni_compile.uncompile(model)  # takes the step cache off too
            omni_compile.compile(model, {"weight_transforms": ["fp8"]})
            cache = watched_cache()
            run()  # compiles the fp8 regions
        name = setting.removeprefix("fp8+")
        config = EVERY_STEP if name == "off" else StepCacheConfig.parse(name)
        cache.set_config(config)
        decisions.clear()
        outputs.clear()
        image, latents = run()
        calls, computed = list(decisions), list(outputs)
        times = []
        for _ in range(args.reps):
            _sync(args.device)
            t = time.perf_counter()
            run()
            _sync(args.device)
            times.append(time.perf_counter() - t)
        label = "off" if name == "off" else config.text()
        row = {"setting": ("fp8+" if setting.startswith("fp8+") else "") + label, "describe": config.describe(),
               "seconds": {"median": statistics.median(times), "min": min(times), "max": max(times)},
               "fraction_computed": sum(calls) / len(calls)}  # fmt: skip
        if reference is None:
            reference = {"image": image, "latents": latents, "outputs": computed}
        else:
            first_skip = next((i for i, c in enumerate(calls) if not c), None)
            row["one_step_rel_l2"] = (None if first_skip is None else
                                      _rel(computed[first_skip], reference["outputs"][first_skip]))  # fmt: skip
            row["latent_rel_l2"] = _rel(latents, reference["latents"])
            row["psnr_db"] = _psnr(image, reference["image"])
        results.append(row)
        print(f"# {row['setting']}: {row['seconds']['median']:.3f} s, computed {row['fraction_computed']:.0%}",
              file=sys.stderr)  # fmt: skip
    base = results[0]["seconds"]["median"]
    print(f"{args.preset} {height}x{width}, {steps} steps, {str(dtype)[6:]}, {args.device}; seconds per image, "
          f"median [min-max] of {args.reps}")  # fmt: skip
    print(f"{'setting':<22} {'s/image':>24} {'speed-up':>9} {'computed':>9} {'1-step L2':>10} {'latent L2':>10} "
          f"{'PSNR dB':>8}")  # fmt: skip
    for r in results:
        s = r["seconds"]
        one = r.get("one_step_rel_l2")
        print(f"{r['setting']:<22} {s['median']:>10.3f} [{s['min']:.3f}-{s['max']:.3f}] {base / s['median']:>8.2f}x "
              f"{r['fraction_computed']:>8.0%} {'-' if one is None else f'{one:.2e}':>10} "
              f"{'-' if 'latent_rel_l2' not in r else format(r['latent_rel_l2'], '.2e'):>10} "
              f"{'-' if 'psnr_db' not in r else format(r['psnr_db'], '.1f'):>8}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "size": f"{height}x{width}", "steps": steps, "dtype": str(dtype)[6:],
                       "device": args.device, "reps": args.reps, "results": results}, f, indent=1)  # fmt: skip
    return 0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _psnr(a, b) -> float:
    import numpy as np

    a8, b8 = (np.clip(np.round(x * 255), 0, 255).astype(np.float64) for x in (a, b))
    mse = float(np.mean((a8 - b8) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


if __name__ == "__main__":
    sys.exit(main())
