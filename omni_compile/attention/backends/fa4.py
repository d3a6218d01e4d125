"""FA4_ATTN: FlashAttention-4 (the flash-attn-4 wheel, CuTe DSL) on sm90 and sm100+. Measured on the H100
it is exact and slower than FA3 at every shape (docs/benchmarks.md), so on Hopper the measured choice
keeps FA3; it is the FlashAttention of Blackwell GPUs, where FA3 does not run."""

from omni_compile.attention.backends.flash_build import FlashBuild, flash_backend
from omni_compile.ops.registry import register

BUILD = FlashBuild(
    backend="FA4_ATTN",
    op_name="fa4",
    label="FlashAttention-4 (CuTe DSL)",
    description="FlashAttention-4 (flash-attn-4, CuTe DSL)",
    modules=("flash_attn.cute",),
    majors=(9, 10, 11),
    install="pip install flash-attn-4",
    # sm100+: head sizes that are multiples of 8 up to 128, or 256
    head_dims=((10, lambda d: d % 8 == 0 and (8 <= d <= 128 or d == 256), "multiples of 8 up to 128, or 256"),),
)

BACKEND = register(flash_backend(BUILD, priority={"cuda": 30}))
