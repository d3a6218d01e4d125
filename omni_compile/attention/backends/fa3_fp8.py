"""FA3_FP8_ATTN: FlashAttention-3's fp8 forward on Hopper (the same builds as FA3_ATTN: the fa3-fwd wheel
or FA3's hopper build, compiled with fp8). Lossy, so never chosen automatically; by name only
(`--attention-backend FA3_FP8_ATTN`, or per role).

q, k and v ([B, S, H, D], bf16) are quantized to float8 e4m3 with one scale per (batch, head), the largest
magnitude of that head mapped to 448, and FA3 takes the scales as its descale factors (its softmax and P·V
run with the fp8 operands, the output in bf16). K is smoothed first: its mean over the sequence, per batch,
head and channel, is subtracted. Every score of a query row then moves by the same amount (q · mean), which
softmax ignores, and K's range shrinks to what differs between keys, so its fp8 steps are finer (the
smoothing SageAttention uses). The quantization is ATen ops in the region graph, where Inductor fuses it
with whatever makes q, k and v (norms, RoPE); only FA3's fp8 kernel is an opaque call.
"""

from __future__ import annotations

import functools

import torch

from omni_compile.attention.backends.base import AttentionBackend, AttentionCall
from omni_compile.attention.backends.flash_build import FLASH_BUILDS, _available, _installed
from omni_compile.ops.fp8 import quantize
from omni_compile.ops.registry import register
from omni_compile.platform import Platform

HEAD_DIMS = (64, 96, 128, 192, 256)  # FA3's fp8 kernels


def quantize_heads(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [B, S, H, D], fp32 descale [B, H]) of a [B, S, H, D] tensor: t ≈ q * descale[b, h]."""
    q, descale = quantize(t, (1, 3))
    return q, descale[:, 0, :, 0]


def quantize_qkv(q, k, v, smooth_k: bool = True):
    """((q8, k8, v8), (dq, dk, dv)): the e4m3 operands and per-(batch, head) descales, K smoothed first. ATen ops
    only: traced into the region graph by the attention pass, where Inductor fuses them with what makes q/k/v."""
    if smooth_k:
        k = k - k.mean(dim=1, keepdim=True)
    (q8, dq), (k8, dk), (v8, dv) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    return (q8, k8, v8), (dq, dk, dv)


def fp8_attention(fwd, q, k, v, scale: float, smooth_k: bool = True) -> torch.Tensor:
    """softmax(q kᵀ · scale) v through an FA3 `_flash_attn_forward` with fp8 operands (module docstring)."""
    (q8, k8, v8), (dq, dk, dv) = quantize_qkv(q, k, v, smooth_k)
    out = fwd(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv, softmax_scale=scale, causal=False)[0]
    return out.to(q.dtype)


@functools.cache
def _fa3_forward():
    """The installed FA3 build's `_flash_attn_forward` (looked up and imported on the first call only)."""
    return _installed("FA3_ATTN")[2]._flash_attn_forward


@torch.library.custom_op("omni_compile::attention_fa3_fp8", mutates_args=())
def attention_fa3_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_descale: torch.Tensor,
                      k_descale: torch.Tensor, v_descale: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """FA3's fp8 kernel on quantized operands ([B, S, H, D] e4m3, [B, H] fp32 descales) -> bf16 [B, S, H, D]."""
    out = _fa3_forward()(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                         softmax_scale=scale, causal=False)[0]  # fmt: skip
    out = out.to(torch.bfloat16)
    return out if out.is_contiguous() else out.contiguous()


@attention_fa3_fp8.register_fake
def _(q8, k8, v8, q_descale, k_descale, v_descale, scale):
    return q8.new_empty((*q8.shape[:-1], v8.shape[-1]), dtype=torch.bfloat16)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """What the attention pass puts in the region ("op" form, bf16 [B, S, H, D]): the quantization as ATen ops,
    then one opaque call of FA3's fp8 kernel."""
    (q8, k8, v8), (dq, dk, dv) = quantize_qkv(q, k, v)
    return torch.ops.omni_compile.attention_fa3_fp8(q8, k8, v8, dq, dk, dv, scale)


def _available_fp8(platform: Platform) -> str | None:
    why = _available(FLASH_BUILDS["FA3_ATTN"])(platform)
    if why:
        return why.replace("FlashAttention-3", "FlashAttention-3 (fp8)", 1)
    module = FLASH_BUILDS["FA3_ATTN"].module()
    if module == "fa3_fwd_interface":  # the wheel records its build flags
        try:
            from fa3_fwd_config import CONFIG

            if CONFIG.get("build_flags", {}).get("FLASHATTENTION_DISABLE_FP8"):
                return "the installed fa3-fwd wheel was built without fp8 kernels"
        except ImportError:
            pass
    return None


def _head_dim(platform: Platform, call: AttentionCall) -> str | None:
    if call.head_dim is None or call.head_dim in HEAD_DIMS:
        return None
    return f"head_size={call.head_dim} is unsupported (FA3's fp8 kernels take {', '.join(map(str, HEAD_DIMS))})"


BACKEND = register(
    AttentionBackend(
        name="FA3_FP8_ATTN",
        description="FlashAttention-3's fp8 forward (per-head scales, smoothed K): lossy, opt-in only",
        platforms=("cuda",),
        dtypes=(torch.bfloat16,),
        layout="bshd",
        min_capability=(9, 0),
        lossy=True,
        available=_available_fp8,
        head_dim=_head_dim,
        form="op",
        load=lambda: attention_fp8,
    )
)
