"""`omni_compile::rms_norm_rope` and `omni_compile::layer_norm_rope`: the norm of q or k (RMSNorm, or LayerNorm
per head), then the rotary embedding, in one pass.

    n   = rms_norm(x)  (per head over head_dim, or across heads over H*D), rounded to its dtype,
          optionally followed along the sequence by rms_norm(x_tail) with its own weight (FLUX's joint
          attention normalises text and image queries separately, then concatenates them);
    out[..., 2i]   = n[2i] * cos_e[s, i] - n[2i+1] * sin_e[s, i]
    out[..., 2i+1] = n[2i+1] * cos_o[s, i] + n[2i] * sin_o[s, i]

computed in fp32 and rounded once to n's dtype. `cos` and `sin` are the model's [S, D] tables, and
`tables` says how a pair reads them:

- "per_element" (FLUX's `apply_rotary_emb(use_real_unbind_dim=-1)`): each output element has its own
  column, cos_e = cos[:, 0::2], cos_o = cos[:, 1::2], sin_e = sin[:, 0::2], sin_o = sin[:, 1::2];
- "per_pair" (Wan's rotary embedding): both elements of pair i use cos[:, 2i] and sin[:, 2i+1];
- "halves" (rotate-half RoPE, `apply_rotary_emb(use_real_unbind_dim=-2)`: Cosmos, CogView4, OmniGen): pair i
  is elements (i, i + D/2) instead of (2i, 2i + 1), each with its own column: out[..., i] = n[i] * cos[:, i] -
  n[i + D/2] * sin[:, i], out[..., i + D/2] = n[i + D/2] * cos[:, i + D/2] + n[i] * sin[:, i + D/2];
- "per_head" (Mochi: a table per head, [S, H, D/2]): both elements of pair i of head h use cos[s, h, i] and
  sin[s, h, i].

Shapes: `x` [B, S1, H, D], `x_tail` [B, S2, H, D] or None, tables [S1 + S2, D] (any strides),
output [B, S1 + S2, H, D] contiguous. `weight` is [D] (per head) or [H * D] (`across_heads=True`),
or None. The RMSNorm rounding follows `omni_compile::rms_norm` (`cast_before_weight`).

`layer_norm_rope(x, weight, bias, cos, sin, eps, tables, start)` is the same with `torch.nn.functional.layer_norm`
over head_dim (the QK-norm of CogView4 and HunyuanDiT), with or without the affine weight and bias ([D]): mean and
variance in fp32, the affine applied in fp32, rounded once to x's dtype (torch's LayerNorm), then rotated as above,
the tokens from `start` on only (CogView4 rotates the image tokens after the text): x [B, S, H, D], tables
[S - start, D], row s - start for token s. One tensor, no tail, per head only.
"""

from __future__ import annotations

import torch

from omni_compile.ops.registry import FusedOp, register_fused_op
from omni_compile.ops.rms_norm import rms_norm_native, rms_norm_out_dtype

TABLES = ("per_element", "per_pair", "halves", "per_head")


def _norm(x, weight, eps, cast_before_weight, across_heads):
    if across_heads:
        b, s, h, d = x.shape
        return rms_norm_native(x.reshape(b, s, h * d), weight, eps, cast_before_weight).reshape(b, s, h, d)
    return rms_norm_native(x, weight, eps, cast_before_weight)


def rms_norm_rope_native(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    x_tail: torch.Tensor | None,
    weight_tail: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
    across_heads: bool,
    tables: str,
) -> torch.Tensor:
    n = _norm(x, weight, eps, cast_before_weight, across_heads)
    if x_tail is not None:
        n = torch.cat([n, _norm(x_tail, weight_tail, eps, cast_before_weight, across_heads)], dim=1)
    return rotate(n, cos, sin, tables)


def rotate(n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: str) -> torch.Tensor:
    """The rotary embedding of the normalised n [B, S, H, D] with [S, D] tables ([S, H, D/2] per head) read as
    `tables` says, computed in fp32 and rounded once to n's dtype."""
    if tables == "per_head":  # pair i of head h: cos[s, h, i], sin[s, h, i]
        c, s = cos.to(torch.float32)[None], sin.to(torch.float32)[None]
        ne, no = n[..., 0::2].to(torch.float32), n[..., 1::2].to(torch.float32)
        return torch.stack([ne * c - no * s, no * c + ne * s], dim=-1).flatten(-2).to(n.dtype)
    c = cos.to(torch.float32)[None, :, None, :]
    s = sin.to(torch.float32)[None, :, None, :]
    if tables == "halves":  # pair i is (i, i + D/2)
        d = n.shape[-1] // 2
        first, second = n[..., :d].to(torch.float32), n[..., d:].to(torch.float32)
        out_first = first * c[..., :d] - second * s[..., :d]
        out_second = second * c[..., d:] + first * s[..., d:]
        return torch.cat([out_first, out_second], dim=-1).to(n.dtype)
    ne = n[..., 0::2].to(torch.float32)
    no = n[..., 1::2].to(torch.float32)
    ce, so = c[..., 0::2], s[..., 1::2]
    if tables == "per_pair":
        co, se = ce, so
    else:
        co, se = c[..., 1::2], s[..., 0::2]
    out_even = ne * ce - no * se
    out_odd = no * co + ne * so
    return torch.stack([out_even, out_odd], dim=-1).flatten(-2).to(n.dtype)


@torch.library.custom_op("omni_compile::rms_norm_rope", mutates_args=())
def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    x_tail: torch.Tensor | None,
    weight_tail: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    cast_before_weight: bool,
    across_heads: bool,
    tables: str,
) -> torch.Tensor:
    """RMSNorm then interleaved RoPE; see the module docstring."""
    return rms_norm_rope_native(x, weight, x_tail, weight_tail, cos, sin, eps, cast_before_weight, across_heads, tables)


@rms_norm_rope.register_fake
def _rms_norm_rope_fake(x, weight, x_tail, weight_tail, cos, sin, eps, cast_before_weight, across_heads, tables):
    b, s, h, d = x.shape
    s_total = s + (x_tail.shape[1] if x_tail is not None else 0)
    return x.new_empty((b, s_total, h, d), dtype=rms_norm_out_dtype(x, weight, cast_before_weight))


RMS_NORM_ROPE = register_fused_op(
    FusedOp(
        name="rms_norm_rope",
        overload=torch.ops.omni_compile.rms_norm_rope.default,
        arg_names=(
            "x",
            "weight",
            "x_tail",
            "weight_tail",
            "cos",
            "sin",
            "eps",
            "cast_before_weight",
            "across_heads",
            "tables",
        ),
        native=rms_norm_rope_native,
    )
)


def layer_norm_rope_native(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    tables: str,
    start: int,
) -> torch.Tensor:
    n = torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if not start:
        return rotate(n, cos, sin, tables)
    return torch.cat([n[:, :start], rotate(n[:, start:], cos, sin, tables)], dim=1)


@torch.library.custom_op("omni_compile::layer_norm_rope", mutates_args=())
def layer_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    tables: str,
    start: int,
) -> torch.Tensor:
    """LayerNorm per head, then the rotary embedding of the tokens from `start` on; see the module docstring."""
    return layer_norm_rope_native(x, weight, bias, cos, sin, eps, tables, start)


@layer_norm_rope.register_fake
def _layer_norm_rope_fake(x, weight, bias, cos, sin, eps, tables, start):
    return x.new_empty(x.shape)


LAYER_NORM_ROPE = register_fused_op(
    FusedOp(
        name="layer_norm_rope",
        overload=torch.ops.omni_compile.layer_norm_rope.default,
        arg_names=("x", "weight", "bias", "cos", "sin", "eps", "tables", "start"),
        native=layer_norm_rope_native,
    )
)
