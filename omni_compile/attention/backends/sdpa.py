"""TORCH_SDPA: torch's scaled_dot_product_attention as torch dispatches it, on every platform. The
correctness baseline and the last resort of automatic selection; the attention pass leaves its calls as
they are."""

from omni_compile.attention.backends.base import AttentionBackend
from omni_compile.ops.registry import ALL_PLATFORMS, register

BACKEND = register(
    AttentionBackend(
        name="TORCH_SDPA",
        description="torch's scaled_dot_product_attention as dispatched by torch (the correctness baseline)",
        platforms=ALL_PLATFORMS,
        priority=dict.fromkeys(ALL_PLATFORMS, 0),
        layout="bhsd",
        masks=("key_padding", "key_bias", "other"),
        form="sdpa",
    )
)
