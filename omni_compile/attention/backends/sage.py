"""SAGE_ATTN: INT8 Q·K (per-block scales, smoothed K) and half-precision P·V in Triton
(`attention.sage`): lossy, so never chosen automatically; by name on CUDA sm80+ and ROCm (on the CPU
under TRITON_INTERPRET=1)."""

from omni_compile.attention.backends.base import HALF, AttentionBackend, head_dim_range, needs_triton
from omni_compile.ops.registry import register


def _load():
    import torch

    from omni_compile.attention import sage

    return torch.ops.omni_compile.attention_sage_triton.default, sage._sage_impl


BACKEND = register(
    AttentionBackend(
        name="SAGE_ATTN",
        description="INT8 Q·K (per-block scales, smoothed K) and half-precision P·V in Triton: lossy, opt-in only",
        platforms=("cuda", "rocm"),
        dtypes=HALF,
        layout="bshd",
        min_capability=(8, 0),
        masks=("key_padding",),
        lossy=True,
        interpretable=True,
        available=needs_triton,
        head_dim=head_dim_range(16, 256, "the SAGE kernel"),
        form="kernel",
        load=_load,
    )
)
