"""Triton kernel for `omni_compile::rms_norm_rope`, and in its LAYER form for `omni_compile::layer_norm_rope`
(each head centred before its sum of squares, the bias added after the weight; the tokens before START are
normalised and not rotated, token s from START on reads table row s - START; START is 0 for rms_norm_rope).

Tiling: a program takes one token (b, s) of the output and BLOCK_H of its heads (all heads with
`across_heads`, whose statistics span H * D; per head, BLOCK_H is next_power_of_2(H) when the
token's tile stays within ROPE_TILE elements, else a power of two dividing H: FLUX's 24 heads of 128
are 3 programs of 8). The tile is held as two [BLOCK_H, BLOCK_HALF] halves, the even and the odd
elements of each head (BLOCK_HALF = next power of two of D / 2, masked). With SPLIT (the default) x
is loaded as one contiguous [BLOCK_H, 2*BLOCK_HALF] tile (vectorised) and split into the two halves
in registers, and the output is joined back the same way; without it, the halves are loaded and
stored through stride-2 pointers. The token picks its source by index: s < S1 reads x[b, s], else
x_tail[b, s - S1], each with its own weight. The [S, D] cos/sin tables are read at row s with their
own strides and dtypes (per element: columns 2i and 2i + 1 of each; per pair: cos column 2i and sin
column 2i + 1 for both elements of a pair) and broadcast over the heads. The op takes the whole
tables, never strided views of them, so no input is passed twice and none needs a storage offset.
With `tables="halves"` (rotate-half RoPE) a pair is elements (i, i + D/2) of a head: the halves are loaded
and stored as two contiguous [BLOCK_H, BLOCK_HALF] tiles, and the tables read at columns i and i + D/2. With
`tables="per_head"` ([S, H, D/2] tables, Mochi's) the table tile is [BLOCK_H, BLOCK_HALF], one row per head.

A paired launch (`_rms_norm_rope_pair_impl`, PAIR) serves two calls that share the tables and flags, the q
and k of one attention: each program normalises and rotates its token's q, then its k, with the table
columns loaded once.

Rounding (see `omni_compile.ops.rms_norm_rope`): the RMSNorm follows `omni_compile::rms_norm` and is
rounded to its output dtype n; the rotation is computed in fp32 from n and the tables and rounded
once to n's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_compile.ops.kernels._common import (
    EMULATE_RTNE,
    MAX_BLOCK,
    PLATFORMS,
    cast_to,
    device_reason,
    dtype_reason,
    first,
    launcher,
    next_pow2,
    round_to,
    unused,
    width_reason,
)
from omni_compile.ops.registry import Kernel, PairedLaunch, register
from omni_compile.ops.rms_norm import rms_norm_out_dtype
from omni_compile.ops.rms_norm_rope import TABLES


@triton.jit
def _param_halves(
    p_ptr,
    heads,
    hmask,
    D,
    SP: tl.constexpr,
    ACROSS: tl.constexpr,
    SPLIT: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """A norm's per-channel parameter (weight or bias), [D] shared by the heads or [H * D] across heads, as the
    fp32 halves the normalised values are held in: (even, odd) elements, or with HALVES (first, second) halves."""
    mask = hmask[:, None] & (tl.arange(0, BLOCK_HALF) < D // 2)[None, :]
    if HALVES:
        half = tl.arange(0, BLOCK_HALF)
        if ACROSS:
            ptrs = p_ptr + (heads[:, None] * D + half[None, :]) * SP
            pe = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            po = tl.load(ptrs + (D // 2) * SP, mask=mask, other=0.0).to(tl.float32)
        else:
            ptrs = p_ptr + half * SP
            pe = tl.load(ptrs, mask=half < D // 2, other=0.0).to(tl.float32)[None, :]
            po = tl.load(ptrs + (D // 2) * SP, mask=half < D // 2, other=0.0).to(tl.float32)[None, :]
    elif SPLIT:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        if ACROSS:
            p = tl.load(p_ptr + (heads[:, None] * D + cols[None, :]) * SP, mask=hmask[:, None] & (cols < D)[None, :],
                        other=0.0)  # fmt: skip
            pe, po = tl.split(tl.reshape(p.to(tl.float32), (BLOCK_H, BLOCK_HALF, 2)))
        else:
            p = tl.load(p_ptr + cols * SP, mask=cols < D, other=0.0)
            pe, po = tl.split(tl.reshape(p.to(tl.float32), (BLOCK_HALF, 2)))
            pe = pe[None, :]
            po = po[None, :]
    else:
        half = tl.arange(0, BLOCK_HALF)
        if ACROSS:
            ptrs = p_ptr + (heads[:, None] * D + (2 * half)[None, :]) * SP
            pe = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            po = tl.load(ptrs + SP, mask=mask, other=0.0).to(tl.float32)
        else:
            ptrs = p_ptr + (2 * half) * SP
            pe = tl.load(ptrs, mask=half < D // 2, other=0.0).to(tl.float32)[None, :]
            po = tl.load(ptrs + SP, mask=half < D // 2, other=0.0).to(tl.float32)[None, :]
    return pe, po


@triton.jit
def _rope_normed(
    base,
    s_h,
    w_ptr,
    b_ptr,
    heads,
    hmask,
    H,
    D,
    eps,
    SD: tl.constexpr,
    SW: tl.constexpr,
    SB: tl.constexpr,
    N_DTYPE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    LAYER: tl.constexpr,
    CAST_BEFORE_W: tl.constexpr,
    ACROSS: tl.constexpr,
    SPLIT: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """RMSNorm (or with LAYER, LayerNorm per head) of BLOCK_H heads of one token at `base`, rounded to N_DTYPE: the
    two fp32 halves of each pair, (even, odd) elements, or with HALVES (first, second) halves of the head."""
    head_off = heads.to(tl.int64)[:, None] * s_h
    half = tl.arange(0, BLOCK_HALF)
    pmask = hmask[:, None] & (half < D // 2)[None, :]  # a pair's two elements are both in the head or both out
    if HALVES:
        ptrs = base + (head_off + half[None, :] * SD)
        xe = tl.load(ptrs, mask=pmask, other=0.0).to(tl.float32)
        xo = tl.load(ptrs + (D // 2) * SD, mask=pmask, other=0.0).to(tl.float32)
    elif SPLIT:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        mask = hmask[:, None] & (cols < D)[None, :]
        x = tl.load(base + (head_off + cols[None, :] * SD), mask=mask, other=0.0).to(tl.float32)
        xe, xo = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
    else:
        ptrs = base + (head_off + (2 * half)[None, :] * SD)
        xe = tl.load(ptrs, mask=pmask, other=0.0).to(tl.float32)
        xo = tl.load(ptrs + SD, mask=pmask, other=0.0).to(tl.float32)
    if LAYER:  # centred per head (the padding stays 0)
        mean = (tl.sum(xe, axis=1) + tl.sum(xo, axis=1)) / D
        xe = tl.where(pmask, xe - mean[:, None], 0.0)
        xo = tl.where(pmask, xo - mean[:, None], 0.0)
    ss = tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)
    if ACROSS:
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / (H * D) + eps)
        ye = xe * rstd
        yo = xo * rstd
    else:
        rstd = tl.rsqrt(ss / D + eps)
        ye = xe * rstd[:, None]
        yo = xo * rstd[:, None]
    if HAS_W:
        we, wo = _param_halves(w_ptr, heads, hmask, D, SW, ACROSS, SPLIT, HALVES, BLOCK_H, BLOCK_HALF)
        if CAST_BEFORE_W:
            ye = round_to(ye, w_ptr.dtype.element_ty, EMULATE_RTNE)
            yo = round_to(yo, w_ptr.dtype.element_ty, EMULATE_RTNE)
        ye = ye * we
        yo = yo * wo
    if HAS_B:
        be, bo = _param_halves(b_ptr, heads, hmask, D, SB, ACROSS, SPLIT, HALVES, BLOCK_H, BLOCK_HALF)
        ye = ye + be
        yo = yo + bo
    return round_to(ye, N_DTYPE, EMULATE_RTNE), round_to(yo, N_DTYPE, EMULATE_RTNE)


@triton.jit
def _normed_token(
    x_ptr,
    w_ptr,
    b_ptr,
    xt_ptr,
    wt_ptr,
    b,
    s,
    S1,
    sx_b,
    sx_s,
    sx_h,
    sxt_b,
    sxt_s,
    sxt_h,
    heads,
    hmask,
    H,
    D,
    eps,
    SXD: tl.constexpr,
    SXTD: tl.constexpr,
    SW: tl.constexpr,
    SB: tl.constexpr,
    SWT: tl.constexpr,
    N_DTYPE: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_WT: tl.constexpr,
    LAYER: tl.constexpr,
    CAST_BEFORE_W: tl.constexpr,
    ACROSS: tl.constexpr,
    SPLIT: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """The normalised halves of token (b, s)'s pairs: read from x below S1, else from x_tail at s - S1 (a tail has
    a weight and no bias: LAYER takes no tail)."""
    if HAS_TAIL:
        if s < S1:
            ne, no = _rope_normed(
                x_ptr + (b * sx_b + s.to(tl.int64) * sx_s), sx_h, w_ptr, b_ptr, heads, hmask, H, D, eps,
                SXD, SW, SB, N_DTYPE, HAS_W, HAS_B, LAYER, CAST_BEFORE_W, ACROSS, SPLIT, HALVES, BLOCK_H, BLOCK_HALF,
                EMULATE_RTNE,
            )  # fmt: skip
        else:
            ne, no = _rope_normed(
                xt_ptr + (b * sxt_b + (s - S1).to(tl.int64) * sxt_s), sxt_h, wt_ptr, b_ptr, heads, hmask, H, D, eps,
                SXTD, SWT, SB, N_DTYPE, HAS_WT, False, LAYER, CAST_BEFORE_W, ACROSS, SPLIT, HALVES, BLOCK_H,
                BLOCK_HALF, EMULATE_RTNE,
            )  # fmt: skip
    else:
        ne, no = _rope_normed(
            x_ptr + (b * sx_b + s.to(tl.int64) * sx_s), sx_h, w_ptr, b_ptr, heads, hmask, H, D, eps,
            SXD, SW, SB, N_DTYPE, HAS_W, HAS_B, LAYER, CAST_BEFORE_W, ACROSS, SPLIT, HALVES, BLOCK_H, BLOCK_HALF,
            EMULATE_RTNE,
        )  # fmt: skip
    return ne, no


@triton.jit
def _store_rotated(
    out_ptr,
    tok,
    heads,
    hmask,
    H,
    D,
    ne,
    no,
    ce,
    co,
    se,
    so,
    SPLIT: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """Rotate the normalised halves with the token's table columns and store them at token `tok` of `out`."""
    n_dtype = out_ptr.dtype.element_ty
    out_e = cast_to(ne * ce - no * se, n_dtype, EMULATE_RTNE)
    out_o = cast_to(no * co + ne * so, n_dtype, EMULATE_RTNE)
    out_base = out_ptr + tok.to(tl.int64) * H * D + heads.to(tl.int64)[:, None] * D
    if HALVES:
        half = tl.arange(0, BLOCK_HALF)
        mask = hmask[:, None] & (half < D // 2)[None, :]
        tl.store(out_base + half[None, :], out_e, mask=mask)
        tl.store(out_base + (half + D // 2)[None, :], out_o, mask=mask)
    elif SPLIT:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        out = tl.reshape(tl.join(out_e, out_o), (BLOCK_H, 2 * BLOCK_HALF))
        tl.store(out_base + cols[None, :], out, mask=hmask[:, None] & (cols < D)[None, :])
    else:
        half = tl.arange(0, BLOCK_HALF)
        mask = hmask[:, None] & (half < D // 2)[None, :]
        tl.store(out_base + (2 * half)[None, :], out_e, mask=mask)
        tl.store(out_base + (2 * half + 1)[None, :], out_o, mask=mask)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,
    w_ptr,
    bx_ptr,
    xt_ptr,
    wt_ptr,
    y_ptr,
    wy_ptr,
    by_ptr,
    yt_ptr,
    wyt_ptr,
    c_ptr,
    s_ptr,
    out_ptr,
    outy_ptr,
    S1,
    S_total,
    START,
    H,
    D,
    sx_b,
    sx_s,
    sx_h,
    sxt_b,
    sxt_s,
    sxt_h,
    sy_b,
    sy_s,
    sy_h,
    syt_b,
    syt_s,
    syt_h,
    sc,
    ss,
    sch,
    ssh,
    eps,
    SXD: tl.constexpr,
    SXTD: tl.constexpr,
    SW: tl.constexpr,
    SBX: tl.constexpr,
    SWT: tl.constexpr,
    SYD: tl.constexpr,
    SYTD: tl.constexpr,
    SWY: tl.constexpr,
    SBY: tl.constexpr,
    SWYT: tl.constexpr,
    SCD: tl.constexpr,
    SSD: tl.constexpr,
    PER_PAIR: tl.constexpr,
    PER_HEAD: tl.constexpr,
    HALVES: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_BX: tl.constexpr,
    HAS_WT: tl.constexpr,
    PAIR: tl.constexpr,
    HAS_WY: tl.constexpr,
    HAS_BY: tl.constexpr,
    HAS_WYT: tl.constexpr,
    LAYER: tl.constexpr,
    CAST_BEFORE_W: tl.constexpr,
    ACROSS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """One token, BLOCK_H heads a program: RMSNorm, or with LAYER LayerNorm (rounded to n's dtype), then the
    rotation; with PAIR, the same for y (its own weights, output `outy`) with the table columns read once."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64, which would make the norm fp64
    tok = tl.program_id(0)
    b = (tok // S_total).to(tl.int64)
    s = tok % S_total
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    ne, no = _normed_token(
        x_ptr, w_ptr, bx_ptr, xt_ptr, wt_ptr, b, s, S1, sx_b, sx_s, sx_h, sxt_b, sxt_s, sxt_h, heads, hmask, H, D,
        eps, SXD, SXTD, SW, SBX, SWT, out_ptr.dtype.element_ty, HAS_TAIL, HAS_W, HAS_BX, HAS_WT, LAYER,
        CAST_BEFORE_W, ACROSS, SPLIT, HALVES, BLOCK_H, BLOCK_HALF, EMULATE_RTNE,
    )  # fmt: skip
    half = tl.arange(0, BLOCK_HALF)
    hm = half < D // 2
    s64 = s.to(tl.int64)
    # Row s of the [S, D] tables: per element (FLUX), each output element has its own cos/sin column;
    # per pair (Wan), both elements of pair i use cos[2i] and sin[2i + 1].
    # Rotate-half (HALVES): pair i is columns (i, i + D/2), each with its own column.
    # Tokens before START are not rotated (their rows: cos 1 and sin 0, the normalised value exactly); token s from
    # START on reads table row s - START.
    rotated = s >= START
    row = tl.where(rotated, s64 - START, 0)
    c_row = c_ptr + row * sc
    s_row = s_ptr + row * ss
    if PER_HEAD:  # [S, H, D/2] tables: pair i of head h reads cos[s, h, i] and sin[s, h, i]
        pm = hmask[:, None] & hm[None, :]
        ce = tl.load(c_row + (heads.to(tl.int64)[:, None] * sch + half[None, :] * SCD), mask=pm, other=0.0)
        se = tl.load(s_row + (heads.to(tl.int64)[:, None] * ssh + half[None, :] * SSD), mask=pm, other=0.0)
        ce = ce.to(tl.float32)
        se = se.to(tl.float32)
        co = ce
        so = se
    elif HALVES:
        ce = tl.load(c_row + half * SCD, mask=hm, other=0.0).to(tl.float32)[None, :]
        co = tl.load(c_row + (half + D // 2) * SCD, mask=hm, other=0.0).to(tl.float32)[None, :]
        se = tl.load(s_row + half * SSD, mask=hm, other=0.0).to(tl.float32)[None, :]
        so = tl.load(s_row + (half + D // 2) * SSD, mask=hm, other=0.0).to(tl.float32)[None, :]
    else:
        ce = tl.load(c_row + (2 * half) * SCD, mask=hm, other=0.0).to(tl.float32)[None, :]
        so = tl.load(s_row + (2 * half + 1) * SSD, mask=hm, other=0.0).to(tl.float32)[None, :]
        if PER_PAIR:
            co = ce
            se = so
        else:
            co = tl.load(c_row + (2 * half + 1) * SCD, mask=hm, other=0.0).to(tl.float32)[None, :]
            se = tl.load(s_row + (2 * half) * SSD, mask=hm, other=0.0).to(tl.float32)[None, :]
    if START > 0:  # the unrotated tokens (their loads read row 0): cos 1, sin 0
        ce = tl.where(rotated, ce, 1.0)
        co = tl.where(rotated, co, 1.0)
        se = tl.where(rotated, se, 0.0)
        so = tl.where(rotated, so, 0.0)
    _store_rotated(
        out_ptr, tok, heads, hmask, H, D, ne, no, ce, co, se, so, SPLIT, HALVES, BLOCK_H, BLOCK_HALF, EMULATE_RTNE
    )
    if PAIR:
        ye, yo = _normed_token(
            y_ptr, wy_ptr, by_ptr, yt_ptr, wyt_ptr, b, s, S1, sy_b, sy_s, sy_h, syt_b, syt_s, syt_h, heads, hmask, H,
            D, eps, SYD, SYTD, SWY, SBY, SWYT, outy_ptr.dtype.element_ty, HAS_TAIL, HAS_WY, HAS_BY, HAS_WYT, LAYER,
            CAST_BEFORE_W, ACROSS, SPLIT, HALVES, BLOCK_H, BLOCK_HALF, EMULATE_RTNE,
        )  # fmt: skip
        _store_rotated(
            outy_ptr, tok, heads, hmask, H, D, ye, yo, ce, co, se, so, SPLIT, HALVES, BLOCK_H, BLOCK_HALF, EMULATE_RTNE
        )


def supports(x, weight, x_tail, weight_tail, cos, sin, eps, cast_before_weight, across_heads, tables,
             start: int = 0) -> str | None:  # fmt: skip
    """None when the kernel handles these inputs (real or fake tensors), else the reason it does not (`start`: the
    tables have rows for the tokens from it on)."""
    if tables not in TABLES:
        return f"tables={tables!r}; the kernel reads {', '.join(map(repr, TABLES))} tables"
    named = {"x": x, "weight": weight, "x_tail": x_tail, "weight_tail": weight_tail, "cos": cos, "sin": sin}
    reason = first(
        *(dtype_reason(name, t) for name, t in named.items()),
        *(device_reason(name, t, x) for name, t in named.items() if name != "x"),
    )
    if reason:
        return reason
    if x.dim() != 4:
        return f"x has shape {tuple(x.shape)}; the Triton kernel takes [B, S, H, D]"
    B, S1, H, D = x.shape
    if D % 2:
        return f"head_dim {D} is odd; the interleaved rotary embedding needs an even head_dim"
    reason = width_reason("a token's H * D" if across_heads else "head_dim", H * D if across_heads else D)
    if reason:
        return reason
    if next_pow2(H) * next_pow2(D) > MAX_BLOCK and across_heads:
        return f"{H} heads x {D} pad to more than {MAX_BLOCK} elements, more than one program holds"
    S = S1
    if x_tail is not None:
        if x_tail.dim() != 4 or x_tail.shape[0] != B or tuple(x_tail.shape[2:]) != (H, D):
            return f"x_tail has shape {tuple(x_tail.shape)}, expected [{B}, S2, {H}, {D}]"
        if x_tail.dtype != x.dtype:
            return f"x_tail has dtype {x_tail.dtype}, x {x.dtype}"
        if rms_norm_out_dtype(x_tail, weight_tail, cast_before_weight) != rms_norm_out_dtype(
            x, weight, cast_before_weight
        ):
            return "the norms of x and x_tail round to different dtypes (weight and weight_tail dtypes differ)"
        S += x_tail.shape[1]
    elif weight_tail is not None:
        return "weight_tail is given without x_tail"
    w_shape = (H * D,) if across_heads else (D,)
    for name, w in (("weight", weight), ("weight_tail", weight_tail)):
        if w is not None and tuple(w.shape) != w_shape:
            return f"{name} has shape {tuple(w.shape)}, expected {w_shape}"
    want = (S - start, H, D // 2) if tables == "per_head" else (S - start, D)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            return f"{name} has shape {tuple(t.shape)}, expected {want}"
    return None


def supports_pair(x, weight, x_tail, weight_tail, y, weight_y, y_tail, weight_y_tail, cos, sin, eps,
                  cast_before_weight, across_heads, tables) -> str | None:  # fmt: skip
    """None when one launch can serve both calls (x's and y's, the rest shared), else the reason."""
    shared = (cos, sin, eps, cast_before_weight, across_heads, tables)
    reason = first(
        supports(x, weight, x_tail, weight_tail, *shared), supports(y, weight_y, y_tail, weight_y_tail, *shared)
    )
    if reason:
        return reason
    if tuple(y.shape) != tuple(x.shape):
        return f"y has shape {tuple(y.shape)}, x {tuple(x.shape)}"
    if (x_tail is None) != (y_tail is None) or (x_tail is not None and x_tail.shape[1] != y_tail.shape[1]):
        return "x and y differ in their tails"
    return None


# Elements of one program's tile: 8 heads of 128 (FLUX, per head), or all 16 (padded) of Wan's 12.
ROPE_TILE = 1024


def _tiling(H: int, D: int, across: bool) -> tuple[int, int, int, bool]:
    """(BLOCK_H, BLOCK_HALF, num_warps, SPLIT): all heads when across heads or when they fit ROPE_TILE, else
    the largest power of two dividing H that fits; 2 warps up to 2048 elements (measured best on the H200 at
    the FLUX and Wan shapes, against 4 or 8 warps and 4 to 32 heads a program). One head of 2048 or more
    elements a program (a whole token as one head: LTX-Video's q/k over 32 x 64) takes stride-2 halves and
    4 warps (H100, 1 x 2048: 58.8 us against 64.2 with the split load and 2 warps)."""
    block_half = next_pow2(D // 2)
    block_d = 2 * block_half
    if across or next_pow2(H) * block_d <= ROPE_TILE:
        block_h = next_pow2(H)
    else:
        block_h = max(1, min(H & -H, ROPE_TILE // block_d))
    if block_h == 1 and block_d >= 2048:
        return block_h, block_half, 4, False
    num_warps = min(16, max(2, block_h * block_d // 1024))
    return block_h, block_half, num_warps, True


def _strides(t: torch.Tensor, given: object) -> tuple[int, ...]:
    """A 4-d operand's strides, or (0, 0, 0, 1) for the spare that stands in for one not `given`."""
    return tuple(t.stride()) if given is not None else (0, 0, 0, 1)


def _launch(
    x, weight, x_tail, weight_tail, cos, sin, eps, cast_before_weight, across_heads, tables, out, config=None,
    pair=None, layer=False, bias=None, bias_y=None, start=0,
):  # fmt: skip
    """Launch the kernel writing `out` (contiguous [B, S1 + S2, H, D] of n's dtype).

    `pair`: (y, weight_y, y_tail, weight_y_tail, out_y), a second call with the same tables and flags, in the
    same launch (each program reads its token's table columns once for both). `layer`: LayerNorm per head instead
    of RMSNorm, with `bias` (and `bias_y`, y's) added after the weight. `start`: the tokens before it are normalised
    and not rotated, token s from it on reads table row s - start. `config` (tests and benchmarks only) overrides
    BLOCK_H, num_warps and SPLIT.
    """
    B, S1, H, D = x.shape
    s_total = S1 + (x_tail.shape[1] if x_tail is not None else 0)
    block_h, block_half, num_warps, split = _tiling(H, D, across_heads)
    if config:
        block_h = config.get("BLOCK_H", block_h)
        num_warps = config.get("num_warps", num_warps)
        split = config.get("SPLIT", split)
    xt = unused(x) if x_tail is None else x_tail
    w = unused(x) if weight is None else weight
    bx = unused(x) if bias is None else bias
    wt = unused(x) if weight_tail is None else weight_tail
    # unpaired: spares stand for y's pointers, as for a missing weight (PAIR=False never reads or writes them)
    y, weight_y, y_tail, weight_y_tail, out_y = pair if pair is not None else (unused(x), None, None, None, unused(x))
    yt = unused(x) if y_tail is None else y_tail
    wy = unused(x) if weight_y is None else weight_y
    by = unused(x) if bias_y is None else bias_y
    wyt = unused(x) if weight_y_tail is None else weight_y_tail
    sxt, sy, syt = _strides(xt, x_tail), _strides(y, pair), _strides(yt, y_tail)
    per_head = tables == "per_head"
    launcher(_rms_norm_rope_kernel)[(B * s_total, triton.cdiv(H, block_h))](
        x,
        w,
        bx,
        xt,
        wt,
        y,
        wy,
        by,
        yt,
        wyt,
        cos,
        sin,
        out,
        out_y,
        S1,
        s_total,
        start,
        H,
        D,
        *x.stride()[:3],
        *sxt[:3],
        *sy[:3],
        *syt[:3],
        cos.stride(0),
        sin.stride(0),
        cos.stride(1) if per_head else 0,
        sin.stride(1) if per_head else 0,
        eps,
        SXD=x.stride(3),
        SXTD=sxt[3],
        SW=1 if weight is None else weight.stride(0),
        SBX=1 if bias is None else bias.stride(0),
        SWT=1 if weight_tail is None else weight_tail.stride(0),
        SYD=sy[3],
        SYTD=syt[3],
        SWY=1 if weight_y is None else weight_y.stride(0),
        SBY=1 if bias_y is None else bias_y.stride(0),
        SWYT=1 if weight_y_tail is None else weight_y_tail.stride(0),
        SCD=cos.stride(-1),
        SSD=sin.stride(-1),
        PER_PAIR=tables == "per_pair",
        PER_HEAD=per_head,
        HALVES=tables == "halves",
        HAS_TAIL=x_tail is not None,
        HAS_W=weight is not None,
        HAS_BX=bias is not None,
        HAS_WT=weight_tail is not None,
        PAIR=pair is not None,
        HAS_WY=weight_y is not None,
        HAS_BY=bias_y is not None,
        HAS_WYT=weight_y_tail is not None,
        LAYER=bool(layer),
        CAST_BEFORE_W=bool(cast_before_weight),
        ACROSS=bool(across_heads),
        SPLIT=split,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        EMULATE_RTNE=EMULATE_RTNE,
        num_warps=num_warps,
    )
    return out if pair is None else (out, out_y)


def _new_out(x, x_tail, weight, cast_before_weight):
    B, S1, H, D = x.shape
    s_total = S1 + (x_tail.shape[1] if x_tail is not None else 0)
    # new_empty dispatches on x, so under the lowering's functional trace the output is fake like x
    # (a bare torch.empty there would allocate a real tensor).
    return x.new_empty((B, s_total, H, D), dtype=rms_norm_out_dtype(x, weight, cast_before_weight))


def _rms_norm_rope_impl(
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
    """`omni_compile::rms_norm_rope` as one Triton kernel."""
    out = _new_out(x, x_tail, weight, cast_before_weight)
    return _launch(x, weight, x_tail, weight_tail, cos, sin, eps, cast_before_weight, across_heads, tables, out)


def _rms_norm_rope_pair_impl(
    x, weight, x_tail, weight_tail, y, weight_y, y_tail, weight_y_tail, cos, sin, eps, cast_before_weight,
    across_heads, tables,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two `omni_compile::rms_norm_rope` calls that share their tables and flags (the q and k of one
    attention), in one launch: (the call on x, the call on y)."""
    out = _new_out(x, x_tail, weight, cast_before_weight)
    out_y = _new_out(y, y_tail, weight_y, cast_before_weight)
    pair = (y, weight_y, y_tail, weight_y_tail, out_y)
    return _launch(x, weight, x_tail, weight_tail, cos, sin, eps, cast_before_weight, across_heads, tables, out,
                   pair=pair)  # fmt: skip


# The triton_op runs the kernel eagerly and under torch.compile from the start of a graph; the lowering
# pass traces `_rms_norm_rope_impl` itself to put the launch into post-grad graphs (see passes/lower_fused_ops.py).
rms_norm_rope_triton = torch.library.triton_op("omni_compile::rms_norm_rope_triton", mutates_args=())(
    _rms_norm_rope_impl
)


KERNEL = register(
    Kernel(
        op="rms_norm_rope",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.rms_norm_rope_triton.default,
        supports=supports,
        launcher=_rms_norm_rope_impl,
        # q and k of one attention share the rotary tables: one launch reads them once for both
        pair=PairedLaunch(
            own=("x", "weight", "x_tail", "weight_tail"),
            second=("y", "weight_y", "y_tail", "weight_y_tail"),
            launcher=_rms_norm_rope_pair_impl,
            supports=supports_pair,
        ),
        auto_on=("cuda",),
        description="Triton kernel, embedded in Inductor's generated code",
    )
)


def layer_supports(x, weight, bias, cos, sin, eps, tables, start) -> str | None:
    """None when the kernel handles this `layer_norm_rope` call (real or fake tensors), else the reason."""
    if x.dim() == 4 and not 0 <= start < x.shape[1]:
        return f"start={start} is outside the {x.shape[1]} tokens"
    reason = supports(x, weight, None, None, cos, sin, eps, False, False, tables, start=start)
    if reason:
        return reason
    reason = first(dtype_reason("bias", bias), device_reason("bias", bias, x))
    if reason:
        return reason
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        return f"bias has shape {tuple(bias.shape)}, expected ({x.shape[-1]},)"
    return None


def layer_supports_pair(x, weight, bias, y, weight_y, bias_y, cos, sin, eps, tables, start) -> str | None:
    """None when one launch can serve both `layer_norm_rope` calls (x's and y's, the rest shared)."""
    reason = first(layer_supports(x, weight, bias, cos, sin, eps, tables, start),
                   layer_supports(y, weight_y, bias_y, cos, sin, eps, tables, start))  # fmt: skip
    if reason:
        return reason
    return None if tuple(y.shape) == tuple(x.shape) else f"y has shape {tuple(y.shape)}, x {tuple(x.shape)}"


def _layer_norm_rope_impl(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    tables: str,
    start: int,
) -> torch.Tensor:
    """`omni_compile::layer_norm_rope` as one Triton kernel (the RMSNorm kernel's LAYER form)."""
    return layer_launch(x, weight, bias, cos, sin, eps, tables, start, x.new_empty(x.shape))


def layer_launch(x, weight, bias, cos, sin, eps, tables, start, out, config=None):
    """Launch the LAYER form writing `out`, in `layer_norm_rope`'s argument order (`config`: as `_launch`'s)."""
    return _launch(x, weight, None, None, cos, sin, eps, False, False, tables, out, config=config, layer=True,
                   bias=bias, start=start)  # fmt: skip


def _layer_norm_rope_pair_impl(x, weight, bias, y, weight_y, bias_y, cos, sin, eps, tables, start):
    """Two `omni_compile::layer_norm_rope` calls sharing their tables (q and k of one attention), in one launch."""
    out, out_y = x.new_empty(x.shape), y.new_empty(y.shape)
    return _launch(x, weight, None, None, cos, sin, eps, False, False, tables, out, pair=(y, weight_y, None, None, out_y),
                   layer=True, bias=bias, bias_y=bias_y, start=start)  # fmt: skip


layer_norm_rope_triton = torch.library.triton_op("omni_compile::layer_norm_rope_triton", mutates_args=())(
    _layer_norm_rope_impl
)


LAYER_KERNEL = register(
    Kernel(
        op="layer_norm_rope",
        name="triton",
        platforms=PLATFORMS,
        overload=torch.ops.omni_compile.layer_norm_rope_triton.default,
        supports=layer_supports,
        launcher=_layer_norm_rope_impl,
        pair=PairedLaunch(
            own=("x", "weight", "bias"),
            second=("y", "weight_y", "bias_y"),
            launcher=_layer_norm_rope_pair_impl,
            supports=layer_supports_pair,
        ),
        # measured alone on an H100 (run 25a): rotate-half tables 2.65x Inductor's code (CogView4's q), per-element
        # tables 0.83x (HunyuanDiT's, head size 88); inside a compiled model on a GPU it passed for HunyuanDiT, and
        # is not yet checked for the form it is faster on
        auto_on=(),
        manual_reason="its LayerNorm form is not yet checked inside a compiled model on a GPU for rotate-half tables, "
        "the form it is faster on",
        description="Triton kernel (the rms_norm_rope kernel's LayerNorm form), embedded in Inductor's generated code",
    )
)
