"""FLASH_ATTN: FlashAttention-2 (the flash-attn package) on sm80 to sm90."""

from omni_compile.attention.backends import flash_build
from omni_compile.attention.backends.flash_build import FlashBuild, flash_backend
from omni_compile.ops.registry import register

BUILD = FlashBuild(
    backend="FLASH_ATTN",
    op_name="fa2",
    label="FlashAttention-2",
    description="FlashAttention-2 (the flash-attn package)",
    modules=("flash_attn",),
    majors=(8, 9),
    install="pip install flash-attn",
    extra_module_check=lambda name: flash_build.spec_is_package(name),
)

BACKEND = register(flash_backend(BUILD, priority={"cuda": 20}))
