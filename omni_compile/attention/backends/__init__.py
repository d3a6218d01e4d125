"""Attention backends: one file per backend, each an `Implementation` of the op `attention` in the
implementation registry (`omni_compile.ops.registry`), with its requirements and its rank per platform.

| backend | file | runs on | takes | layout |
|---|---|---|---|---|
| TORCH_SDPA | `sdpa.py` | every platform | anything SDPA takes | whatever torch's SDPA dispatch picks (the baseline) |
| CUDNN_ATTN | `cudnn.py` | CUDA, sm80+ | bf16/fp16, head_dim <= 256 and a multiple of 8, no mask, KV length > 1 | SDPA's cuDNN kernel, pinned |
| FA3_ATTN | `fa3.py` | CUDA sm90: fa3-fwd (bf16) or FA3's hopper build (bf16/fp16) | head_dim multiple of 8, 8..256, key-padding mask (seqused_k) | [B, S, H, D] |
| FA4_ATTN | `fa4.py` | CUDA sm90, sm100+: flash-attn-4 (CuTe DSL) | bf16/fp16, head_dim multiple of 8 (sm100+: up to 128, or 256), no mask | [B, S, H, D] |
| FLASH_ATTN | `fa2.py` | CUDA sm80-sm90: FlashAttention-2 (flash-attn) | bf16/fp16, head_dim multiple of 8, 8..256, no mask | [B, S, H, D] |
| TRITON_ATTN | `triton.py` | CUDA, ROCm, XPU (CPU under TRITON_INTERPRET=1, by name) | bf16/fp16, head_dim 16..256, key-padding mask | [B, S, H, D] |
| SAGE_ATTN | `sage.py` | CUDA sm80+, ROCm; lossy, never automatic | bf16/fp16, head_dim 16..256, key-padding mask | [B, S, H, D] |
| FA3_FP8_ATTN | `fa3_fp8.py` | CUDA sm90 with FA3 built with fp8; lossy, never automatic | bf16, head_dim 64/96/128/192/256, no mask | [B, S, H, D] |

Adding a backend is one file here (its requirements, `priority` per platform kind, `form` and `load`)
and one import line below. `preference(platform)` is the order automatic selection walks: the backends
ranked on the platform's kind, best first. Importing this package imports no kernel module.
"""

# registration order is the listing order (`omni-compile attention`)
from omni_compile.attention.backends import sdpa, cudnn, fa3, fa4, fa2, triton, sage, fa3_fp8  # noqa: F401, I001
from omni_compile.attention.backends.base import OP, AttentionBackend, AttentionCall, import_error
from omni_compile.attention.backends.flash_build import FLASH_BUILDS, FlashBuild, installed_flash_modules
from omni_compile.ops.registry import implementations, ranked
from omni_compile.platform import Platform

# name -> backend, in registration order: the registry's entries for the op `attention`
BACKENDS: dict[str, AttentionBackend] = implementations(OP)  # type: ignore[assignment]


def preference(platform: Platform) -> list[str]:
    """The backends automatic selection tries on `platform`, in order (lossy ones never appear)."""
    return [b.name for b in ranked(OP, platform)]


__all__ = [
    "BACKENDS",
    "FLASH_BUILDS",
    "AttentionBackend",
    "AttentionCall",
    "FlashBuild",
    "import_error",
    "installed_flash_modules",
    "preference",
]
