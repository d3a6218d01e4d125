"""Attention backends per platform, their selection per role, and their ops.

`backends/` holds one file per backend (its requirements, rank per platform and how it is called), each
an implementation of the op `attention` in the implementation registry (`omni_compile.ops.registry`);
`config` the `{"default": ..., "per_role": ...}` configuration; `select` the choice (explicit fails
closed, `auto` is the registry's selection, measured on a GPU by `measure`). The kernels live in
`triton_attn` (our Triton flash-attention forward) and `sage` (INT8 Q·K, lossy); FlashAttention builds are
custom ops over the installed packages (`backends/flash_build.py`). The graph pass that routes SDPA calls
to them is `omni_compile.passes.attention`. Importing this package imports no kernel module.
"""

from omni_compile.attention.backends import BACKENDS, AttentionBackend, AttentionCall, preference
from omni_compile.attention.config import AttentionConfig, BackendChoice, parse_attention_text
from omni_compile.attention.select import AttentionBackendError, AttentionResolution, resolve

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionCall",
    "AttentionConfig",
    "AttentionResolution",
    "BackendChoice",
    "parse_attention_text",
    "preference",
    "resolve",
]
