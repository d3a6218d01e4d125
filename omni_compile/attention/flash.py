"""`omni_compile::attention_flash`: the installed FlashAttention package behind one custom op.

The op takes [B, S, H, D] q/k/v (FlashAttention's own layout) and returns [B, S_q, H, D]. Which build
runs is decided per call by the GPU (`installed_flash_library`: FA3, then FA4, then FA2 on Hopper; FA4
on Blackwell; FA2 on Ampere/Ada). Inductor calls the op as an external kernel; the package's own
Python runs per call, as it would in eager code.
"""

from __future__ import annotations

import functools

import torch

from omni_compile.attention.backends import FA_PACKAGES, installed_flash_library
from omni_compile.errors import OmniCompileError
from omni_compile.platform import current_platform


@functools.cache
def flash_function(lib: str):
    """The forward function of one FlashAttention build (imported on first use)."""
    if lib == "fa4":
        from flash_attn.cute import flash_attn_func
    elif lib == "fa3":
        from flash_attn_interface import flash_attn_func
    elif lib == "fa2":
        from flash_attn import flash_attn_func
    else:  # pragma: no cover - the library names are ours
        raise ValueError(lib)
    return flash_attn_func


@torch.library.custom_op("omni_compile::attention_flash", mutates_args=())
def attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    lib = installed_flash_library(current_platform(q.device))
    if lib is None:
        raise OmniCompileError(
            "FLASH_ATTN was compiled in but no FlashAttention package is importable now "
            f"({'; '.join(hint for _, hint in FA_PACKAGES.values())})"
        )
    out = flash_function(lib)(q, k, v, softmax_scale=scale, causal=False)
    return (out[0] if isinstance(out, tuple) else out).contiguous()


@attention_flash.register_fake
def _(q, k, v, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
