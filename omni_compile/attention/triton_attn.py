"""`omni_compile::attention_triton`: our Triton flash-attention forward (non-causal, key-padding mask or key bias).

softmax(q kᵀ · scale) v for q [B, Sq, H, D] and k, v [B, Skv, H, D] (diffusers' layout before its
transposes), each read through its own strides (a [B, H, S, D]-contiguous tensor permuted to BSHD
works as is); the output is a contiguous [B, Sq, H, D] tensor of q's dtype (bf16 or fp16).

Tiling: one program per (BLOCK_M query rows, batch x head); it walks the keys BLOCK_N at a time with
an online softmax (FlashAttention-2): running row max m and sum l in fp32, exp2 with the scale folded
in by log2(e), the accumulator rescaled by exp2(m_old - m_new) before each P·V. Q·Kᵀ and P·V are
`tl.dot`s with fp32 accumulation; P is rounded to v's dtype before P·V. The head dim is padded to
BLOCK_D (next power of two, masked when D is not one); full key blocks run without bounds checks,
the tail block masks keys >= Skv to -inf. A key-padding mask (bool [B, Skv], True = attend) masks
keys the same way; a row whose keys are all masked has l = 0 and gives zeros. A key bias (float [B, H, Skv],
any strides: an additive mask that is the same for every query, such as `(1 - mask) * -10000`) is added
to each score before the softmax, in fp32; -inf entries drop their keys as the mask does. Offsets that can
exceed int32 (batch and head bases, the start of a query block) are int64; the key and value
pointers advance by BLOCK_N rows per step.

Tiling per head dim (`TILING`), swept on an H200 with torch 2.11 and Triton 3.6 (bf16, random normal;
TFLOP/s = 4·B·H·Sq·Skv·D / time; cuDNN attention through SDPA for scale):
- D <= 64: 64 x 64, 4 warps, 3 stages (B=2, S=4097, H=8: 325 TFLOP/s; 128 x 64: 220; cuDNN 390);
- D <= 128: 128 x 128, 8 warps, 3 stages (W1 4608² H=24: 459 TFLOP/s, cuDNN 640; W2 32760² H=12: 485,
  cuDNN 556; W2 cross Skv=512: 299, cuDNN 522; 128 x 64 with 8 warps is within 2% on W1/W2, 4 warps
  with 128-row blocks is 3x slower: spills);
- D > 128: 128 x 64, 8 warps, 2 stages (D=256, S=4096, H=8: 433 TFLOP/s; 64 x 64 with 4 warps: 171).
BLOCK_M and BLOCK_N shrink to the next power of two of short sequences (at least 16). `_launch(...,
config=...)` overrides the choice (bench/attention.py --sweep).

Error (bf16 inputs, random normal, against float64 on the same inputs): rel L2 about 2e-3 in bf16
and 3e-4 in fp16 (P and the output are rounded once each); tests/test_attention_kernels.py bounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_compile.ops.kernels._common import EMULATE_RTNE, cast_to, launcher, next_pow2, unused

HALF = (torch.bfloat16, torch.float16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
LOG2E = 1.4426950408889634
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
INTERPRETED = EMULATE_RTNE  # the kernels run under TRITON_INTERPRET=1 (CPU tests)


@triton.jit
def half_dot(a, b, acc, EMULATE_RTNE: tl.constexpr):
    """`acc + a @ b` for bf16/fp16 tiles with fp32 accumulation. The interpreter multiplies bf16 tiles as
    their uint16 storage, so there (EMULATE_RTNE) the tiles are widened to fp32 first, which is exact."""
    if EMULATE_RTNE:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def softmax_step(acc, m_i, l_i, s, v, valid, MASKED: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """One online-softmax step over a key block: `s` are fp32 scores already in log2 units [BM, BN],
    `v` the value tile [BN, BD], `valid` [BN] the keys that count (used when MASKED)."""
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # rows with no valid key so far keep m = -inf; exponentiate against 0 there (gives 0, not NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = half_dot(cast_to(p, v.dtype, EMULATE_RTNE), v, acc, EMULATE_RTNE)
    return acc, m_new, l_i


@triton.jit
def store_rows(out_ptr, acc, l_i, b, h, start_m, Sq, so_b, so_s, so_h, HEAD_DIM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE_RTNE: tl.constexpr):  # fmt: skip
    """acc / l for the BLOCK_M rows from `start_m` (zeros where l = 0), stored to out [B, Sq, H, D]."""
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    base = out_ptr + b * so_b + h * so_h + start_m.to(tl.int64) * so_s
    ptrs = base + rows[:, None] * so_s + d[None, :]
    mask = ((start_m + rows) < Sq)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(ptrs, cast_to(o, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=mask)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    bias_ptr,
    out_ptr,
    Sq,
    Skv,
    H,
    sq_b,
    sq_s,
    sq_h,
    sk_b,
    sk_s,
    sk_h,
    sv_b,
    sv_s,
    sv_h,
    sm_b,
    sm_s,
    sb_b,
    sb_h,
    sb_s,
    so_b,
    so_s,
    so_h,
    scale,
    SQD: tl.constexpr,
    SKD: tl.constexpr,
    SVD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """BLOCK_M query rows of one (batch, head) against all keys (see the module docstring)."""
    qk_scale = tl.cast(scale, tl.float32) * 1.4426950408889634  # Inductor passes Python floats as fp64
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    q_ptrs = q_ptr + b * sq_b + h * sq_h + start_m.to(tl.int64) * sq_s + rows[:, None] * sq_s + d[None, :] * SQD
    q = tl.load(q_ptrs, mask=((start_m + rows) < Sq)[:, None] & d_ok[None, :], other=0.0)
    kt_ptrs = k_ptr + b * sk_b + h * sk_h + cols[None, :] * sk_s + d[:, None] * SKD  # Kᵀ tile [BD, BN]
    v_ptrs = v_ptr + b * sv_b + h * sv_h + cols[:, None] * sv_s + d[None, :] * SVD
    m_ptrs = mask_ptr + b * sm_b + cols * sm_s
    b_ptrs = bias_ptr + b * sb_b + h * sb_h + cols * sb_s
    SOFT_MASKED: tl.constexpr = HAS_MASK or HAS_BIAS  # rows may have no key with a finite score

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full = (Skv // BLOCK_N) * BLOCK_N
    for _ in range(0, n_full, BLOCK_N):
        if EVEN_D:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if HAS_MASK:
            valid = tl.load(m_ptrs) != 0
        else:
            valid = cols < BLOCK_N
        s = half_dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), EMULATE_RTNE) * qk_scale
        if HAS_BIAS:
            s += tl.load(b_ptrs).to(tl.float32)[None, :] * 1.4426950408889634
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v, valid, SOFT_MASKED, EMULATE_RTNE)
        kt_ptrs += BLOCK_N * sk_s
        v_ptrs += BLOCK_N * sv_s
        m_ptrs += BLOCK_N * sm_s
        b_ptrs += BLOCK_N * sb_s
    if n_full < Skv:  # the tail block: keys past Skv are masked
        in_kv = (n_full + cols) < Skv
        kt = tl.load(kt_ptrs, mask=in_kv[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_kv[:, None] & d_ok[None, :], other=0.0)
        valid = in_kv
        if HAS_MASK:
            valid = valid & (tl.load(m_ptrs, mask=in_kv, other=0) != 0)
        s = half_dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), EMULATE_RTNE) * qk_scale
        if HAS_BIAS:
            s += tl.load(b_ptrs, mask=in_kv, other=0.0).to(tl.float32)[None, :] * 1.4426950408889634
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v, valid, True, EMULATE_RTNE)
    store_rows(out_ptr, acc, l_i, b, h, start_m, Sq, so_b, so_s, so_h, HEAD_DIM, BLOCK_M, BLOCK_D, EMULATE_RTNE)


# (largest head_dim, tiling) rows; the first row whose head_dim covers the call's is used (module docstring).
TILING = (
    (64, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}),
    (128, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
    (MAX_HEAD_DIM, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}),
)


def tiling(head_dim: int, q_len: int, kv_len: int, config: dict | None = None, table=TILING) -> dict:
    """{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} for one call from `table` (see the module docstring);
    `config` overrides any of them (a benchmark sweep). Blocks shrink to short sequences (>= 16)."""
    t = dict(next(row for max_d, row in table if head_dim <= max_d))
    t["BLOCK_M"] = min(t["BLOCK_M"], max(16, next_pow2(q_len)))
    t["BLOCK_N"] = min(t["BLOCK_N"], max(16, next_pow2(kv_len)))
    if config:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown attention kernel config keys {sorted(unknown)}; known: {list(CONFIG_KEYS)}")
        t.update(config)
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_inputs(q, k, v, key_mask, scale, what: str = "the Triton kernel") -> str | None:
    """None when q/k/v/key_mask fit the [B, S, H, D] kernels (real or fake tensors), else the reason."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return f"{name} has {t.dim()} dims; {what} takes [B, S, H, D]"
    if q.dtype not in HALF:
        return f"dtype {_dtype_name(q.dtype)} is unsupported (bf16 or fp16)"
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            return f"{name} has dtype {_dtype_name(t.dtype)} but q has {_dtype_name(q.dtype)}; {what} takes one dtype"
        if t.device != q.device:
            return f"{name} is on {t.device} but q is on {q.device}"
    if k.shape != v.shape:
        return f"k and v must have the same shape (k {tuple(k.shape)}, v {tuple(v.shape)})"
    (B, _, H, D), (Bk, Skv, Hk, Dk) = q.shape, k.shape
    if Bk != B:
        return f"q and k must have the same batch size (q {B}, k {Bk})"
    if Hk != H:
        return f"q and k must have the same number of heads (grouped-query attention is not supported; q {H}, k {Hk})"
    if Dk != D:
        return f"q and k must have the same head_dim (q {D}, k {Dk})"
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        return f"head_dim={D} is unsupported ({what} takes {MIN_HEAD_DIM}..{MAX_HEAD_DIM})"
    if Skv < 1:
        return f"k has {Skv} keys; {what} takes at least one"
    if key_mask is not None and (
        key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, Skv) or key_mask.device != q.device
    ):
        got = f"{_dtype_name(key_mask.dtype)} {list(key_mask.shape)} on {key_mask.device}"
        return f"key_mask must be bool [B, Skv] = [{B}, {Skv}] on q's device; got {got}"
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        return f"scale must be a float (1/sqrt(head_dim) for SDPA's default); got {type(scale).__name__}"
    return None


def check_bias(q, k, key_bias) -> str | None:
    """None when `key_bias` is a float [B, H, Skv] tensor (any strides) on q's device, or None."""
    if key_bias is None:
        return None
    (B, _, H, _), Skv = q.shape, k.shape[1]
    if not key_bias.dtype.is_floating_point or tuple(key_bias.shape) != (B, H, Skv) or key_bias.device != q.device:
        got = f"{_dtype_name(key_bias.dtype)} {list(key_bias.shape)} on {key_bias.device}"
        return f"key_bias must be a float [B, H, Skv] = [{B}, {H}, {Skv}] tensor on q's device; got {got}"
    return None


def supports(q, k, v, key_mask, scale, key_bias=None) -> str | None:
    """None when `attention_triton` handles these inputs (only dtype, shape and device are read)."""
    return check_inputs(q, k, v, key_mask, scale) or check_bias(q, k, key_bias)


def _launch(q, k, v, key_mask, scale, out, config=None, key_bias=None):
    """Launch the kernel writing `out` ([B, Sq, H, D] of q's dtype, unit stride in D). `config` overrides
    the tiling (keys of CONFIG_KEYS)."""
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    if out.numel() == 0:
        return out
    t = tiling(D, Sq, Skv, config)
    km = unused(q) if key_mask is None else key_mask
    sm_b, sm_s = (0, 0) if key_mask is None else (km.stride(0), km.stride(1))
    kb = unused(q) if key_bias is None else key_bias
    sb_b, sb_h, sb_s = (0, 0, 0) if key_bias is None else kb.stride()
    grid = (triton.cdiv(Sq, t["BLOCK_M"]), B * H)
    launcher(_attention_kernel)[grid](
        q,
        k,
        v,
        km,
        kb,
        out,
        Sq,
        Skv,
        H,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        sm_b,
        sm_s,
        sb_b,
        sb_h,
        sb_s,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        scale,
        SQD=q.stride(3),
        SKD=k.stride(3),
        SVD=v.stride(3),
        HEAD_DIM=D,
        HAS_MASK=key_mask is not None,
        HAS_BIAS=key_bias is not None,
        BLOCK_M=t["BLOCK_M"],
        BLOCK_N=t["BLOCK_N"],
        BLOCK_D=next_pow2(D),
        EMULATE_RTNE=EMULATE_RTNE,
        num_warps=t["num_warps"],
        num_stages=t["num_stages"],
    )
    return out


def _attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`omni_compile::attention_triton` as one Triton kernel."""
    reason = supports(q, k, v, key_mask, scale, key_bias)
    if reason:
        raise ValueError(f"omni_compile::attention_triton: {reason}")
    if INTERPRETED:  # see `attention_triton_extern`
        return attention_triton_extern(q, k, v, key_mask, scale, key_bias)
    # new_empty dispatches on q, so under a functional trace the output is fake like q.
    out = q.new_empty((q.shape[0], q.shape[1], q.shape[2], q.shape[3]))
    return _launch(q, k, v, key_mask, scale, out, key_bias=key_bias)


@torch.library.custom_op("omni_compile::attention_triton_extern", mutates_args=())
def attention_triton_extern(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel behind an opaque op (Inductor calls it as an external kernel). Under the interpreter the
    launch is a plain Python call that cannot run on fake tensors, so there `attention_triton` calls this
    op, whose fake impl only allocates; on GPUs the launch goes through wrap_triton and is traced."""
    return _launch(q, k, v, key_mask, scale, q.new_empty(q.shape), key_bias=key_bias)


@attention_triton_extern.register_fake
def _(q, k, v, key_mask, scale, key_bias=None):
    return q.new_empty(q.shape)


attention_triton = torch.library.triton_op("omni_compile::attention_triton", mutates_args=())(_attention_impl)


__all__ = [
    "INTERPRETED",
    "TILING",
    "attention_triton",
    "attention_triton_extern",
    "check_bias",
    "check_inputs",
    "half_dot",
    "softmax_step",
    "store_rows",
    "supports",
    "tiling",
]
