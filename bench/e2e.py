"""End-to-end benchmark: eager vs stock regional torch.compile vs omni-compile, side by side.

    python bench/e2e.py --workloads W1,W2 --json results/e2e.json

Each (workload, mode) runs in a fresh subprocess with its own empty Inductor cache directory, so
cold compile times are really cold and no mode warms another's caches; the parent collects the
results and prints one table. Modes:

  eager       the diffusers model as is
  stock       diffusers' `compile_repeated_blocks(fullgraph=True)` (stock Inductor, regional; a model that
              declares no `_repeated_blocks`, such as CogView4, gets its block class named first); saves
              Inductor's cache bundle (Mega-Cache)
  stock-warm  a new process that loads stock's cache bundle first, then compiles
  stock-fa3   stock, with diffusers' attention backend `_flash_3` run by the fa3-fwd wheel (what a user
              assembles in two lines today; see `diffusers_fa3_from_fa3_fwd`)
  stock-fp8   stock, after torchao's float8 quantization (dynamic per-row activations, per-channel weights:
              `Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`) of the Linears omni's fp8
              transform takes (lossy; compare with omni/fp8)
  omni        `omni_compile.compile(model)` (regional, our passes); saves Inductor's cache bundle
  omni-warm   a new process that loads omni's cache bundle first, then compiles (warm start)

omni modes take items after '/': pass switches (`omni/-adaln`), kernel choices (`omni/*=triton`), the
default attention backend (`omni/attn=FA3_ATTN`), pass options (`omni/lower_fused_ops.pair=false`: PASS.OPTION=JSON
value), `measure=false` (auto takes the first capable backend
instead of the fastest measured one), `cg` (whole-step CUDA graphs: `compile(..., cuda_graphs=True)`) and
`fuse` (the load-time weight transform `fuse_projections`: q/k/v projections as one GEMM) and `fp8` (the
lossy weight transform `fp8`: the blocks' Linears as fp8 GEMMs, docs/fast-mode.md).

Per mode: first call (cold compile included), step latency (CUDA events on GPU, perf_counter on
CPU; median/min/max over --steps after --warmup), peak memory, and the relative L2 error of the
output against the eager output of the same weights and inputs (computed in the same process).
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

ROOT = Path(__file__).resolve().parents[1]
# W5: real-size transformers of families omni-compile has no adapter for (generic adapter, module:Class with the
# published config, random weights); their example inputs come from the functions the tests use for the tiny ones.
LTX_2B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
              attention_head_dim=64, cross_attention_dim=2048, num_layers=28, caption_channels=4096,
              qk_norm="rms_norm_across_heads", norm_eps=1e-6)  # LTX-Video 0.9 (2B)  # fmt: skip
HUNYUAN_VIDEO_13B = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                         num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                         qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                         rope_theta=256.0, rope_axes_dim=(16, 56, 56))  # HunyuanVideo (13B)  # fmt: skip
COGVIEW4_6B = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=28, attention_head_dim=128,
                   num_attention_heads=32, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                   pos_embed_max_size=128, sample_size=128, rope_axes_dim=(256, 256))  # CogView4 (6B)  # fmt: skip
# (Random weights are made in fp32 on the device, then cast: a 20B model such as Qwen-Image needs 80 GB for that.)
WORKLOADS = {
    # id: (preset or module:Class, shape, dtype, device[, {"config", "inputs", "text_len"}])
    "W1": ("flux-dev", "1024x1024", "bf16", "cuda"),
    "W2": ("wan-1.3b", "480x832x81", "bf16", "cuda"),
    "W3": ("flux-dev", "512x512", "bf16", "cuda"),
    "W4-flux": ("flux-tiny", "128x128", "fp32", "cpu"),
    "W4-wan": ("wan-tiny", "64x96x9", "fp32", "cpu"),
    # LTX-Video 768x512, 121 frames: 16 x 16 x 24 = 6,144 video tokens, 128 text tokens
    "W5-ltx": ("diffusers:LTXVideoTransformer3DModel", "512x768x121", "bf16", "cuda",
               {"config": LTX_2B, "inputs": "generic_model:ltx_inputs", "text_len": 128}),
    # HunyuanVideo 848x480, 33 frames: 9 x 30 x 53 = 14,310 video tokens, 256 text tokens (masked)
    "W5-hunyuan": ("diffusers:HunyuanVideoTransformer3DModel", "480x848x33", "bf16", "cuda",
                   {"config": HUNYUAN_VIDEO_13B, "inputs": "dit_zoo:hunyuan_video_inputs", "text_len": 256}),
    # CogView4 1024²: 64 x 64 = 4,096 image tokens after 224 text tokens, no mask (stock-fa3 runs); LayerNorm QK-norm
    "W5-cogview4": ("diffusers:CogView4Transformer2DModel", "1024x1024", "bf16", "cuda",
                    {"config": COGVIEW4_6B, "inputs": "dit_zoo:cogview4_inputs", "text_len": 224}),
    # the tiny configs of the same classes, to try the workloads on a CPU
    "W5-ltx-tiny": ("diffusers:LTXVideoTransformer3DModel", "64x64x9", "fp32", "cpu",
                    {"config": {}, "inputs": "generic_model:ltx_inputs", "tiny": "ltx-video"}),
}
MODES = ("eager", "stock", "stock-fa3", "omni", "omni/cg")


def _rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def diffusers_fa3_from_fa3_fwd() -> None:
    """Make diffusers' `_flash_3` attention backend run the fa3-fwd wheel.

    diffusers imports FlashAttention-3 from the module `flash_attn_interface`, and only when a distribution
    named `flash_attn_3` is installed (FA3 built from flash-attention/hopper). The fa3-fwd wheel ships the
    same forward under the module `fa3_fwd_interface` (its `flash_attn_func` has FA3's signature), so the
    backend's function and its availability flag are pointed at it; `set_attention_backend("_flash_3")`
    then works as with a source build."""
    import diffusers.models.attention_dispatch as dispatch
    import fa3_fwd_interface

    dispatch.flash_attn_3_func = fa3_fwd_interface.flash_attn_func
    dispatch.flash_attn_3_varlen_func = fa3_fwd_interface.flash_attn_varlen_func
    dispatch._CAN_USE_FLASH_ATTN_3 = True


def measure(step, device: str, steps: int, warmup: int) -> list[float]:
    """Milliseconds per call of `step` over `steps` calls after `warmup` (CUDA events on a GPU)."""
    import torch

    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t))
    return times


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def torchao_fp8(model) -> None:
    """torchao's float8 (per-row dynamic activations, per-channel weights) on the Linears omni's fp8 takes."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    from omni_compile.graphs import find_regions
    from omni_compile.weights import fp8_targets

    blocks = [m for r in find_regions(model) for _, m in r.instances]
    targets = {id(linear) for _, _, linear in fp8_targets(blocks)[0]}
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda module, fqn: id(module) in targets)  # fmt: skip


def run_one(workload: str, mode: str, steps: int, warmup: int, bundle: Path, seed: int, profile: bool = False) -> dict:
    import torch

    import omni_compile
    from omni_compile.config import ShapeBucket, parse_dtype
    from omni_compile.inspect.profile import profile_step
    from omni_compile.models import resolve_model

    preset, shape, dtype_s, device, *extra = WORKLOADS[workload]
    extra = extra[0] if extra else {}
    if device == "cuda" and not torch.cuda.is_available():
        return {"workload": workload, "mode": mode, "skipped": "no CUDA device"}
    dtype = parse_dtype(dtype_s)
    config = extra.get("config")
    if extra.get("tiny"):
        sys.path.insert(0, str(ROOT / "tests"))
        from generic_model import GENERIC_MODELS

        config = GENERIC_MODELS[extra["tiny"]][1]
    if extra.get("inputs"):
        sys.path.insert(0, str(ROOT / "tests"))  # the example-input functions of the generic models
    spec = resolve_model(preset, example_inputs=extra.get("inputs"), model_config=config)
    bucket = ShapeBucket.parse(shape)
    t0 = time.perf_counter()
    model = spec.load(dtype=dtype, device=device, seed=seed)
    text_len = extra.get("text_len", spec.text_len)
    inputs = spec.adapter.example_inputs(model, bucket, dtype=dtype, device=device, text_len=text_len, seed=seed)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    init_s = time.perf_counter() - t0

    def step():
        with torch.no_grad():
            return model(**inputs)[0]

    reference = step()  # eager output of these weights and inputs
    sync()
    if mode in ("stock", "stock-warm", "stock-fa3", "stock-fp8"):
        if mode == "stock-fp8":
            torchao_fp8(model)
        if mode == "stock-warm":
            torch.compiler.load_cache_artifacts(bundle.with_suffix(".stock").read_bytes())
        if mode == "stock-fa3":
            diffusers_fa3_from_fa3_fwd()
            model.set_attention_backend("_flash_3")
        if not getattr(model, "_repeated_blocks", None):  # CogView4 declares none: name its block class, as a
            from omni_compile.graphs.regions import discover_block_classes  # user would, to compile it regionally

            model._repeated_blocks = discover_block_classes(model)
        model.compile_repeated_blocks(fullgraph=True)
    elif mode.split("/")[0] in ("omni", "omni-warm"):
        # "omni/all/*=triton/attn=CUDNN_ATTN": omni-compile with those pass switches, kernel choices
        # (OP=IMPL) and default attention backend (attn=NAME).
        base, *items = mode.split("/")
        cuda_graphs = "cg" in items
        transforms = [t for item, t in (("fuse", "fuse_projections"), ("fp8", "fp8")) if item in items]
        switches = [i for i in items if "=" not in i and i not in ("cg", "fuse", "fp8")]
        choices = dict(i.split("=", 1) for i in items if "=" in i)
        pass_options: dict[str, dict] = {}
        for key in [k for k in choices if "." in k]:  # PASS.OPTION=VALUE (JSON, or a plain string)
            value = choices.pop(key)
            try:
                value = json.loads(value)
            except ValueError:
                pass
            pass_name, option = key.split(".", 1)
            pass_options.setdefault(pass_name, {})[option] = value
        attention = {"default": {"backend": choices.pop("attn")}} if "attn" in choices else {}
        if "measure" in choices:
            attention["measure"] = choices.pop("measure") == "true"
        kernels = choices
        if base == "omni-warm":
            info = torch.compiler.load_cache_artifacts(bundle.read_bytes())
            del info
        config = omni_compile.CompileConfig(
            passes=switches,
            kernels=kernels,
            attention=attention,
            weight_transforms=transforms,
            pass_options=pass_options,
        )
        omni_compile.compile(model, config, cuda_graphs=cuda_graphs)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        out = step()
    except Exception as e:  # diffusers' _flash_3 refuses a mask: the two-line stack cannot run this model
        if mode == "stock-fa3" and "attn_mask" in str(e):
            return {"workload": workload, "mode": mode, "skipped": "n/a: diffusers' _flash_3 takes no attention mask"}
        raise
    sync()
    first_call = time.perf_counter() - t0
    times = measure(step, device, steps, warmup)
    result = {
        "workload": workload,
        "mode": mode,
        "preset": preset,
        "shape": shape,
        "dtype": dtype_s,
        "device": device,
        "init_s": round(init_s, 2),
        "first_call_s": round(first_call, 3),
        "step_ms": summary(times),
        "rel_l2_vs_eager": _rel_l2(out, reference),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    if profile:
        result["profile"] = profile_step(step, device)
    if mode == "stock":
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            bundle.with_suffix(".stock").write_bytes(saved[0])
    if mode.split("/")[0] in ("omni", "omni-warm"):
        state = omni_compile.compile_state(model)
        result["omni"] = {
            "region_compiles": len(state.records),
            "cache_hits": sum(r.cache_hit for r in state.records),
            "pass_matches": {r.region: r.passes for r in state.records},
            "fused_op_implementations": {r.region: r.resolutions for r in state.records},
            "attention": {r.region: r.attention for r in state.records},
            "pass_uuid": state.pass_uuid,
            # where the first call's compile time went, per region compile: seconds in all, tracing patterns
            # (the first compile that runs the passes), each pass (including that tracing; attention: timing
            # the backends too)
            "compile_seconds": [{k: v for k, v in r.to_json().items() if k in ("region", "seconds", "prepare_seconds",
                                                                                 "pass_times")} for r in state.records],
        }
        if mode == "omni":
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None:
                bundle.write_bytes(saved[0])
                result["omni"]["bundle_bytes"] = len(saved[0])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W4-flux,W4-wan", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole list of modes this many times")
    ap.add_argument("--profile", action="store_true", help="also profile one step: kernels per step by category")
    ap.add_argument("--profile-modes", default="", help="comma list: profile only these modes (implies --profile)")
    ap.add_argument("--child", nargs=3, metavar=("WORKLOAD", "MODE", "BUNDLE"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        workload, mode, bundle = args.child
        res = run_one(workload, mode, args.steps, args.warmup, Path(bundle), args.seed, args.profile)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    results = []
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-"))
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            ap.error(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        bundle = workdir / f"{workload}.bundle"
        for mode in args.modes.split(",") * args.repeat:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(workdir / f"inductor-{workload}-{mode}-{len(results)}"))
            cmd = [
                sys.executable,
                "-P",  # not bench/ on sys.path: a bench/ module could shadow the `kernels` package transformers probes
                __file__,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--seed",
                str(args.seed),
                "--child",
                workload,
                mode,
                str(bundle),
            ] + (["--profile"] if args.profile or mode in args.profile_modes.split(",") else [])
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                res = {"workload": workload, "mode": mode, "error": proc.stderr[-3000:]}
            else:
                res = json.loads(lines[-1][len("RESULT ") :])
            res["process_s"] = round(time.perf_counter() - t0, 1)
            results.append(res)
            print(
                f"# {workload} {mode}: done in {res['process_s']}s" + (" (ERROR)" if "error" in res else ""),
                file=sys.stderr,
                flush=True,
            )
            if "error" in res:
                print(res["error"], file=sys.stderr)
            if args.json:  # after every mode, so a run cut short keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    return 1 if any("error" in r for r in results) else 0  # a skipped mode (no GPU, no mask support) is not one


def print_table(results: list[dict]) -> None:
    print(
        f"{'workload':<8} {'mode':<24} {'step ms (median [min-max])':<28} {'vs stock':>8} {'vs fa3':>8} "
        f"{'first call s':>12} {'rel L2 vs eager':>15} {'peak GiB':>8} {'kernels/step':>12}"
    )
    refs: dict[str, dict[str, float]] = {"stock": {}, "stock-fa3": {}}
    for r in results:  # the first stock and stock-fa3 runs of each workload are the references
        if r.get("mode") in refs and "step_ms" in r:
            refs[r["mode"]].setdefault(r["workload"], r["step_ms"]["median"])
    for r in results:
        if "step_ms" not in r:
            print(f"{r['workload']:<8} {r['mode']:<24} {r.get('skipped') or 'ERROR'}")
            continue
        s = r["step_ms"]
        ratios = [f"{ref[r['workload']] / s['median']:.3f}x" if r["workload"] in ref else "-" for ref in refs.values()]
        print(
            f"{r['workload']:<8} {r['mode']:<24} {s['median']:9.2f} [{s['min']:.2f}-{s['max']:.2f}]{'':<6} "
            f"{ratios[0]:>8} {ratios[1]:>8} {r['first_call_s']:>12.2f} {r['rel_l2_vs_eager']:>15.2e} "
            f"{str(r['peak_mem_gib']):>8} {r.get('profile', {}).get('kernels', '-'):>12}"
        )
    groups: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if "first_call_s" in r:
            groups.setdefault((r["workload"], r["mode"]), []).append(r["first_call_s"])
    if any(len(v) > 1 for v in groups.values()):
        print("first call s, median [min-max] over processes:")
        for (w, m), v in groups.items():
            print(f"  {w:<8} {m:<10} {statistics.median(v):7.2f} [{min(v):.2f}-{max(v):.2f}] n={len(v)}")
    for r in results:
        if "profile" in r:
            cats = ", ".join(
                f"{k} {v['count']}/{v['ms']:.1f}ms" for k, v in sorted(r["profile"]["by_category"].items())
            )
            print(f"  {r['workload']} {r['mode']:<10} {cats}")
            t = r["profile"].get("timeline")
            if t:
                before = ", ".join(f"{c} {ms:.2f}" for c, ms in t["gap_ms_before"].items())
                print(f"    device span {t['span_ms']:.1f} ms, busy {t['busy_ms']:.1f}, idle {t['idle_ms']:.1f} "
                      f"({t['gaps']} gaps >= 5 us, {t['gap_ms']:.1f} ms; before: {before})")
            for g in r["profile"].get("gemms", [])[:8]:
                print(f"    {g['op']:<18} {g['shape']:<22} x{g['calls']:<4} {g['ms']:8.2f} ms {g['tflops']:7.1f} TFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
