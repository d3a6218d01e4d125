"""FlashAttention builds behind custom ops: `omni_compile::attention_fa2` (FLASH_ATTN), `attention_fa3`
(FA3_ATTN) and `attention_fa4` (FA4_ATTN).

Each op takes [B, S, H, D] q/k/v (FlashAttention's own layout, the one diffusers' projections write) and
returns [B, S_q, H, D_v], contiguous. Inductor calls the ops as external kernels, inside compiled regions
in the JIT path and in the standalone files of CUDA artifacts: the ops are registered when this module
is imported (the attention pass and the artifact loader import it), and the FlashAttention package is
imported on the first call only, so a file that calls an op loads anywhere and a missing package is an
error that names it (the loader checks first, `artifact.loader`).

FA3 goes through `_flash_attn_forward`, the build's own forward op (what `flash_attn_func` calls under
its autograd function), once with the arguments a diffusion transformer needs: no causal mask, no
window, the softmax scale of the call.
"""

from __future__ import annotations

import functools
import importlib

import torch

from omni_compile.attention.backends import FLASH_BUILDS
from omni_compile.errors import OmniCompileError


def _module(backend: str):
    build = FLASH_BUILDS[backend]
    name = build.module()
    if name is None:
        raise OmniCompileError(
            f"{backend} was compiled into this graph but {build.label} cannot be imported here ({build.install})"
        )
    return importlib.import_module(name)


@functools.cache
def forward(backend: str):
    """fn(q, k, v, scale) -> out for one backend's installed build (imported on first use)."""
    module = _module(backend)
    if backend == "FA3_ATTN":
        fwd = module._flash_attn_forward

        def fa3(q, k, v, scale):
            return fwd(q, k, v, softmax_scale=scale, causal=False)[0]

        return fa3
    func = module.flash_attn_func

    def call(q, k, v, scale):
        out = func(q, k, v, softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out

    return call


def _define(backend: str, op_name: str):
    @torch.library.custom_op(f"omni_compile::{op_name}", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = forward(backend)(q, k, v, scale)
        return out if out.is_contiguous() else out.contiguous()

    @op.register_fake
    def _(q, k, v, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    return op


attention_fa2 = _define("FLASH_ATTN", "attention_fa2")
attention_fa3 = _define("FA3_ATTN", "attention_fa3")
attention_fa4 = _define("FA4_ATTN", "attention_fa4")

OPS = {"FLASH_ATTN": attention_fa2, "FA3_ATTN": attention_fa3, "FA4_ATTN": attention_fa4}
