"""Attention backends per platform, their selection per role, and their ops.

`backends` declares each backend's requirements and the platforms' preference lists; `config` the
`{"default": ..., "per_role": ...}` configuration; `select` the choice (explicit fails closed, `auto`
falls back and logs why). The ops live in `flash` (installed FlashAttention packages), `triton_attn`
(our Triton flash-attention forward) and `sage` (INT8 Q·K, lossy); the graph pass that routes SDPA
calls to them is `omni_compile.passes.attention`. Importing this package imports no kernel module.
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
