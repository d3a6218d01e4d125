"""Our attention kernels (`omni_compile::attention_triton`, `omni_compile::attention_sage_triton`) against
float64 attention on the same inputs.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on small
shapes: bf16 and fp16, head dims 16/40/64/72/96/128, query lengths 1/37/130, key lengths 1/8/65/200, with
and without a key-padding mask (batch row 1 fully masked: zeros), BSHD tensors, [B, H, S, D] tensors
permuted to BSHD and q/k/v views of a packed qkv. Each launch writes a NaN-poisoned output (every element
must be written), and the triton_op must give the same bits, eagerly and inside torch.compile.

Tolerances. Flash (`attention_triton`): P and the output are rounded once each to the input dtype (at most
eps / 2 each, eps = finfo.eps), so each element is within eps · (|out| + Σ_j p_j |v_j|) of float64 (measured
at most 0.33 of that); rel L2 within 5e-3 in bf16 (measured 1.9e-3 to 2.2e-3, 2.3e-3 at the GPU shapes) and
1e-3 in fp16 (measured 2.2e-4 to 2.6e-4). SAGE (lossy, INT8 Q·K): rel L2 within 3e-2 (measured 0.4e-2 to
1.4e-2, see omni_compile/attention/sage.py). The GPU tests repeat this at the W1/W2 shapes on 512 query rows
(the first and last 256).
"""

from __future__ import annotations

import pytest
import torch

from omni_compile.attention import sage, triton_attn

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
FLASH_L2 = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
SAGE_L2 = 3e-2
KERNELS = {
    "flash": (triton_attn._launch, triton_attn.attention_triton, triton_attn.supports),
    "sage": (sage._launch, sage.attention_sage_triton, sage.sage_supports),
}


def make_qkv(B, Sq, Skv, H, D, dtype, layout, seed):
    """q [B, Sq, H, D] and k, v [B, Skv, H, D] in `layout`: "bshd" (contiguous), "bhsd" (a [B, H, S, D]
    contiguous tensor permuted to BSHD) or "packed" (views of one [B, S, 3, H, D] tensor; needs Sq == Skv)."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)

    if layout == "packed":
        assert Sq == Skv
        return rnd(B, Sq, 3, H, D).unbind(2)
    if layout == "bhsd":
        return tuple(rnd(B, H, s, D).transpose(1, 2) for s in (Sq, Skv, Skv))
    return rnd(B, Sq, H, D), rnd(B, Skv, H, D), rnd(B, Skv, H, D)


def make_mask(kind, B, Skv, seed):
    """None, or a bool [B, Skv] key-padding mask with batch row 1 fully masked ("bcast": a [1, Skv] mask
    expanded over the batch, stride 0, as the attention pass builds it; no fully masked row)."""
    if kind is None:
        return None
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    if kind == "bcast":
        m = torch.rand(1, Skv, generator=g, device=DEV) > 0.4
        m[0, 0] = True
        return m.expand(B, Skv)
    m = torch.rand(B, Skv, generator=g, device=DEV) > 0.4
    m[0, 0] = True
    m[1] = False
    return m


def reference(q, k, v, key_mask, scale, rows=None):
    """float64 softmax(q kᵀ · scale) v of the first `rows` query rows, and Σ_j p_j |v_j| (zeros for rows
    with every key masked)."""
    qd, kd, vd = (t.double() for t in (q[:, :rows] if rows else q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    p = s.softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vd), torch.einsum("bhqk,bkhd->bqhd", p, vd.abs())


def rel_l2(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def run_poisoned(launch, q, k, v, key_mask, scale):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    launch(q, k, v, key_mask, scale, out)
    assert not out.isnan().any(), f"{int(out.isnan().sum())} of {out.numel()} outputs not written"
    return out


def check_flash_elementwise(out, ref, mag):
    fi = torch.finfo(out.dtype)
    err = (out.double() - ref).abs()
    bound = fi.eps * (ref.abs() + mag) + fi.smallest_normal
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {float((err / bound).max()):.3g} x the bound"


# (dtype, head_dim, Sq, Skv, mask, layout)
CASES = [
    (torch.bfloat16, 64, 37, 65, None, "bshd"),
    (torch.float16, 64, 37, 65, "pad", "bshd"),
    (torch.bfloat16, 40, 130, 200, "pad", "bhsd"),
    (torch.float16, 40, 130, 8, None, "bhsd"),
    (torch.bfloat16, 128, 1, 200, None, "bshd"),
    (torch.float16, 128, 37, 1, "pad", "bshd"),
    (torch.bfloat16, 128, 130, 65, "pad", "bhsd"),
    (torch.bfloat16, 16, 130, 65, None, "bhsd"),
    (torch.float16, 16, 1, 8, "pad", "bshd"),
    (torch.bfloat16, 72, 65, 65, "bcast", "packed"),
    (torch.float16, 96, 37, 37, None, "packed"),
    (torch.bfloat16, 80, 37, 8, "pad", "bshd"),
]


def case_id(c):
    dtype, D, Sq, Skv, mask, layout = c
    return f"{IDS[dtype]}-d{D}-q{Sq}-kv{Skv}-{mask or 'nomask'}-{layout}"


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_float64(kernel, case):
    dtype, D, Sq, Skv, mask_kind, layout = case
    B, H = 2, 3
    q, k, v = make_qkv(B, Sq, Skv, H, D, dtype, layout, seed=CASES.index(case))
    key_mask = make_mask(mask_kind, B, Skv, seed=D)
    scale = D**-0.5
    launch, op, supports = KERNELS[kernel]
    assert supports(q, k, v, key_mask, scale) is None
    out = run_poisoned(launch, q, k, v, key_mask, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    ref, mag = reference(q, k, v, key_mask, scale)
    if mask_kind == "pad":  # batch row 1 attends to nothing
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        out, ref, mag = out[:1], ref[:1], mag[:1]
    err = rel_l2(out, ref)
    if kernel == "flash":
        check_flash_elementwise(out, ref, mag)
        assert err < FLASH_L2[dtype], err
    else:
        assert err < SAGE_L2, err
    assert torch.equal(op(q, k, v, key_mask, scale)[: out.shape[0]], out)  # the triton_op: the same bits


def test_quantize_blocks():
    """int8 * scale gives back each block within half a step; smoothing removes the mean over S; padding is zero."""
    x = torch.randn(2, 37, 3, 40, device=DEV).to(torch.bfloat16) + 3.0
    xi, s = sage.quantize_blocks(x, 16, 64, smooth=True)
    assert xi.dtype == torch.int8 and xi.shape == (2, 3, 48, 64) and s.shape == (2, 3, 3)
    xs = x.float() - x.float().mean(1, keepdim=True)
    back = (xi.float().view(2, 3, 3, 16, 64) * s[..., None, None]).view(2, 3, 48, 64)
    assert (back[:, :, 37:] == 0).all() and (back[..., 40:] == 0).all()
    err = (back[:, :, :37, :40] - xs.permute(0, 2, 1, 3)).abs()
    step = s.repeat_interleave(16, dim=2)[:, :, :37, None]
    assert (err <= 0.5 * step * (1 + 1e-5)).all()
    assert int(xi.abs().max()) == 127


def bad_inputs():
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    q, kv = t(2, 8, 3, 64), t(2, 16, 3, 64)
    ok = (q, kv, kv, None, 0.125)
    yield "dims", (t(8, 3, 64), kv, kv, None, 0.125), "q has 3 dims; {what} takes [B, S, H, D]"
    yield (
        "fp32",
        (t(2, 8, 3, 64, dtype=torch.float32), kv, kv, None, 0.125),
        "dtype float32 is unsupported (bf16 or fp16)",
    )
    yield (
        "k dtype",
        (q, t(2, 16, 3, 64, dtype=torch.float16), kv, None, 0.125),
        "k has dtype float16 but q has bfloat16",
    )
    yield "kv shape", (q, kv, t(2, 15, 3, 64), None, 0.125), "k and v must have the same shape"
    yield (
        "gqa",
        (q, t(2, 16, 1, 64), t(2, 16, 1, 64), None, 0.125),
        ("q and k must have the same number of heads (grouped-query attention is not supported"),
    )
    yield "batch", (q, t(1, 16, 3, 64), t(1, 16, 3, 64), None, 0.125), "q and k must have the same batch size"
    yield "head_dim k", (q, t(2, 16, 3, 32), t(2, 16, 3, 32), None, 0.125), "q and k must have the same head_dim"
    yield (
        "head_dim 300",
        (t(2, 8, 3, 300), t(2, 16, 3, 300), t(2, 16, 3, 300), None, 0.1),
        ("head_dim=300 is unsupported ({what} takes 16..256)"),
    )
    yield "head_dim 8", (t(2, 8, 3, 8), t(2, 16, 3, 8), t(2, 16, 3, 8), None, 0.1), "head_dim=8 is unsupported"
    yield "no keys", (q, t(2, 0, 3, 64), t(2, 0, 3, 64), None, 0.125), "k has 0 keys; {what} takes at least one"
    yield "mask dtype", (*ok[:3], t(2, 16, dtype=torch.float32), 0.125), "key_mask must be bool [B, Skv] = [2, 16]"
    yield "mask shape", (*ok[:3], t(2, 1, 1, 16, dtype=torch.bool), 0.125), "key_mask must be bool [B, Skv]"
    yield "scale", (*ok[:4], None), "scale must be a float"


@pytest.mark.parametrize("kernel,what", [("flash", "the Triton kernel"), ("sage", "the SAGE kernel")])
def test_supports_reasons(kernel, what):
    supports = KERNELS[kernel][2]
    q, kv = (
        torch.empty(2, 8, 3, 64, dtype=torch.bfloat16, device="meta"),
        torch.empty(2, 16, 3, 64, dtype=torch.bfloat16, device="meta"),
    )
    assert supports(q, kv, kv, None, 0.125) is None
    assert supports(q, kv, kv, torch.empty(2, 16, dtype=torch.bool, device="meta"), 0.125) is None
    for name, args, expected in bad_inputs():
        reason = supports(*args)
        assert reason is not None and expected.format(what=what) in reason, (name, reason)
    impl = triton_attn._attention_impl if kernel == "flash" else sage._sage_impl
    q = torch.randn(1, 4, 1, 32, device=DEV)  # fp32: the launcher raises with the reason
    with pytest.raises(ValueError, match="dtype float32 is unsupported"):
        impl(q, q, q, None, 0.125)


def test_tiling():
    assert triton_attn.tiling(128, 4608, 4608) == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    assert triton_attn.tiling(64, 4096, 4096) == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    assert triton_attn.tiling(72, 4096, 4096)["BLOCK_N"] == 128
    assert triton_attn.tiling(256, 4096, 4096) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    sage_128 = triton_attn.tiling(128, 4608, 4608, table=sage.SAGE_TILING)
    assert sage_128 == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    t = triton_attn.tiling(128, 1, 8)  # short sequences shrink the blocks, never below 16
    assert (t["BLOCK_M"], t["BLOCK_N"]) == (16, 16)
    assert triton_attn.tiling(128, 4608, 4608, {"BLOCK_N": 32, "num_stages": 2})["BLOCK_N"] == 32
    with pytest.raises(ValueError, match="unknown attention kernel config keys"):
        triton_attn.tiling(128, 64, 64, {"BLOCK_K": 32})


@pytest.mark.parametrize("config", [{"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_config_override(kernel, config):
    """A swept tiling (blocks smaller than the default) gives the same values within the tolerance."""
    q, k, v = make_qkv(1, 70, 50, 2, 64, torch.bfloat16, "bshd", seed=5)
    out = run_poisoned(lambda *a: KERNELS[kernel][0](*a, config=config), q, k, v, None, 0.125)
    ref, _ = reference(q, k, v, None, 0.125)
    assert rel_l2(out, ref) < (FLASH_L2[torch.bfloat16] if kernel == "flash" else SAGE_L2)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_inside_torch_compile(kernel, fresh_dynamo):
    """fullgraph compile of the op between two layout changes (on CPU an external call) gives the eager bits."""
    _, op, _ = KERNELS[kernel]
    q, k, v = make_qkv(2, 37, 65, 3, 64, torch.bfloat16, "bhsd", seed=7)
    key_mask = make_mask("pad", 2, 65, seed=7)

    def fn(q, k, v, key_mask):
        out = op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_mask, 0.125)
        return out.transpose(1, 2) * 2

    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D] views, as SDPA sees them
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(qh, kh, vh, key_mask), fn(qh, kh, vh, key_mask))


# ------------------------------------------------------------------ GPU

# name: (B, Sq, Skv, H, D)
GPU_SHAPES = {
    "W1": (1, 4608, 4608, 24, 128),
    "W2": (1, 32760, 32760, 12, 128),
    "W2 cross": (1, 32760, 512, 12, 128),
    "odd": (1, 1000, 1000, 8, 72),
}
GPU_ROWS = 512


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gpu_shapes_match_float64(kernel, shape):
    B, Sq, Skv, H, D = GPU_SHAPES[shape]
    q, k, v = make_qkv(B, Sq, Skv, H, D, torch.bfloat16, "bshd", seed=11)
    scale = D**-0.5
    launch, op, supports = KERNELS[kernel]
    assert supports(q, k, v, None, scale) is None
    out = run_poisoned(launch, q, k, v, None, scale)
    # rows from the start, the middle and the tail block of the queries
    idx = torch.cat([torch.arange(0, GPU_ROWS // 2), torch.arange(Sq - GPU_ROWS // 2, Sq)]).to(DEV)
    ref, mag = reference(q[:, idx], k, v, None, scale)
    err = rel_l2(out[:, idx], ref)
    if kernel == "flash":
        check_flash_elementwise(out[:, idx], ref, mag)
        assert err < FLASH_L2[torch.bfloat16], err
    else:
        assert err < SAGE_L2, err
    assert torch.equal(op(q, k, v, None, scale), out)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gpu_masked_and_strided(kernel):
    """A key-padding mask (batch row 1 fully masked) and [B, H, S, D] inputs permuted to BSHD, on the GPU."""
    q, k, v = make_qkv(2, 1000, 777, 8, 128, torch.bfloat16, "bhsd", seed=12)
    key_mask = make_mask("pad", 2, 777, seed=12)
    out = run_poisoned(KERNELS[kernel][0], q, k, v, key_mask, 128**-0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref, _ = reference(q[:1], k[:1], v[:1], key_mask[:1], 128**-0.5)
    assert rel_l2(out[:1], ref) < (FLASH_L2[torch.bfloat16] if kernel == "flash" else SAGE_L2)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gpu_inside_torch_compile(kernel, fresh_dynamo):
    """Inductor embeds the kernel (and for SAGE, traces the quantization); the result is the eager bits."""
    _, op, _ = KERNELS[kernel]
    q, k, v = make_qkv(1, 4608, 4608, 24, 128, torch.bfloat16, "bshd", seed=13)
    key_mask = make_mask("bcast", 1, 4608, seed=13)

    def fn(q, k, v, key_mask):
        return op(q, k, v, None, 128**-0.5), op(q, k, v, key_mask, 128**-0.5)

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for e, c in zip(fn(q, k, v, key_mask), compiled(q, k, v, key_mask)):
        assert torch.equal(e, c)
