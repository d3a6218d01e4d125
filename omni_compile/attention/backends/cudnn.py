"""CUDNN_ATTN: SDPA's cuDNN attention kernel, pinned (`aten._scaled_dot_product_cudnn_attention` on the
same [B, H, S, D] views), on sm80+."""

import torch

from omni_compile.attention.backends.base import HALF, AttentionBackend, AttentionCall
from omni_compile.ops.registry import register
from omni_compile.platform import Platform


def _available(platform: Platform) -> str | None:
    return None if torch.backends.cudnn.is_available() else "this torch build has no cuDNN"


def _head_dim(platform: Platform, call: AttentionCall) -> str | None:
    d = call.head_dim
    if d is None or (d <= 256 and d % 8 == 0):
        return None
    return f"head_size={d} is unsupported (cuDNN attention takes head sizes <= 256 that are multiples of 8)"


def _kv_len(platform: Platform, call: AttentionCall) -> str | None:
    if call.kv_len == 1:
        return "kv_len=1 is unsupported by cuDNN attention (automatic selection routes it to TORCH_SDPA)"
    return None


BACKEND = register(
    AttentionBackend(
        name="CUDNN_ATTN",
        description="SDPA's cuDNN attention kernel, pinned",
        platforms=("cuda",),
        priority={"cuda": 10},
        dtypes=HALF,
        layout="bhsd",
        min_capability=(8, 0),
        available=_available,
        head_dim=_head_dim,
        extra=_kv_len,
        form="cudnn",
    )
)
