"""TRITON_ATTN: omni-compile's Triton flash-attention forward (`attention.triton_attn`), embedded in
Inductor's code; takes a key-padding mask or a key bias. Automatic on XPU (no vendor flash kernel there). On
CUDA and ROCm, a measured candidate only for calls with a key bias, which no vendor flash kernel takes (there
it is timed against SDPA, which then runs cuDNN's or the efficient-attention kernel with a bias); for other
calls the vendor kernels measured faster, so it runs there by name. On the CPU under TRITON_INTERPRET=1, by
name."""

from omni_compile.attention.backends.base import (
    GPU_TRITON,
    HALF,
    AttentionBackend,
    AttentionCall,
    head_dim_range,
    needs_triton,
)
from omni_compile.ops.registry import register
from omni_compile.platform import Platform


def _automatic(platform: Platform, call: AttentionCall) -> str | None:
    if platform.kind == "xpu" or call.mask == "key_bias":
        return None
    return (f"automatic on {platform.kind} only for a call with a key bias (the vendor kernels are faster on the "
            "others); choose TRITON_ATTN by name")  # fmt: skip


def _load():
    import torch

    from omni_compile.attention import triton_attn

    return torch.ops.omni_compile.attention_triton.default, triton_attn._attention_impl


BACKEND = register(
    AttentionBackend(
        name="TRITON_ATTN",
        description="omni-compile's Triton flash-attention forward, embedded in Inductor's code",
        platforms=GPU_TRITON,
        priority={"xpu": 10, "cuda": 1, "rocm": 1},
        dtypes=HALF,
        layout="bshd",
        min_capability=(8, 0),  # bf16 tensor-core dots
        masks=("key_padding", "key_bias"),
        automatic=_automatic,
        interpretable=True,
        available=needs_triton,
        head_dim=head_dim_range(16, 256, "the Triton kernel"),
        form="kernel",
        load=_load,
    )
)
