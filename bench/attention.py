"""Attention microbenchmark: every backend that runs here, on the W1/W2 shapes and odd ones.

For each shape (bf16, [B, S, H, D] as diffusers builds q/k/v) and backend it reports the median and
[min-max] device time of --reps calls after warm-up (CUDA events, each call queued behind a spin kernel so
that the host's launch time is not in it, as the build times its choice), TFLOP/s (4·B·H·Sq·Skv·D per call),
and the error against a float64 reference computed on a subset of query rows (all keys): relative L2 and max
abs. Backends:

  sdpa          F.scaled_dot_product_attention, torch's own choice (TORCH_SDPA)
  sdpa-cudnn    SDPA pinned to cuDNN (CUDNN_ATTN)
  sdpa-flash    SDPA pinned to its FlashAttention-2 kernel
  sdpa-efficient SDPA pinned to the memory-efficient kernel
  fa3           FlashAttention-3 (FA3_ATTN: the fa3-fwd wheel or FA3's hopper build), if installed
  fa4           FlashAttention-4 (FA4_ATTN: flash-attn-4, CuTe DSL), if installed
  fa2           FlashAttention-2 (FLASH_ATTN: flash-attn), if installed
  fa3-fp8       FA3's fp8 forward, per-head e4m3 q/k/v, K smoothed (FA3_FP8_ATTN, lossy), if FA3 is installed
  triton        omni-compile's Triton kernel (TRITON_ATTN)
  sage          omni-compile's INT8 Q·K kernel (SAGE_ATTN, lossy)

Shapes marked "key bias" (LTX-Video's masked cross-attention) add a float [B, H, Skv] bias to the scores (random
normal, every 8th key at -10000, one row per batch broadcast over heads): only the backends that take one run
there (SDPA and its pinned kernels with the bias as attn_mask, and the Triton kernel).

    python bench/attention.py [--json rows.json] [--only W2,key bias] [--sweep] [--reps 20]
    python bench/attention.py --device cpu --quick     # smoke test: tiny shapes, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--only", default=None, help="run the shapes whose name contains this (a comma list: any of them)")
    ap.add_argument("--backends", default=None, help="comma list (default: all that run here)")
    ap.add_argument("--sweep", action="store_true", help="also time tiling variants of the Triton kernel")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (default 20 on CUDA, 2 on CPU)")
    ap.add_argument("--ref-rows", type=int, default=256, help="query rows checked against float64")
    ap.add_argument("--json", default=None, help="write every row to this file")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from omni_compile.attention.measure import Shape, device_times_ms  # noqa: E402


def shapes(quick: bool):
    # name: (B, Sq, Skv, H, D)
    if quick:
        return {"tiny self": (1, 96, 96, 2, 64), "tiny cross": (1, 96, 8, 2, 64), "tiny odd": (1, 50, 50, 2, 72),
                "tiny key bias": (1, 96, 24, 2, 64)}  # fmt: skip
    return {
        "LTX cross, key bias": (1, 6144, 128, 32, 64),
        "W1 joint (FLUX 1024^2)": (1, 4608, 4608, 24, 128),
        "W2 self (Wan 480p)": (1, 32760, 32760, 12, 128),
        "W2 cross": (1, 32760, 512, 12, 128),
        "W3 joint (FLUX 512^2)": (1, 1536, 1536, 24, 128),
        "odd D=72 S=1000": (1, 1000, 1000, 8, 72),
        "odd D=64 S=4097": (2, 4097, 4097, 8, 64),
    }


def _sdpa(backend):
    def run(q, k, v, scale, bias=None):
        ctx = sdpa_kernel(backend) if backend is not None else _null()
        mask = None if bias is None else bias[:, :, None, :]
        with ctx:
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=mask, scale=scale).transpose(1, 2)  # fmt: skip

    return run


BIAS_BACKENDS = ("sdpa", "sdpa-cudnn", "sdpa-efficient", "triton")  # the ones that take a key bias


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def backends(device: str) -> dict:
    """name -> (fn(q, k, v, scale) on [B, S, H, D], why it cannot run or None)."""
    out = {"sdpa": (_sdpa(None), None)}
    if device == "cuda":
        out["sdpa-cudnn"] = (_sdpa(SDPBackend.CUDNN_ATTENTION), None)
        out["sdpa-flash"] = (_sdpa(SDPBackend.FLASH_ATTENTION), None)
        out["sdpa-efficient"] = (_sdpa(SDPBackend.EFFICIENT_ATTENTION), None)
        from omni_compile.attention.backends import BACKENDS, FLASH_BUILDS
        from omni_compile.attention.measure import runner
        from omni_compile.platform import current_platform

        for name, build in FLASH_BUILDS.items():  # fa3 (FA3_ATTN), fa4 (FA4_ATTN), fa2 (FLASH_ATTN)
            why = BACKENDS[name].check(current_platform("cuda"), explicit=True)
            out[build.op_name] = (runner(name) if why is None else None, why)
        why = BACKENDS["FA3_FP8_ATTN"].check(current_platform("cuda"), explicit=True)  # lossy: its error is printed
        out["fa3-fp8"] = (runner("FA3_FP8_ATTN") if why is None else None, why)
    from omni_compile.attention import sage, triton_attn

    out["triton"] = (lambda q, k, v, s, bias=None: triton_attn.attention_triton(q, k, v, None, s, bias), None)
    out["sage"] = (lambda q, k, v, s: sage.attention_sage_triton(q, k, v, None, s), None)
    return out


def reference(q, k, v, scale, rows, bias=None):
    """float64 attention of the first `rows` query rows, [B, rows, H, D]."""
    qd, kd, vd = (t.double() for t in (q[:, :rows], k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if bias is not None:
        s = s + bias.double()[:, :, None, :]
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vd)


def timeit(fn, reps, device):
    """Milliseconds of `reps` runs: on a GPU the device time, as the build's measured choice takes it
    (`attention.measure.device_times_ms`: a warm-up, then each run queued behind a spin kernel, so host launch
    time is not in it)."""
    return device_times_ms(fn, device, reps)


def main() -> int:
    args = ARGS or parse_args()
    dev = args.device
    reps = args.reps or (20 if dev == "cuda" else 2)
    torch.manual_seed(0)
    table = backends(dev)
    if args.backends:
        table = {k: v for k, v in table.items() if k in args.backends.split(",")}
    rows = []
    for name, (B, Sq, Skv, H, D) in shapes(args.quick).items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        q = torch.randn(B, Sq, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Skv, H, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, Skv, H, D, device=dev, dtype=torch.bfloat16)
        scale = 1.0 / math.sqrt(D)
        # the bias the build's measured choice times such a call with (`attention.measure.Shape.bias`)
        bias = Shape(B, H, Sq, Skv, D, torch.bfloat16, dev, key_bias="key bias" in name).bias(
            torch.Generator(device=dev).manual_seed(1))
        n_ref = min(args.ref_rows, Sq)
        ref = reference(q, k, v, scale, n_ref, bias)
        flops = 4.0 * B * H * Sq * Skv * D
        variants = [(b, fn, why, None) for b, (fn, why) in table.items()]
        if bias is not None:
            variants = [v if v[0] in BIAS_BACKENDS else (v[0], None, "takes no key bias", v[3]) for v in variants]
        if args.sweep and dev == "cuda":
            from omni_compile.attention import triton_attn

            for cfg in ({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
                        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
                        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
                        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}):  # fmt: skip
                def run(q, k, v, s, bias=None, cfg=cfg):
                    out = q.new_empty(q.shape)
                    return triton_attn._launch(q, k, v, None, s, out, config=cfg, key_bias=bias)

                variants.append((f"triton {cfg}", run, None, cfg))
        extra = {} if bias is None else {"bias": bias}
        for backend, fn, why, cfg in variants:
            row = {"shape": name, "B": B, "Sq": Sq, "Skv": Skv, "H": H, "D": D, "backend": backend}
            if fn is None:
                rows.append({**row, "skipped": why})
                print(f"{name:<24} {backend:<16} skipped: {why}", file=sys.stderr)
                continue
            try:
                out = fn(q, k, v, scale, **extra)
                err = out[:, :n_ref].double() - ref
                times = timeit(lambda fn=fn, extra=extra: fn(q, k, v, scale, **extra), reps, dev)
            except Exception as e:  # a backend that fails here is a result, not a crash of the whole table
                rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:400]}"})
                print(f"{name:<24} {backend:<16} ERROR {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            med = statistics.median(times)
            rows.append({**row, "median_ms": med, "min_ms": min(times), "max_ms": max(times), "n": len(times),
                         "tflops": flops / med / 1e9, "rel_l2": float(err.norm() / ref.norm()),
                         "max_abs": float(err.abs().max()), "finite": bool(out.isfinite().all())})  # fmt: skip
            print(f"{name:<24} {backend:<16} done", file=sys.stderr, flush=True)
        if args.json:  # after every shape, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; bf16; "
          f"median [min-max] of {reps}; error vs float64 on {args.ref_rows} query rows")  # fmt: skip
    print(f"{'shape':<24} {'backend':<16} {'median ms':>10} {'min':>8} {'max':>8} {'TFLOP/s':>8} {'rel L2':>9} {'max abs':>9}")
    for r in rows:
        if "median_ms" not in r:
            print(f"{r['shape']:<24} {r['backend'][:16]:<16} {r.get('skipped') or r.get('error')}")
            continue
        print(f"{r['shape']:<24} {r['backend'][:16]:<16} {r['median_ms']:10.3f} {r['min_ms']:8.3f} {r['max_ms']:8.3f} "
              f"{r['tflops']:8.1f} {r['rel_l2']:9.2e} {r['max_abs']:9.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
