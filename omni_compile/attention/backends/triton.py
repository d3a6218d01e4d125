"""TRITON_ATTN: omni-compile's Triton flash-attention forward (`attention.triton_attn`), embedded in
Inductor's code; takes a key-padding mask. Automatic on XPU (no vendor flash kernel there); on CUDA and
ROCm by name (not measured faster than the vendor kernels); on the CPU under TRITON_INTERPRET=1, by name."""

from omni_compile.attention.backends.base import GPU_TRITON, HALF, AttentionBackend, head_dim_range, needs_triton
from omni_compile.ops.registry import register


def _load():
    import torch

    from omni_compile.attention import triton_attn

    return torch.ops.omni_compile.attention_triton.default, triton_attn._attention_impl


BACKEND = register(
    AttentionBackend(
        name="TRITON_ATTN",
        description="omni-compile's Triton flash-attention forward, embedded in Inductor's code",
        platforms=GPU_TRITON,
        priority={"xpu": 10},
        dtypes=HALF,
        layout="bshd",
        masks=("key_padding",),
        interpretable=True,
        available=needs_triton,
        head_dim=head_dim_range(16, 256, "the Triton kernel"),
        form="kernel",
        load=_load,
    )
)
