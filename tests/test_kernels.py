"""The Triton kernels of the fused ops against their native implementations.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
on small shapes. Each check launches the kernel into a NaN-poisoned output (every element must be
written), compares it with the native implementation evaluated in float64 on upcast inputs (within
a couple of roundings of the output dtype, scaled by the magnitude of the terms that were rounded),
and with the native implementation in the same dtype (at most 2 ulps apart, and bitwise equal almost
everywhere in half precision, which pins the rounding points of the contract). The GPU tests repeat
this at the FLUX and Wan shapes and through torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from omni_compile.ops import FUSED_OPS, KernelUnavailableError
from omni_compile.ops.adaln import adaln_native
from omni_compile.ops.gated_residual import gated_residual_native
from omni_compile.ops.kernels import adaln as adaln_k
from omni_compile.ops.kernels import gated_residual as gated_k
from omni_compile.ops.kernels import rms_norm as rms_k
from omni_compile.ops.kernels import rms_norm_rope as rope_k
from omni_compile.ops.rms_norm import rms_norm_native
from omni_compile.ops.rms_norm_rope import layer_norm_rope_native, rms_norm_rope_native
from omni_compile.platform import current_platform

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
EPS = 1e-6
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.omni_compile


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, dtype=torch.float32, g=None, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32) * scale + offset).to(dtype)


def up(v):
    """float64 copy of a tensor argument (keeps None and constants)."""
    return v.to(torch.float64) if isinstance(v, torch.Tensor) else v


def check(launch, native, args: tuple, mag: torch.Tensor | None = None, eager=None) -> torch.Tensor:
    """Run `launch(*args, out)` into a NaN-poisoned `out` and check it (see the module docstring).

    `mag` (float64, the output's shape) is the magnitude of the terms whose roundings the kernel may
    carry, for outputs that can cancel (x + y * gate, the rotation, the modulation); 0 when omitted.
    `eager`, when given, is the triton_op overload: its output must equal the launch bit for bit.
    """
    nat = native(*args)
    ref = native(*(up(a) for a in args))
    out = torch.full(nat.shape, float("nan"), dtype=nat.dtype, device=nat.device)
    launch(*args, out)
    assert not out.isnan().any(), f"{int(out.isnan().sum())} of {out.numel()} outputs not written"
    fi = torch.finfo(out.dtype)
    mag = torch.zeros_like(ref) if mag is None else mag
    scale = ref.abs() + mag
    tiny = 2 * fi.eps * fi.smallest_normal
    # Against float64: a final rounding and one intermediate rounding of the output dtype (2 eps),
    # and in fp32, the sums and rsqrt (16 eps, about 2e-6).
    k = 16 if out.dtype == torch.float32 else 2
    err = (out.double() - ref).abs()
    bad = err > k * fi.eps * scale + tiny
    assert not bad.any(), f"vs float64: {int(bad.sum())} elements off, worst {float((err / scale).max()):.3g} rel"
    # Against native in the same dtype: at most 2 ulps in half precision (where it must also be identical
    # nearly everywhere), 8 in fp32 (sums in another order, and on GPUs an approximate rsqrt).
    k = 8 if out.dtype == torch.float32 else 2
    diff = (out.double() - nat.double()).abs()
    bad = diff > k * fi.eps * (nat.double().abs() + mag) + tiny
    assert not bad.any(), f"vs native: {int(bad.sum())} elements more than {k} ulps off"
    if out.dtype != torch.float32:
        frac = float((out != nat).double().mean())
        assert frac <= 0.01, f"{frac:.2%} of the elements differ from native"
    if eager is not None:
        eager_out = eager(*args)
        assert eager_out.dtype == nat.dtype and eager_out.shape == nat.shape and eager_out.is_contiguous()
        assert torch.equal(eager_out, out)
    return out


# ------------------------------------------------------------------ rms_norm


def rms_norm_cases():
    for dtype in DTYPES:
        for wdt in dict.fromkeys((None, dtype, torch.float32)):
            for cbw in (False, True):
                yield pytest.param(dtype, wdt, cbw, id=f"{IDS[dtype]}-w{IDS.get(wdt, 'none')}-cbw{int(cbw)}")


@pytest.mark.parametrize("layout", ["rows", "heads_view", "strided_last", "vector"])
@pytest.mark.parametrize("dtype,wdt,cbw", list(rms_norm_cases()))
def test_rms_norm(dtype, wdt, cbw, layout):
    g = _gen(1)
    if layout == "rows":  # [B, S, D] with a non power of two D
        x = randn(2, 5, 48, dtype=dtype, g=g, scale=3)
    elif layout == "heads_view":  # per-head q of a fused qkv: [B, S, H, hd] view with row stride 3*H*hd
        x = randn(2, 4, 3 * 3 * 24, dtype=dtype, g=g).view(2, 4, 3, 3, 24)[:, :, 1]
    elif layout == "strided_last":  # a transposed view: the normalised dim is strided
        x = randn(2, 40, 6, dtype=dtype, g=g).transpose(1, 2)
    else:
        x = randn(32, dtype=dtype, g=g)
    d = x.shape[-1]
    w = None if wdt is None else randn(2 * d, dtype=wdt, g=g, offset=1)[::2]  # a strided weight
    assert rms_k.supports(x=x, weight=w, eps=EPS, cast_before_weight=cbw) is None
    check(rms_k._launch, rms_norm_native, (x, w, EPS, cbw), eager=ops.rms_norm_triton)


def test_rms_norm_many_rows():
    """More rows than one program's tile, a row count that is not a multiple of it, and D = 16."""
    g = _gen(2)
    x = randn(3, 67, 16, dtype=torch.bfloat16, g=g)
    w = randn(16, dtype=torch.bfloat16, g=g)
    check(rms_k._launch, rms_norm_native, (x, w, EPS, False))


# ------------------------------------------------------------------ adaln


def _modulation(kind: str, B: int, S: int, D: int, dtype, g, which: int):
    """scale (which=1) or shift (which=0) the way the models make them."""
    if kind == "none":
        return None
    if kind == "sample_fp32":  # Wan: chunk(6, dim=1) of a fp32 [B, 6, D] tensor -> [B, 1, D] views
        return randn(B, 6, D, g=g, scale=0.5).chunk(6, dim=1)[which]
    if kind == "sample":  # FLUX: emb.chunk(3, dim=1) of [B, 3*D], then [:, None]
        return randn(B, 3 * D, dtype=dtype, g=g, scale=0.5).chunk(3, dim=1)[which][:, None]
    if kind == "broadcast":  # one modulation for the whole batch
        return randn(1, 1, D, dtype=dtype, g=g, scale=0.5)
    return randn(B, S, D, dtype=dtype, g=g, scale=0.5)  # per token


def _adaln_mag(x, scale, shift, eps, norm):
    """|n (1 + scale)| + |shift|; for layer norms |n| + rms(x) / std in place of |n|, since the fp32
    mean carries an absolute error of order eps * |x|, which x - mean keeps when it cancels."""
    from omni_compile.ops.adaln import normalize_native

    xd = x.double()
    n = normalize_native(xd, eps, norm).abs()
    if norm == "layer":
        n = n + xd.pow(2).mean(-1, keepdim=True).sqrt() / xd.std(-1, correction=0, keepdim=True)
    mag = n * (1 + scale.double()).abs() if scale is not None else n
    return mag + (shift.double().abs() if shift is not None else 0)


@pytest.mark.parametrize(
    "scale_kind,shift_kind",
    [("sample_fp32", "sample_fp32"), ("sample", "sample"), ("token", "broadcast"), ("none", "token"), ("none", "none")],
)
@pytest.mark.parametrize("round_norm", [True, False], ids=["round", "fp32norm"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_adaln(dtype, norm, round_norm, scale_kind, shift_kind):
    g = _gen(3)
    B, S, D = 2, 5, 48
    x = randn(B, S, D, dtype=dtype, g=g, scale=2, offset=0.5)
    scale = _modulation(scale_kind, B, S, D, dtype, g, 1)
    shift = _modulation(shift_kind, B, S, D, dtype, g, 0)
    args = (x, scale, shift, EPS, norm, round_norm)
    assert adaln_k.supports(*args) is None
    check(adaln_k._launch, adaln_native, args, _adaln_mag(x, scale, shift, EPS, norm), eager=ops.adaln_triton)


def test_adaln_strided_x_and_tiny_hidden():
    """x a non-contiguous view (every other token), D = 32 (tiny presets), more rows than a tile."""
    g = _gen(4)
    x = randn(2, 300, 32, dtype=torch.bfloat16, g=g)[:, ::2]
    scale = randn(2, 1, 32, dtype=torch.bfloat16, g=g)
    shift = randn(2, 1, 32, dtype=torch.bfloat16, g=g)
    args = (x, scale, shift, EPS, "layer", True)
    check(adaln_k._launch, adaln_native, args, _adaln_mag(x, scale, shift, EPS, "layer"))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("round_norm", [True, False], ids=["round", "fp32norm"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_adaln_with_the_norms_affine(dtype, norm, round_norm, bias):
    """A norm with its own weight (and bias) before the modulation (CogVideoX's LayerNorm, Lumina2's RMSNorm):
    `norm(x) * weight + bias`, then `* (1 + scale) + shift`, against float64."""
    g = _gen(5)
    B, S, D = 2, 5, 48
    x = randn(B, S, D, dtype=dtype, g=g, scale=2, offset=0.5)
    w = randn(D, dtype=dtype, g=g, scale=0.5, offset=1.0)
    b = randn(D, dtype=dtype, g=g, scale=0.5) if bias else None
    scale = _modulation("sample", B, S, D, dtype, g, 1)
    shift = _modulation("sample", B, S, D, dtype, g, 0)
    args = (x, scale, shift, EPS, norm, round_norm, w, b)
    assert adaln_k.supports(*args) is None

    def launch(x, scale, shift, eps, norm, round_norm, w, b, out):
        return adaln_k._launch(x, scale, shift, eps, norm, round_norm, out, weight=w, bias=b)

    mag = _adaln_mag(x, None, None, EPS, norm) * w.double().abs() + (b.double().abs() if b is not None else 0)
    mag = mag * (1 + scale.double()).abs() + shift.double().abs()
    out = check(launch, adaln_native, args, mag, eager=ops.adaln_triton)
    # without the affine the result differs: the weight and bias are applied
    assert not torch.equal(out, adaln_native(x, scale, shift, EPS, norm, round_norm))


def test_adaln_kernel_leaves_a_cast_before_weight_rms_norm_to_native():
    x, w = _fake(2, 4, 64), _fake(64)
    assert adaln_k.supports(x, None, None, EPS, "rms", True, w, None, False) is None
    assert "cast-before-weight" in adaln_k.supports(x, None, None, EPS, "rms", True, w, None, True)
    assert "[D]" in adaln_k.supports(x, None, None, EPS, "layer", True, _fake(32), None, False)


# ------------------------------------------------------------------ gated_residual


def _gated_mag(x, y, gate):
    return x.double().abs() + (y.double() * gate.double()).abs()


@pytest.mark.parametrize("gate_kind", ["sample_fp32", "sample", "token", "broadcast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_gated_residual(dtype, gate_kind):
    g = _gen(5)
    B, S, D = 2, 5, 48
    x = randn(B, S, D, dtype=dtype, g=g)
    y = randn(B, S, D, dtype=dtype, g=g, scale=4)
    gate = _modulation(gate_kind, B, S, D, dtype, g, 2)
    assert gated_k.supports(x, y, gate) is None
    check(gated_k._launch, gated_residual_native, (x, y, gate), _gated_mag(x, y, gate), eager=ops.gated_residual_triton)


@pytest.mark.parametrize("D", [3072, 1536, 40])
def test_gated_residual_tilings(D):
    """Column tiles that divide D (3072 = 3 x 1024, 1536 = 3 x 512) or mask it (40), strided x and y."""
    g = _gen(6)
    x = randn(1, 6, 2 * D, dtype=torch.bfloat16, g=g)[..., D:]
    y = randn(1, 12, D, dtype=torch.bfloat16, g=g)[:, ::2]
    gate = randn(1, 6, D, g=g)[:, :1]
    check(gated_k._launch, gated_residual_native, (x, y, gate), _gated_mag(x, y, gate))


# ------------------------------------------------------------------ rms_norm_rope


def rope_tables(style: str, S: int, D: int, dtype, g):
    """(cos, sin, tables) as FLUX or Wan make them. The angles are random per element (not repeated per
    pair), so reading the wrong column of a table changes the result."""
    if style in ("flux", "halves"):  # apply_rotary_emb(use_real_unbind_dim=-1 or -2): cos/sin [S, D]
        ang = randn(S, D, g=g, scale=3)
        return ang.cos().to(dtype), ang.sin().to(dtype), "per_element" if style == "flux" else "halves"
    # Wan: freqs_cos / freqs_sin [1, S, 1, D], passed as a free [S, D] reshape
    ang = randn(1, S, 1, D, g=g, scale=3)
    return ang.cos().to(dtype).reshape(S, D), ang.sin().to(dtype).reshape(S, D), "per_pair"


def rope_args(x, w, xt, wt, tabs, cbw, across):
    cos, sin, tables = tabs
    return (x, w, xt, wt, cos, sin, EPS, cbw, across, tables)


def _rope_mag(args):
    """|n_even cos| + |n_odd sin| (even) and |n_odd cos| + |n_even sin| (odd), in float64."""
    x, w, xt, wt, cos, sin, eps, cbw, across, tables = (up(a) for a in args)
    from omni_compile.ops.rms_norm_rope import _norm

    n = _norm(x, w, eps, cbw, across)
    if xt is not None:
        n = torch.cat([n, _norm(xt, wt, eps, cbw, across)], dim=1)
    return _rotation_mag(n, cos, sin, tables)


def _rotation_mag(n, cos, sin, tables):
    if tables == "per_head":
        c, s = cos.abs()[None], sin.abs()[None]
        ne, no = n[..., 0::2].abs(), n[..., 1::2].abs()
        return torch.stack([ne * c + no * s, no * c + ne * s], dim=-1).flatten(-2)
    c, s = cos.abs()[None, :, None, :], sin.abs()[None, :, None, :]
    if tables == "halves":
        d = n.shape[-1] // 2
        first, second = n[..., :d].abs(), n[..., d:].abs()
        return torch.cat([first * c[..., :d] + second * s[..., :d], second * c[..., d:] + first * s[..., d:]], -1)
    ne, no = n[..., 0::2].abs(), n[..., 1::2].abs()
    ce, so = c[..., 0::2], s[..., 1::2]
    co, se = (ce, so) if tables == "per_pair" else (c[..., 1::2], s[..., 0::2])
    return torch.stack([ne * ce + no * se, no * co + ne * so], dim=-1).flatten(-2)


def rope_cases():
    """Every dtype x per-head/across x with/without tail x FLUX/Wan tables x weight variant, through the
    split (default) loads; the stride-2 loads on a subset (they differ in how x and the weight are read)."""
    for dtype in DTYPES:
        for across in (False, True):
            for tail in (False, True):
                for style in ("flux", "wan", "halves"):
                    weights = ["none", "weight", "cast_before_weight"]
                    if dtype != torch.float32:
                        weights.append("fp32_cast_before_weight")
                    for w in weights:
                        for split in (True, False) if style == "flux" and w != "weight" else (True,):
                            yield pytest.param(dtype, across, tail, style, w, split, id="-".join([
                                IDS[dtype], "across" if across else "head", "tail" if tail else "single", style, w,
                                "split" if split else "stride2"]))  # fmt: skip


@pytest.mark.parametrize("dtype,across,tail,style,weights,split", list(rope_cases()))
def test_rms_norm_rope(dtype, across, tail, style, weights, split):
    g = _gen(7)
    B, S1, S2, H, D = 2, 3, 2, 3, 24
    # x a [B, S, H, D] view of a fused projection (row stride larger than H * D)
    x = randn(B, S1, 2 * H * D, dtype=dtype, g=g, scale=2)[..., : H * D].unflatten(-1, (H, D))
    xt = randn(B, S2, H, D, dtype=dtype, g=g) if tail else None
    wn = H * D if across else D
    wdt = torch.float32 if weights.startswith("fp32") else dtype
    w = wt = None
    if weights != "none":
        w = randn(wn, dtype=wdt, g=g, offset=1)
        wt = randn(wn, dtype=wdt, g=g, offset=1) if tail else None
    tabs = rope_tables(style, S1 + (S2 if tail else 0), D, dtype if style == "wan" else torch.float32, g)
    args = rope_args(x, w, xt, wt, tabs, weights.endswith("cast_before_weight"), across)
    assert rope_k.supports(*args) is None

    def launch(*a):
        return rope_k._launch(*a[:-1], a[-1], config={"SPLIT": split})

    check(launch, rms_norm_rope_native, args, _rope_mag(args), eager=ops.rms_norm_rope_triton if split else None)


@pytest.mark.parametrize("H,D,across", [(5, 16, False), (24, 8, False), (2, 32, True), (1, 2, False)])
def test_rms_norm_rope_head_tilings(H, D, across):
    """Head counts that are not powers of two, several programs per token (24 heads of 8 would fit one
    tile: forced to 8 heads a program), head_dim 2, and a tail that starts mid-sequence."""
    g = _gen(8)
    x = randn(1, 3, H, D, dtype=torch.bfloat16, g=g)
    xt = randn(1, 4, H, D, dtype=torch.bfloat16, g=g)
    w = randn(H * D if across else D, dtype=torch.bfloat16, g=g)
    args = rope_args(x, w, xt, w, rope_tables("flux", 7, D, torch.float32, g), False, across)
    config = {"BLOCK_H": 8} if H == 24 else None

    def launch(*a):
        return rope_k._launch(*a[:-1], a[-1], config=config)

    check(launch, rms_norm_rope_native, args, _rope_mag(args))


@pytest.mark.parametrize(
    "style,across,tail,H,D,cbw",
    [("flux", False, True, 3, 24, False), ("wan", True, False, 3, 24, True), ("flux", False, False, 1, 2048, False),
     ("halves", False, False, 3, 20, False)],
    ids=["flux-head-tail", "wan-across", "one-head-2048", "halves-head"],
)
def test_rms_norm_rope_pair_equals_two_launches(style, across, tail, H, D, cbw):
    """q and k in one launch (the tables read once): each output bit for bit the single launch's, with y's own
    strides, weights (none for y in one case) and tail. 1 x 2048 takes the stride-2 default tiling."""
    g = _gen(9)
    B, S1, S2 = 2, 3, 2
    wn = H * D if across else D
    x = randn(B, S1, 2 * H * D, dtype=torch.bfloat16, g=g, scale=2)[..., : H * D].unflatten(-1, (H, D))
    y = randn(B, S1, H, D, dtype=torch.bfloat16, g=g)
    xt, yt = (randn(B, S2, H, D, dtype=torch.bfloat16, g=g), randn(B, S2, H, D, dtype=torch.bfloat16, g=g)) if tail else (None, None)  # fmt: skip
    w, wt = randn(wn, dtype=torch.bfloat16, g=g, offset=1), randn(wn, dtype=torch.bfloat16, g=g, offset=1)
    wy = None if style == "wan" else randn(wn, dtype=torch.bfloat16, g=g, offset=1)
    wyt = randn(wn, dtype=torch.bfloat16, g=g, offset=1) if tail else None
    cos, sin, tables = rope_tables(style, S1 + (S2 if tail else 0), D, torch.float32, g)
    shared = (cos, sin, EPS, cbw, across, tables)
    args_x = (x, w, xt if tail else None, wt if tail else None, *shared)
    args_y = (y, wy, yt, wyt, *shared)
    assert rope_k.supports_pair(*args_x[:4], *args_y[:4], *shared) is None
    if D == 2048:
        assert rope_k._tiling(H, D, across) == (1, 1024, 4, False)
    single_x = check(rope_k._launch, rms_norm_rope_native, args_x, _rope_mag(args_x))
    single_y = check(rope_k._launch, rms_norm_rope_native, args_y, _rope_mag(args_y))
    out_x, out_y = rope_k._rms_norm_rope_pair_impl(*args_x[:4], *args_y[:4], *shared)
    assert torch.equal(out_x, single_x) and torch.equal(out_y, single_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("split", [True, False], ids=["split", "stride2"])
def test_rms_norm_rope_per_head_tables(dtype, split):
    """Mochi's tables, one per head ([S, H, D/2], a strided view): pair i of head h reads cos[s, h, i] and
    sin[s, h, i]; against float64 and native, the triton_op bit for bit the launch, and q and k in one launch."""
    g = _gen(14)
    B, S, H, D = 2, 5, 3, 24
    x = randn(B, S, 2 * H * D, dtype=dtype, g=g, scale=2)[..., : H * D].unflatten(-1, (H, D))
    w = randn(D, dtype=dtype, g=g, offset=1)
    ang = randn(S, 2 * H, D // 2, g=g, scale=3)[:, ::2]  # [S, H, D/2] with a head stride of 2 rows
    cos, sin = ang.cos(), ang.sin()
    args = (x, w, None, None, cos, sin, EPS, False, False, "per_head")
    assert rope_k.supports(*args) is None

    def launch(*a):
        return rope_k._launch(*a[:-1], a[-1], config={"SPLIT": split})

    out = check(launch, rms_norm_rope_native, args, _rope_mag(args), eager=ops.rms_norm_rope_triton if split else None)
    y = randn(B, S, H, D, dtype=dtype, g=g)
    single_y = check(rope_k._launch, rms_norm_rope_native, (y, None, *args[2:]), _rope_mag((y, None, *args[2:])))
    out_x, out_y = rope_k._rms_norm_rope_pair_impl(x, w, None, None, y, None, None, None, *args[4:])
    # the pair launch tiles as the single launch does by default (with `split` forced, a GPU rounds differently)
    default_x = torch.empty_like(out)
    rope_k._launch(*args, default_x)
    assert torch.equal(out_x, default_x) and torch.equal(out_y, single_y)
    assert rope_k.supports(x, w, None, None, cos[:, :2], sin[:, :2], *args[6:]) == (
        f"cos has shape (5, 2, {D // 2}), expected (5, 3, {D // 2})"
    )


def _layer_rope_mag(args):
    """The rotation's magnitude over (|x| + |mean|) * rstd * |w| + |b| (x - mean and the affine may cancel), in
    float64; the tokens before `start` are the norm's alone."""
    x, w, b, cos, sin, eps, tables, start = (up(a) for a in args)
    var, mean = torch.var_mean(x, -1, correction=0, keepdim=True)
    n = (x.abs() + mean.abs()) * torch.rsqrt(var + eps)
    n = n * (w.abs() if w is not None else 1) + (b.abs() if b is not None else 0)
    return torch.cat([n[:, :start], _rotation_mag(n[:, start:], cos, sin, tables)], dim=1)


def _layer_launch(config=None):
    return lambda *args: rope_k.layer_launch(*args, config=config)


def layer_cases():
    for dtype in DTYPES:
        for style in ("flux", "wan", "halves"):
            for affine in ("weight_bias", "weight", "none"):
                for split in (True, False) if style == "flux" and affine != "weight" else (True,):
                    start = 2 if affine == "none" else 0
                    yield pytest.param(dtype, style, affine, split, start, id="-".join([
                        IDS[dtype], style, affine, "split" if split else "stride2", f"start{start}"]))  # fmt: skip


@pytest.mark.parametrize("dtype,style,affine,split,start", list(layer_cases()))
def test_layer_norm_rope(dtype, style, affine, split, start):
    """LayerNorm per head (mean and variance in fp32, the affine in fp32, one rounding), then the rotation of the
    tokens from `start` on: against float64 and the native op, through both loads; the triton_op bit for bit the
    launch."""
    g = _gen(11)
    B, S, H, D = 2, 5, 3, 24
    # a heads-first q's transposed view, offset from 0 (the mean matters)
    x = randn(B, H, S, D, dtype=dtype, g=g, scale=2, offset=0.5).transpose(1, 2)
    w = randn(D, dtype=dtype, g=g, offset=1) if affine != "none" else None
    b = randn(D, dtype=dtype, g=g) if affine == "weight_bias" else None
    cos, sin, tables = rope_tables(style, S - start, D, dtype if style == "wan" else torch.float32, g)
    args = (x, w, b, cos, sin, EPS, tables, start)
    assert rope_k.layer_supports(*args) is None
    check(_layer_launch({"SPLIT": split}), layer_norm_rope_native, args, _layer_rope_mag(args),
          eager=ops.layer_norm_rope_triton if split else None)  # fmt: skip


@pytest.mark.parametrize("H,D", [(5, 16), (24, 8), (1, 2)])
def test_layer_norm_rope_head_tilings_and_pair(H, D):
    """Head counts that are not powers of two, several programs a token, head_dim 2; and q and k in one launch, each
    output bit for bit the single launch's (y with a bias of its own, x with none)."""
    g = _gen(12)
    x, y = randn(1, 7, H, D, dtype=torch.bfloat16, g=g), randn(1, 7, H, D, dtype=torch.bfloat16, g=g, offset=1)
    w, wy, by = (randn(D, dtype=torch.bfloat16, g=g, offset=1) for _ in range(3))
    cos, sin, tables = rope_tables("flux", 7, D, torch.float32, g)
    config = {"BLOCK_H": 8} if H == 24 else None
    args_x, args_y = (x, w, None, cos, sin, EPS, tables, 0), (y, wy, by, cos, sin, EPS, tables, 0)
    single_x = check(_layer_launch(config), layer_norm_rope_native, args_x, _layer_rope_mag(args_x))
    single_y = check(_layer_launch(config), layer_norm_rope_native, args_y, _layer_rope_mag(args_y))
    assert rope_k.layer_supports_pair(x, w, None, y, wy, by, cos, sin, EPS, tables, 0) is None
    out_x, out_y = rope_k._layer_norm_rope_pair_impl(x, w, None, y, wy, by, cos, sin, EPS, tables, 0)
    assert torch.equal(out_x, single_x) and torch.equal(out_y, single_y)


def test_layer_norm_rope_refuses_what_it_cannot_take():
    g = _gen(13)
    x = randn(1, 3, 2, 8, dtype=torch.bfloat16, g=g)
    cos, sin, tables = rope_tables("flux", 3, 8, torch.float32, g)
    supports = rope_k.layer_supports
    assert supports(x, None, x.new_ones(6), cos, sin, EPS, tables, 0) == "bias has shape (6,), expected (8,)"
    assert "head_dim 7 is odd" in supports(x[..., :7], None, None, cos[:, :7], sin[:, :7], EPS, tables, 0)
    assert supports(x, None, None, cos, sin, EPS, tables, 1) == "cos has shape (3, 8), expected (2, 8)"
    assert supports(x, None, None, cos[:0], sin[:0], EPS, tables, 3) == "start=3 is outside the 3 tokens"
    assert rope_k.layer_supports_pair(x, None, None, x[:, :2], None, None, cos, sin, EPS, tables, 0) == (
        "cos has shape (3, 8), expected (2, 8)"
    )


def test_rms_norm_rope_pair_refuses_calls_that_differ():
    g = _gen(10)
    x = randn(1, 3, 2, 8, dtype=torch.bfloat16, g=g)
    cos, sin, tables = rope_tables("flux", 3, 8, torch.float32, g)
    shared = (cos, sin, EPS, False, False, tables)
    assert "y has shape (1, 3, 1, 8), x (1, 3, 2, 8)" in rope_k.supports_pair(
        x, None, None, None, x[:, :, :1], None, None, None, *shared
    )
    cos5, sin5, _ = rope_tables("flux", 5, 8, torch.float32, g)
    tail = randn(1, 2, 2, 8, dtype=torch.bfloat16, g=g)
    assert rope_k.supports_pair(x, None, tail, None, x, None, None, None, cos5, sin5, *shared[2:]) == (
        "cos has shape (5, 8), expected (3, 8)"  # y without the tail does not span the tables
    )


# ------------------------------------------------------------------ supports, registry


def _fake(*shape, dtype=torch.bfloat16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype)


def test_supports_reasons():
    x = _fake(2, 8, 64)
    assert rms_k.supports(x=x, weight=None, eps=EPS, cast_before_weight=False) is None
    assert "int32" in rms_k.supports(x=_fake(2, 8, dtype=torch.int32), weight=None, eps=EPS, cast_before_weight=False)
    assert "float64" in rms_k.supports(x=x, weight=_fake(64, dtype=torch.float64), eps=EPS, cast_before_weight=False)
    assert "shape" in rms_k.supports(x=x, weight=_fake(32), eps=EPS, cast_before_weight=False)
    assert "65536" in rms_k.supports(x=_fake(1, 70000), weight=None, eps=EPS, cast_before_weight=False)

    assert adaln_k.supports(x, _fake(2, 1, 64), None, EPS, "layer", True) is None
    assert "norm" in adaln_k.supports(x, None, None, EPS, "group", True)
    assert "broadcast" in adaln_k.supports(x, _fake(3, 1, 64), None, EPS, "layer", True)
    assert "[B, S, D]" in adaln_k.supports(_fake(8, 64), None, None, EPS, "layer", True)

    assert gated_k.supports(x, x, _fake(2, 1, 64, dtype=torch.float32)) is None
    assert "gate" in gated_k.supports(x, x, _fake(2, 64))
    assert "y has shape" in gated_k.supports(x, _fake(2, 4, 64), _fake(2, 1, 64))
    assert "int64" in gated_k.supports(x, x, _fake(2, 1, 64, dtype=torch.int64))

    q = _fake(1, 8, 4, 64)
    tab = _fake(8, 64, dtype=torch.float32)

    def rope(**kw):
        args = {
            "x": q,
            "weight": _fake(64),
            "x_tail": None,
            "weight_tail": None,
            "cos": tab,
            "sin": tab,
            "eps": EPS,
            "cast_before_weight": False,
            "across_heads": False,
            "tables": "per_element",
        }
        args.update(kw)
        return rope_k.supports(**args)

    assert rope() is None
    assert rope(tables="per_pair") is None
    assert rope(tables="halves") is None
    assert rope(tables="quarters") == (
        "tables='quarters'; the kernel reads 'per_element', 'per_pair', 'halves', 'per_head' tables"
    )
    assert "odd" in rope(x=_fake(1, 8, 4, 63), weight=None, cos=_fake(8, 63), sin=_fake(8, 63))
    assert "expected (256,)" in rope(across_heads=True)
    assert "sin has shape (9, 64), expected (8, 64)" in rope(sin=_fake(9, 64))
    assert "x_tail" in rope(x_tail=_fake(1, 4, 4, 64, dtype=torch.float16))
    assert "different dtypes" in rope(x_tail=_fake(1, 2, 4, 64), weight_tail=_fake(64, dtype=torch.float32),
                                      cast_before_weight=True, cos=_fake(10, 64), sin=_fake(10, 64))  # fmt: skip
    assert "65536" in rope(x=_fake(1, 8, 600, 128), weight=None, across_heads=True, cos=_fake(8, 128),
                           sin=_fake(8, 128))  # fmt: skip
    assert "int8" in rope(sin=_fake(8, 64, dtype=torch.int8))


def test_registry_resolves_the_interpreted_kernel():
    platform = current_platform("cpu")
    g = _gen(9)
    x = randn(2, 4, 3, 16, dtype=torch.bfloat16, g=g)
    w = randn(16, dtype=torch.bfloat16, g=g)
    args = {"x": x, "weight": w, "eps": EPS, "cast_before_weight": False}
    op = FUSED_OPS["rms_norm"]
    assert set(FUSED_OPS) >= {"rms_norm", "adaln", "gated_residual", "rms_norm_rope"}
    for name in FUSED_OPS:
        assert "triton" in FUSED_OPS[name].kernels, name
    if DEV == "cpu":
        # auto never picks the interpreter; asked for by name it runs.
        assert op.resolve(platform, args).implementation == "native"
    res = op.resolve(current_platform(DEV), args, "triton")
    assert res.implementation == "triton"
    out = op.kernels["triton"].overload(**args)
    assert torch.equal(out, rms_norm_native(x, w, EPS, False))
    bad = dict(args, x=x.to(torch.int32))
    with pytest.raises(KernelUnavailableError, match="int32"):
        op.resolve(current_platform(DEV), bad, "triton")


# ------------------------------------------------------------------ GPU: the FLUX (W1) and Wan (W2) shapes


def gpu_cases():
    """(name, op, launch, native, args factory, mag) at the benchmark shapes, bf16, batch 1."""
    bf = torch.bfloat16

    def flux_rms():
        return (randn(1, 4608, 24, 128, dtype=bf), randn(128, dtype=bf), EPS, False)

    def wan_rms():
        return (randn(1, 32760, 1536, dtype=bf), randn(1536, dtype=bf), EPS, False)

    def flux_adaln():
        emb = randn(1, 3 * 3072, dtype=bf, scale=0.5)
        shift, scale, _ = emb.chunk(3, dim=1)
        return (randn(1, 4608, 3072, dtype=bf), scale[:, None], shift[:, None], EPS, "layer", True)

    def wan_adaln():
        shift, scale, *_ = randn(1, 6, 1536, scale=0.5).chunk(6, dim=1)
        return (randn(1, 32760, 1536, dtype=bf), scale, shift, EPS, "layer", False)

    def flux_gate():
        gate = randn(1, 3 * 3072, dtype=bf).chunk(3, dim=1)[2][:, None]
        return (randn(1, 4096, 3072, dtype=bf), randn(1, 4096, 3072, dtype=bf), gate)

    def wan_gate():
        return (randn(1, 32760, 1536, dtype=bf), randn(1, 32760, 1536, dtype=bf), randn(1, 6, 1536).chunk(6, 1)[5])

    def flux_rope(tail):
        def make():
            tabs = rope_tables("flux", 4608, 128, torch.float32, None)
            w = randn(128, dtype=bf)
            if tail:
                return rope_args(randn(1, 512, 24, 128, dtype=bf), w, randn(1, 4096, 24, 128, dtype=bf),
                                 randn(128, dtype=bf), tabs, False, False)  # fmt: skip
            return rope_args(randn(1, 4608, 24, 128, dtype=bf), w, None, None, tabs, False, False)

        return make

    def mochi_rope():  # 24 x 128, 4,096 tokens, a table per head ([S, H, D/2] fp32)
        ang = randn(4096, 24, 64, scale=3)
        return (randn(1, 4096, 24, 128, dtype=bf), randn(128, dtype=bf), None, None, ang.cos(), ang.sin(), EPS, True,
                False, "per_head")  # fmt: skip

    def cogview4_rope():  # 32 x 128, 224 text tokens + 4,096 rotated image tokens, rotate-half, no affine
        cos, sin, tables = rope_tables("halves", 4096, 128, torch.float32, None)
        return (randn(1, 32, 4320, 128, dtype=bf).transpose(1, 2), None, None, cos, sin, 1e-5, tables, 224)

    def hunyuan_dit_rope():  # 16 x 88, 4,096 tokens, weight and bias
        cos, sin, tables = rope_tables("flux", 4096, 88, torch.float32, None)
        return (randn(1, 4096, 16, 88, dtype=bf), randn(88, dtype=bf, offset=1), randn(88, dtype=bf), cos, sin, EPS,
                tables, 0)  # fmt: skip

    def wan_rope():
        tabs = rope_tables("wan", 32760, 128, bf, None)
        return rope_args(randn(1, 32760, 12, 128, dtype=bf), randn(1536, dtype=bf), None, None, tabs, False, True)

    return [
        ("flux_rms_norm", rms_k._launch, rms_norm_native, flux_rms, None),
        ("wan_rms_norm", rms_k._launch, rms_norm_native, wan_rms, None),
        ("flux_adaln", adaln_k._launch, adaln_native, flux_adaln, lambda a: _adaln_mag(*a[:4], a[4])),
        ("wan_adaln", adaln_k._launch, adaln_native, wan_adaln, lambda a: _adaln_mag(*a[:4], a[4])),
        ("flux_gated_residual", gated_k._launch, gated_residual_native, flux_gate, lambda a: _gated_mag(*a)),
        ("wan_gated_residual", gated_k._launch, gated_residual_native, wan_gate, lambda a: _gated_mag(*a)),
        ("flux_single_rms_norm_rope", rope_k._launch, rms_norm_rope_native, flux_rope(False), _rope_mag),
        ("flux_double_rms_norm_rope", rope_k._launch, rms_norm_rope_native, flux_rope(True), _rope_mag),
        ("wan_rms_norm_rope", rope_k._launch, rms_norm_rope_native, wan_rope, _rope_mag),
        ("mochi_rms_norm_rope", rope_k._launch, rms_norm_rope_native, mochi_rope, _rope_mag),
        ("cogview4_layer_norm_rope", _layer_launch(), layer_norm_rope_native, cogview4_rope, _layer_rope_mag),
        ("hunyuan_dit_layer_norm_rope", _layer_launch(), layer_norm_rope_native, hunyuan_dit_rope, _layer_rope_mag),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", gpu_cases(), ids=lambda c: c[0])
def test_kernels_at_model_shapes_on_cuda(case):
    _, launch, native, make, mag = case
    torch.manual_seed(0)
    args = make()
    check(launch, native, args, mag(args) if mag else None)


@pytest.mark.gpu
@pytest.mark.compile
def test_triton_ops_inside_torch_compile():
    """Inductor embeds the triton_ops (fullgraph, no graph break) and computes the same values, bit for bit
    (it passes `eps` as fp64: the kernels cast it, or the norms would run in fp64), on several inputs."""
    torch._dynamo.reset()
    bf = torch.bfloat16

    def fn(x, w, h, emb, cos, sin, wan_cos, wan_sin, freqs):
        shift, scale, gate = emb.chunk(3, dim=1)
        q = ops.rms_norm_rope_triton(x, w, None, None, cos, sin, EPS, False, False, "per_element")
        # Wan's form at W2's shape class: norm across heads, per-pair tables (measured wrong in a graph before).
        k = ops.rms_norm_rope_triton(x, x.new_ones(4 * 64), None, None, wan_cos, wan_sin, EPS, False, True, "per_pair")
        # the complex form (Qwen-Image's): one complex table's real view passed as both per-pair tables
        table = torch.view_as_real(freqs).reshape(freqs.shape[0], -1)
        c = ops.rms_norm_rope_triton(x, w, None, None, table, table, EPS, False, False, "per_pair")
        # rotate-half (Cosmos'): pair i is (i, i + D/2), per-element tables
        r = ops.rms_norm_rope_triton(x, w, None, None, cos, sin, EPS, False, False, "halves")
        # LayerNorm per head with weight and bias (HunyuanDiT's QK-norm), then FLUX-style tables
        ln = ops.layer_norm_rope_triton(x, w, w * 0.5, cos[3:], sin[3:], EPS, "per_element", 3)
        n = ops.rms_norm_triton(x, w, EPS, False)
        a = ops.adaln_triton(h, scale[:, None], shift[:, None], EPS, "layer", True)
        return q, k, c, r, ln, n, a, ops.gated_residual_triton(h, a * 2, gate[:, None])

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for seed in range(4):
        g = _gen(seed)
        args = (randn(1, 256, 4, 64, dtype=bf, g=g), randn(64, dtype=bf, g=g), randn(1, 256, 256, dtype=bf, g=g),
                randn(1, 3 * 256, dtype=bf, g=g), *rope_tables("flux", 256, 64, torch.float32, g)[:2],
                *rope_tables("wan", 256, 64, bf, g)[:2],
                torch.polar(torch.ones(256, 32, device=DEV), randn(256, 32, g=g)))  # fmt: skip
        names = ("rope", "wan_rope", "complex_rope", "halves_rope", "layer_norm_rope", "rms_norm", "adaln", "gated")
        outs = fn(*args)
        for name, e, c in zip(names, outs, compiled(*args), strict=True):
            assert torch.equal(e, c), f"seed {seed}: {name}: {int((e != c).sum())} elements differ"
        # and the halves against the native op (float math in another order: within 2 bf16 ulps)
        ref = rms_norm_rope_native(args[0], args[1], None, None, args[4], args[5], EPS, False, False, "halves")
        assert (outs[3].float() - ref.float()).abs().max() <= 2 * 2**-8 * ref.float().abs().max()
    torch._dynamo.reset()


def test_launchers_pass_each_input_once(monkeypatch):
    """A pointer argument the launch never uses gets a spare one-element tensor, never an input again: Inductor
    stores a not-yet-stored value once per argument it is passed as (LTX-Video's residual sum, five times)."""
    from omni_compile.attention import triton_attn

    launches = []

    class Recorder:
        def __init__(self, kernel):
            pass

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append([a for a in args if isinstance(a, torch.Tensor)])

    for module in (adaln_k, rms_k, rope_k, triton_attn):
        monkeypatch.setattr(module, "launcher", Recorder)
    x, d = torch.randn(1, 8, 64), torch.randn(1, 8, 4, 16)
    adaln_k._launch(x, None, x[:, :1], 1e-6, "layer", True, torch.empty_like(x))  # no scale, weight, bias, quant
    rms_k._launch(x, None, 1e-6, False, torch.empty_like(x))
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    rope_k._launch(d, None, None, None, cos, sin, 1e-6, False, False, "per_element", torch.empty_like(d))
    triton_attn._launch(d, d.clone(), d.clone(), None, 0.25, torch.empty_like(d))
    for tensors in launches:  # every tensor once: inputs and spares alike
        assert len({id(t) for t in tensors}) == len(tensors), [tuple(t.shape) for t in tensors]
        assert any(t.numel() == 1 for t in tensors)  # a spare
    assert len(launches) == 4


@pytest.mark.gpu
@pytest.mark.compile
def test_a_computed_input_is_stored_once_on_cuda():
    """adaln of a sum inside a compiled graph: Inductor's add kernel stores the sum once (the kernel's unused
    pointers get a spare, not the sum again: it was stored five times)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()

    def fn(a, b, scale, shift):
        return ops.adaln_triton(a + b, scale, shift, EPS, "layer", True)

    g = _gen(0)
    args = [randn(1, 256, 256, dtype=torch.bfloat16, g=g) for _ in range(2)]
    args += [randn(1, 1, 256, dtype=torch.bfloat16, g=g) for _ in range(2)]
    out, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), *args)
    assert torch.equal(out, fn(*args))
    generated = [k for k in code.split("async_compile.triton(")[1:] if k.lstrip().startswith("'triton_poi")]
    # one kernel of Inductor's own, the add, storing once: no copies of the spares either
    assert [k.split("device_str")[0].count("tl.store") for k in generated] == [1], code
    torch._dynamo.reset()


PTX_CHECK = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from omni_compile.ops.kernels import rms_norm_rope as rope_k

forms = {  # the kernel's constexpr forms: FLUX's joint pair, Wan's, rotate-half, Mochi's, LayerNorm's
    "flux-joint-pair": dict(HAS_TAIL=True, HAS_WT=True, PAIR=True, HAS_WY=True, HAS_WYT=True),
    "wan-across-pair": dict(PER_PAIR=True, ACROSS=True, BLOCK_H=16, PAIR=True, HAS_WY=True),
    "halves-stride2": dict(HALVES=True, SPLIT=False),
    "per-head-pair": dict(PER_HEAD=True, CAST_BEFORE_W=True, PAIR=True, HAS_WY=True),
    "layer-bias-pair": dict(LAYER=True, HAS_BX=True, PAIR=True, HAS_WY=True, HAS_BY=True),
    "layer-halves-stride2": dict(LAYER=True, HALVES=True, SPLIT=False, HAS_W=False),
}
kernel = rope_k._rms_norm_rope_kernel
ints = {"S1", "S_total", "START", "H", "D"}
signature = {}
for p in kernel.params:
    if p.is_constexpr:
        signature[p.name] = "constexpr"
    elif p.name.endswith("_ptr"):
        signature[p.name] = "*fp32" if p.name in ("c_ptr", "s_ptr") else "*bf16"
    else:
        signature[p.name] = "fp32" if p.name == "eps" else "i32" if p.name in ints else "i64"
result = {}
for form, over in forms.items():
    flags = dict(SXD=1, SXTD=1, SW=1, SBX=1, SWT=1, SYD=1, SYTD=1, SWY=1, SBY=1, SWYT=1, SCD=1, SSD=1, PER_PAIR=False,
                 PER_HEAD=False, HALVES=False, HAS_TAIL=False, HAS_W=True, HAS_BX=False, HAS_WT=False, PAIR=False,
                 HAS_WY=False, HAS_BY=False, HAS_WYT=False, LAYER=False, CAST_BEFORE_W=False, ACROSS=False, SPLIT=True,
                 BLOCK_H=8, BLOCK_HALF=64, EMULATE_RTNE=False)
    flags.update(over)
    assert set(flags) == {n for n, t in signature.items() if t == "constexpr"}, set(flags) ^ set(signature)
    src = ASTSource(fn=kernel, signature=signature, constexprs=flags)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    result[form] = ".entry _rms_norm_rope_kernel" in ptx
print(json.dumps(result))
"""


def test_rope_kernel_forms_compile_for_sm90(subprocess_env):
    """Each form of the rms_norm_rope kernel (FLUX's, Wan's, rotate-half, per-head tables, LayerNorm) compiles to PTX
    for an H100/H200 (sm_90) with Triton's own ptxas, no GPU needed: what the interpreter does not check (the types
    and layouts the compiler assigns). In a subprocess without TRITON_INTERPRET (interpreted kernels do not compile)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in subprocess_env.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PTX_CHECK], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict.fromkeys(result, True) and len(result) == 6, result
