"""Microbenchmark: each fused-op Triton kernel against the unfused model code, eager and under stock Inductor.

For every kernel and shape set (W1: FLUX 1024x1024, W2: Wan 480p; bf16, batch 1) it times
  eager     the unfused code as the models write it (below), in eager torch;
  inductor  torch.compile(that same function, fullgraph=True, dynamic=False), compiled once per shape;
  ours      the `torch.ops.omni_compile.<op>_triton` op, called directly;
  ours-ind  the same op inside a torch.compile'd graph (how omni-compile runs it: Inductor launches it);
and reports the median and min/max GPU time (cold L2, host overhead hidden; see `timeit`), the fewest bytes the op must move (each input read once, the
output written once), the bandwidth that gives, its fraction of the H200's 4300 GB/s, our speedup over
Inductor, and the max error of each output against the eager one (max |out - eager| / max |eager|).

    python bench/fused_ops.py [--json rows.json] [--only rope] [--sweep]
    python bench/fused_ops.py --device cpu --quick      # smoke test: tiny shapes, Triton interpreter

`--sweep` also times our kernels' tiling variants (the `config` of each module's `_launch`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PEAK_GBS = 4300.0  # H200 device-to-device copy, as measured on these machines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--sweep", action="store_true", help="also time the tiling variants of our kernels")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 100 on CUDA, 5 on CPU)")
    ap.add_argument("--json", default=None, help="write every row to this file")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    # The kernels only run on CPU under Triton's interpreter, chosen when their module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

import omni_compile.ops  # noqa: F401  (registers the ops and kernels)
from omni_compile.ops import FUSED_OPS
from omni_compile.ops.kernels import adaln as adaln_k
from omni_compile.ops.kernels import gated_residual as gated_k
from omni_compile.ops.kernels import rms_norm as rms_k
from omni_compile.ops.kernels import rms_norm_rope as rope_k
from omni_compile.attention.measure import device_times_ms
from omni_compile.ops.kernels._common import next_pow2

try:
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import FP32LayerNorm
except ImportError:  # the GPU image may lack diffusers: same code as diffusers 0.42.1 (use_real, unbind -1)
    print("note: diffusers is not importable; using a local copy of apply_rotary_emb and FP32LayerNorm")

    def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        cos, sin = freqs_cis
        cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if sequence_dim == 1 else (cos, sin)
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)

    class FP32LayerNorm(torch.nn.LayerNorm):
        def forward(self, inputs):
            return F.layer_norm(inputs.float(), self.normalized_shape, None, None, self.eps).to(inputs.dtype)


ops = torch.ops.omni_compile
EPS = 1e-6
BF16 = torch.bfloat16


# ---------------------------------------------------------------- the unfused model code


def wan_rope(x, freqs_cos, freqs_sin):
    """diffusers' WanAttnProcessor rotary embedding."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def rms_module(n: int, device) -> torch.nn.RMSNorm:
    m = torch.nn.RMSNorm(n, eps=EPS).to(device=device, dtype=BF16)
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(n, device=device))
    return m


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    eager: object  # f(*eager_args) -> Tensor: the model's unfused code
    eager_args: tuple
    ours: object  # the triton_op overload
    ours_args: tuple
    launch: object  # the module's _launch(*ours_args, out, config=...)
    configs: list = field(default_factory=list)
    # rms_norm_rope: the q-like inputs among eager_args and ours_args; a k of their shapes makes the second
    # call of the pair (Inductor's code for both, our two launches, our paired launch)
    pair: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    op: str = "rms_norm_rope"  # the fused op whose paired launch `pair` times


def flux_tables(S: int, hd: int, device):
    """FLUX's cos/sin [S, hd] fp32 (repeat_interleave'd, as FluxPosEmbed returns them)."""
    ang = torch.rand(S, hd // 2, device=device) * 100
    return ang.cos().repeat_interleave(2, dim=1), ang.sin().repeat_interleave(2, dim=1)


def make_cases(device: str, quick: bool) -> list[Case]:
    torch.manual_seed(0)
    dev = torch.device(device)
    # W1: FLUX 1024x1024 (D 3072 = 24 x 128; 4096 image + 512 text tokens); W2: Wan 480p (D 1536 = 12 x 128).
    H1, hd, S_img, S_txt = (4, 16, 24, 8) if quick else (24, 128, 4096, 512)
    H2, S2 = (3, 20) if quick else (12, 32760)
    D1, D2, S1 = H1 * hd, H2 * hd, S_img + S_txt
    randn = lambda *s, dtype=BF16: torch.randn(*s, device=dev, dtype=dtype)
    cases = []

    # rms_norm: FLUX per head (nn.RMSNorm(128) on [B, S, H, 128]), Wan across heads (nn.RMSNorm(H * 128)).
    norm_q = rms_module(hd, dev)
    x = randn(1, S1, H1, hd)
    cases.append(Case("W1 rms_norm per-head", lambda x, m=norm_q: m(x), (x,), ops.rms_norm_triton,
                      (x, norm_q.weight, EPS, False), rms_k._launch, _row_configs(hd)))  # fmt: skip
    norm_w = rms_module(D2, dev)
    x = randn(1, S2, D2)
    cases.append(Case("W2 rms_norm across-heads", lambda x, m=norm_w: m(x), (x,), ops.rms_norm_triton,
                      (x, norm_w.weight, EPS, False), rms_k._launch, _row_configs(D2)))  # fmt: skip

    # adaln: FLUX AdaLayerNormZero(Single) (bf16 LayerNorm, modulation from emb.chunk(3)); Wan's FP32LayerNorm.
    ln = torch.nn.LayerNorm(D1, elementwise_affine=False, eps=EPS)
    emb = randn(1, 3 * D1) * 0.5
    shift, scale, gate = emb.chunk(3, dim=1)
    x = randn(1, S1, D1)
    cases.append(Case("W1 adaln layer round_norm", lambda x, sc, sh: ln(x) * (1 + sc[:, None]) + sh[:, None],
                      (x, scale, shift), ops.adaln_triton, (x, scale[:, None], shift[:, None], EPS, "layer", True),
                      adaln_k._launch, _row_configs(D1)))  # fmt: skip
    fln = FP32LayerNorm(D2, elementwise_affine=False, eps=EPS)
    table = randn(1, 6, D2, dtype=torch.float32) * 0.5
    w_shift, w_scale, w_gate, *_ = table.chunk(6, dim=1)
    x = randn(1, S2, D2)
    cases.append(Case("W2 adaln layer fp32-norm", lambda x, sc, sh: (fln(x.float()) * (1 + sc) + sh).type_as(x),
                      (x, w_scale, w_shift), ops.adaln_triton, (x, w_scale, w_shift, EPS, "layer", False),
                      adaln_k._launch, _row_configs(D2)))  # fmt: skip

    # gated_residual: FLUX `x + gate.unsqueeze(1) * y` in bf16; Wan `(x.float() + y * gate).type_as(x)`.
    x, y = randn(1, S_img, D1), randn(1, S_img, D1)
    cases.append(Case("W1 gated_residual", lambda x, y, g: x + g.unsqueeze(1) * y, (x, y, gate),
                      ops.gated_residual_triton, (x, y, gate[:, None]), gated_k._launch, _gate_configs(D1)))  # fmt: skip
    x, y = randn(1, S2, D2), randn(1, S2, D2)
    cases.append(Case("W2 gated_residual", lambda x, y, g: (x.float() + y * g).type_as(x), (x, y, w_gate),
                      ops.gated_residual_triton, (x, y, w_gate), gated_k._launch, _gate_configs(D2)))  # fmt: skip

    # rms_norm_rope, FLUX: norm_q per head then apply_rotary_emb(sequence_dim=1); the double block
    # normalises text (norm_added_q) and image (norm_q) queries, concatenates, then applies the rope.
    cos, sin = flux_tables(S1, hd, dev)
    tabs = (cos, sin)
    norm_added_q = rms_module(hd, dev)
    x = randn(1, S1, H1, hd)
    cases.append(Case("W1 rms_norm_rope single", lambda x, c, s: apply_rotary_emb(norm_q(x), (c, s), sequence_dim=1),
                      (x, cos, sin), ops.rms_norm_rope_triton,
                      (x, norm_q.weight, None, None, *tabs, EPS, False, False, "per_element"), rope_k._launch,
                      _rope_configs(H1, hd, False), pair=((0,), (0,))))  # fmt: skip
    txt, img = randn(1, S_txt, H1, hd), randn(1, S_img, H1, hd)

    def flux_double(txt, img, c, s):
        q = torch.cat([norm_added_q(txt), norm_q(img)], dim=1)
        return apply_rotary_emb(q, (c, s), sequence_dim=1)

    cases.append(Case("W1 rms_norm_rope double", flux_double, (txt, img, cos, sin), ops.rms_norm_rope_triton,
                      (txt, norm_added_q.weight, img, norm_q.weight, *tabs, EPS, False, False, "per_element"),
                      rope_k._launch,
                      _rope_configs(H1, hd, False), pair=((0, 1), (0, 2))))  # fmt: skip

    # Wan: norm_q = RMSNorm(H * 128) over the flat query, unflatten to heads, Wan's rope with [1, S, 1, 128] freqs.
    ang = torch.rand(1, S2, 1, hd // 2, device=dev) * 100
    freqs_cos = ang.cos().repeat_interleave(2, dim=-1).to(BF16)
    freqs_sin = ang.sin().repeat_interleave(2, dim=-1).to(BF16)
    wan_tabs = (freqs_cos.reshape(S2, hd), freqs_sin.reshape(S2, hd))
    q = randn(1, S2, D2)
    cases.append(Case("W2 rms_norm_rope across-heads",
                      lambda q, fc, fs: wan_rope(norm_w(q).unflatten(2, (H2, -1)), fc, fs), (q, freqs_cos, freqs_sin),
                      ops.rms_norm_rope_triton,
                      (q.unflatten(2, (H2, hd)), norm_w.weight, None, None, *wan_tabs, EPS, False, True, "per_pair"),
                      rope_k._launch, _rope_configs(H2, hd, True), pair=((0,), (0,))))  # fmt: skip

    # W5-ltx: LTX-Video 2B (2048 = 32 x 64, 6,144 tokens): the norm over the whole [B, S, 2048] projection, then the
    # interleaved rope with per-element [1, S, 2048] fp32 tables, before the unflatten; one "head" of 2048 for the op
    D5, S5 = (64, 12) if quick else (2048, 6144)
    norm_5 = rms_module(D5, dev)
    ang = torch.rand(1, S5, D5 // 2, device=dev) * 100
    cos5, sin5 = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)

    def ltx(x, c, s):
        n = norm_5(x)
        real, imag = n.unflatten(2, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(2)
        return (n.float() * c + rotated.float() * s).to(n.dtype).unsqueeze(2)  # [B, S, 1, C], as the op writes it

    x = randn(1, S5, D5)
    cases.append(Case("W5-ltx rms_norm_rope interleaved", ltx, (x, cos5, sin5), ops.rms_norm_rope_triton,
                      (x.unsqueeze(2), norm_5.weight, None, None, cos5[0], sin5[0], EPS, False, False, "per_element"),
                      rope_k._launch, _rope_configs(1, D5, False, warps=(2, 4, 8, 16)), pair=((0,), (0,))))  # fmt: skip

    # Qwen-Image 1024² (24 x 128, 4,096 image tokens): per-head norm, then the complex rope with a [S, 64] complex64
    # table, whose real view [S, 128] is both per-pair tables of the op
    freqs = torch.polar(torch.ones(S_img, hd // 2, device=dev), torch.rand(S_img, hd // 2, device=dev) * 100)

    def qwen(x, f):
        xc = torch.view_as_complex(norm_q(x).float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * f.unsqueeze(1)).flatten(3).type_as(x)

    x = randn(1, S_img, H1, hd)
    table = torch.view_as_real(freqs).reshape(S_img, hd)
    cases.append(Case("Qwen-Image rms_norm_rope complex", qwen, (x, freqs), ops.rms_norm_rope_triton,
                      (x, norm_q.weight, None, None, table, table, EPS, False, False, "per_pair"),
                      rope_k._launch, _rope_configs(H1, hd, False), pair=((0,), (0,))))  # fmt: skip

    # layer_norm_rope, CogView4 1024² (32 x 128; 4,096 image tokens after 224 text tokens): q [B, S, H, D] viewed
    # heads-first, LayerNorm without affine, rotate-half RoPE written into the image part in place; the op rotates
    # the tokens from 224 on
    H6, hd6, T6, S6 = (4, 16, 3, 12) if quick else (32, 128, 224, 4096)
    ln6 = torch.nn.LayerNorm(hd6, eps=1e-5, elementwise_affine=False)
    ang = torch.rand(S6, hd6 // 2, device=dev) * 100
    cos6, sin6 = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)

    def cogview4(x, c, s):
        q = ln6(x.transpose(1, 2))
        q[:, :, T6:] = apply_rotary_emb(q[:, :, T6:], (c, s), use_real_unbind_dim=-2)
        return q.transpose(1, 2)  # [B, S, H, D], as the op writes it

    x = randn(1, T6 + S6, H6, hd6)
    cases.append(Case("CogView4 layer_norm_rope halves suffix", cogview4, (x, cos6, sin6), ops.layer_norm_rope_triton,
                      (x, None, None, cos6, sin6, 1e-5, "halves", T6),
                      rope_k.layer_launch, _rope_configs(H6, hd6, False), pair=((0,), (0,)), op="layer_norm_rope"))  # fmt: skip

    # HunyuanDiT 1024² (16 x 88, 4,096 tokens): LayerNorm with weight and bias per head, FLUX-style per-element tables
    H7, hd7, S7 = (2, 8, 12) if quick else (16, 88, 4096)
    ln7 = torch.nn.LayerNorm(hd7, eps=1e-6).to(device=dev, dtype=BF16)
    with torch.no_grad():
        ln7.weight.copy_(1 + 0.1 * torch.randn(hd7, device=dev))
        ln7.bias.copy_(0.1 * torch.randn(hd7, device=dev))
    cos7, sin7 = flux_tables(S7, hd7, dev)
    x = randn(1, S7, H7, hd7)
    cases.append(Case("HunyuanDiT layer_norm_rope per-element",
                      lambda x, c, s: apply_rotary_emb(ln7(x.transpose(1, 2)), (c, s)).transpose(1, 2), (x, cos7, sin7),
                      ops.layer_norm_rope_triton, (x, ln7.weight, ln7.bias, cos7, sin7, 1e-6, "per_element", 0),
                      rope_k.layer_launch, _rope_configs(H7, hd7, False), pair=((0,), (0,)), op="layer_norm_rope"))  # fmt: skip
    return cases


def _row_configs(d: int) -> list[dict]:
    block = next_pow2(d)
    out = []
    for rows in (1, 2, 4, 8, 16, 32, 64):
        if 1024 <= rows * block <= 16384:
            for warps in (4, 8, 16):
                if rows * block // (32 * warps) >= 4:
                    out.append({"ROWS": rows, "num_warps": warps})
    return out


def _gate_configs(d: int) -> list[dict]:
    out = []
    for block in (256, 512, 1024, 2048):
        if block <= next_pow2(d):
            for rows in (1, 2, 4, 8, 16):
                if 2048 <= rows * block <= 8192:
                    out += [{"ROWS": rows, "BLOCK_D": block, "num_warps": w} for w in (4, 8)]
    return out


def _rope_configs(H: int, hd: int, across: bool, warps: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    blocks = [next_pow2(H)] if across else sorted({next_pow2(H), H & -H, 4, 8, 16} - {0})
    return [
        {"BLOCK_H": bh, "num_warps": w, "SPLIT": split}
        for bh in blocks
        if bh <= next_pow2(H)
        for w in warps
        for split in (True, False)
    ]


# ---------------------------------------------------------------- measuring


def span_bytes(tensors) -> int:
    """Bytes of the union of the memory spans of `tensors` (views of one buffer counted once)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        start = t.storage_offset() * t.element_size()
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
        spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + extent * t.element_size()))
    total = 0
    for intervals in spans.values():
        intervals.sort()
        lo, hi = intervals[0]
        for a, b in intervals[1:]:
            if a > hi:
                total += hi - lo
                lo, hi = a, b
            else:
                hi = max(hi, b)
        total += hi - lo
    return total


_FLUSH = None


def timeit(fn, device: str, reps: int | None) -> list[float]:
    """[min, median, max] device time of `fn` in microseconds.

    On CUDA, each of `reps` (default 100) runs starts with a cold L2 (a 256 MB buffer is zeroed) and a spin
    kernel, so the host has queued `fn`'s kernels before the GPU reaches them: the CUDA events around `fn`
    time the GPU work alone, not Python or launcher overhead (the kernels run embedded in Inductor's graphs).
    The timer is the build's own (`attention.measure.device_times_ms`).
    """
    global _FLUSH
    if device == "cuda" and _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flush = _FLUSH.zero_ if device == "cuda" else None
    times = [1000 * t for t in device_times_ms(fn, device, reps or (100 if device == "cuda" else 5), before=flush)]
    return [min(times), statistics.median(times), max(times)]


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _row(case: str, impl: str, times, nbytes: int, err: float) -> dict:
    lo, med, hi = times
    gbs = nbytes / med / 1e3
    return {"case": case, "impl": impl, "median_us": med, "min_us": lo, "max_us": hi, "bytes": nbytes, "gbs": gbs,
            "peak_frac": gbs / PEAK_GBS, "err_vs_eager": err}  # fmt: skip


def run_case(case: Case, device: str, reps: int | None, sweep: bool) -> list[dict]:
    with torch.no_grad():
        ref = case.eager(*case.eager_args)
        t0 = time.perf_counter()
        compiled = torch.compile(case.eager, fullgraph=True, dynamic=False)
        compiled(*case.eager_args)
        compile_s = time.perf_counter() - t0
        impls = {
            "eager": lambda: case.eager(*case.eager_args),
            "inductor": lambda: compiled(*case.eager_args),
            "ours": lambda: case.ours(*case.ours_args),
        }
        if device == "cuda":  # under the interpreter a triton_op cannot be traced
            # Our op inside an Inductor graph, as omni-compile runs it (Inductor's own launcher calls the kernel).
            ours_ind = torch.compile(lambda *a: case.ours(*a), fullgraph=True, dynamic=False)
            impls["ours-ind"] = lambda: ours_ind(*case.ours_args)
        out_bytes = ref.numel() * ref.element_size()
        nbytes = span_bytes(case.ours_args) + out_bytes
        rows = []
        for impl, fn in impls.items():
            out = fn()
            lo, med, hi = timeit(fn, device, reps)
            row = _row(case.name, impl, (lo, med, hi), nbytes, max_rel(out, ref))
            row["compile_s"] = compile_s if impl == "inductor" else None
            rows.append(row)
        ind = rows[1]
        for r in rows[2:]:
            r["speedup_vs_inductor"] = ind["median_us"] / r["median_us"]
        if case.pair is not None:
            rows += _pair_rows(case, device, reps, ref, nbytes)
        if sweep:
            for cfg in case.configs:
                out = torch.empty_like(case.ours(*case.ours_args))
                fn = lambda cfg=cfg, out=out: case.launch(*case.ours_args, out, config=cfg)
                fn()
                lo, med, hi = timeit(fn, device, reps)
                row = _row(case.name, f"ours {cfg}", (lo, med, hi), nbytes, max_rel(out, ref))
                row["speedup_vs_inductor"] = ind["median_us"] / med
                rows.append(row)
    torch._dynamo.reset()
    return rows


def _pair_rows(case: Case, device: str, reps: int | None, ref: torch.Tensor, nbytes: int) -> list[dict]:
    """q and k of one attention: Inductor's code for both in one graph, our two launches, our paired launch.
    The bytes are twice a call's: the paired launch reads the tables once, so its GB/s is counted high."""
    own_eager, own_ours = case.pair
    k = {i: torch.randn_like(case.eager_args[i]) for i in own_eager}
    eager_k = tuple(k.get(i, a) for i, a in enumerate(case.eager_args))
    ours_k = list(case.ours_args)
    for i, j in zip(own_ours, own_eager):
        ours_k[i] = k[j].view_as(case.ours_args[i])  # a fresh contiguous k, in the op's view of q
    ours_k = tuple(ours_k)
    both = torch.compile(lambda a, b: (case.eager(*a), case.eager(*b)), fullgraph=True, dynamic=False)
    ref_k = case.eager(*eager_k)
    kernel = FUSED_OPS[case.op].kernels["triton"]
    names = FUSED_OPS[case.op].arg_names
    paired = dict(zip(names, case.ours_args))
    paired.update({s: v for s, v in zip(kernel.pair.second, ours_k)})
    impls = {
        "ind q+k": lambda: both(case.eager_args, eager_k),
        "ours q+k": lambda: (case.ours(*case.ours_args), case.ours(*ours_k)),
        "ours pair": lambda: kernel.pair.launcher(**paired),
    }
    rows = []
    for impl, fn in impls.items():
        out, out_k = fn()
        lo, med, hi = timeit(fn, device, reps)
        rows.append(_row(case.name, impl, (lo, med, hi), 2 * nbytes, max(max_rel(out, ref), max_rel(out_k, ref_k))))
    for r in rows[1:]:
        r["speedup_vs_inductor"] = rows[0]["median_us"] / r["median_us"]
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'case':30} {'impl':10} {'median us':>10} {'min':>9} {'max':>9} {'MB':>7} {'GB/s':>7} {'%peak':>6} "
    head += f"{'vs ind':>7} {'err':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        speed = f"{r['speedup_vs_inductor']:.2f}x" if r.get("speedup_vs_inductor") else ""
        lines.append(
            f"{r['case']:30} {r['impl'][:10]:10} {r['median_us']:10.1f} {r['min_us']:9.1f} {r['max_us']:9.1f} "
            f"{r['bytes'] / 1e6:7.1f} {r['gbs']:7.0f} {100 * r['peak_frac']:5.1f}% {speed:>7} {r['err_vs_eager']:8.1e}"
        )
    return "\n".join(lines)


def main(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --quick for a smoke test")
    t_start = time.perf_counter()
    info = f"torch {torch.__version__}"
    try:
        import triton

        info += f", triton {triton.__version__}"
    except ImportError:
        pass
    if args.device == "cuda":
        info += f", {torch.cuda.get_device_name()}"
    print(f"# {info}; {'quick ' if args.quick else ''}shapes, bf16, batch 1", flush=True)
    rows = []
    for case in make_cases(args.device, args.quick):
        if args.only and args.only not in case.name:
            continue
        case_rows = run_case(case, args.device, args.reps, args.sweep)
        rows += case_rows
        if args.sweep:
            sweep = sorted([r for r in case_rows if r["impl"].startswith("ours {")], key=lambda r: r["median_us"])
            default = case_rows[2]
            best = ", ".join(f"{r['impl'][5:]} {r['median_us']:.1f}" for r in sweep[:3])
            print(f"{case.name}: default {default['median_us']:.1f} us; best {best}", flush=True)
        else:
            print(f"{case.name}: done", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"# {time.perf_counter() - t_start:.0f} s in all; peak = {PEAK_GBS:.0f} GB/s; err = max |out - eager| / "
          "max |eager|; vs ind = Inductor time / ours")  # fmt: skip
    print(table([r for r in rows if not r["impl"].startswith("ours {")]))


if __name__ == "__main__":
    main(ARGS)
