"""The qk_norm_rope pass on forms beyond FLUX's and Wan's own: the interleaved rotary embedding over all heads
(LTX-Video's: RMSNorm over H * D of the [B, S, H * D] projection, then `x * cos + stack([-x_odd, x_even]).flatten()
* sin` with [1, S, H * D] tables, before the unflatten to heads); the per-head norm in diffusers' rounding (cast to
the weight's dtype before the weight, HunyuanVideo's); and the rotary embedding on a prefix of the sequence only
(HunyuanVideo's single-stream block: image tokens rotated, text tokens appended as they are). Each becomes one
`omni_compile::rms_norm_rope`, values against eager and float64, through the Triton kernel (interpreter) too;
near misses stay untouched."""


import pytest
import torch

from omni_compile.config import CompileConfig

from conftest import rel_l2, require_triton_interpreter
from test_passes import AtenGraph, fired, run_passes, targets

ROPE = "omni_compile.rms_norm_rope.default"


def interleaved_rope(x, cos, sin):
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
    rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def tables(b, s, c, seed=0):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(b, s, c // 2, generator=g) * 6.28
    return angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)


def reference(x, w, cos, sin, eps):
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.detach().double()
    return interleaved_rope(n, cos.double(), sin.double())


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_over_all_heads_becomes_one_op(dtype, kernel):
    if kernel == "triton":
        require_triton_interpreter()
    c = 64  # 4 heads of 16
    norm = torch.nn.RMSNorm(c, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(c) * 0.5 + 1)
    x = torch.randn(2, 9, c, dtype=dtype) * 3
    cos, sin = tables(1, 9, c)

    def fn(x, cos, sin):
        return interleaved_rope(norm(x), cos, sin).unflatten(2, (4, -1))

    with torch.no_grad():
        gm = AtenGraph(fn, x, cos, sin)
        eager = fn(x, cos, sin)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert fired(log) == {"rms_norm": 1, "qk_norm_rope": 1}, fired(log)
        assert ROPE in targets(gm) and "aten.rsqrt.default" not in targets(gm)
        if kernel == "triton":  # lower it to the kernel, run under the interpreter
            log = run_passes(gm, CompileConfig(passes=["none", "+lower_fused_ops"], kernels={"rms_norm_rope": "triton"}))
            assert log.resolutions["rms_norm_rope"]["implementation"].startswith("triton")
        fused = gm(x, cos, sin)
    assert fused.dtype == dtype and fused.shape == eager.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ref = reference(x, norm.weight, cos, sin, 1e-6).unflatten(2, (4, -1))
    assert rel_l2(fused, eager) < tol and rel_l2(fused, ref) < tol


def assert_left_alone(fn, *args):
    """The passes leave `fn`'s graph without a qk_norm_rope, and its values as they were."""
    with torch.no_grad():
        gm = AtenGraph(fn, *args)
        before = fn(*args)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert "qk_norm_rope" not in fired(log) and ROPE not in targets(gm)
        assert rel_l2(gm(*args), before) < 1e-6


@pytest.mark.parametrize("case", ["per-sample-tables", "norm-used-elsewhere"])
def test_near_misses_are_left_alone(case):
    c = 32
    norm = torch.nn.RMSNorm(c, eps=1e-6)
    x = torch.randn(2, 5, c)
    if case == "per-sample-tables":  # a table per batch row: the op takes one table for the batch
        cos, sin = tables(2, 5, c)
        fn = lambda x, cos, sin: interleaved_rope(norm(x), cos, sin)  # noqa: E731
    else:  # the normalised q is also read elsewhere: fusing would compute the norm twice
        cos, sin = tables(1, 5, c)

        def fn(x, cos, sin):
            n = norm(x)
            return interleaved_rope(n, cos, sin) + n

    assert_left_alone(fn, x, cos, sin)


def per_head_rope(x, cos, sin):
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (cos, sin), sequence_dim=1)


def head_tables(s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(s, d // 2, generator=g) * 6.28
    return angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)


def make_norm(kind, d, dtype):
    from diffusers.models.normalization import RMSNorm

    norm = (RMSNorm(d, eps=1e-6) if kind == "diffusers" else torch.nn.RMSNorm(d, eps=1e-6)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d) * 0.5 + 1)
    return norm


def head_reference(x, w, cos, sin, rotated: int):
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.detach().double()
    return torch.cat([per_head_rope(n[:, :rotated], cos.double(), sin.double()), n[:, rotated:]], dim=1)


def one_fused_op(fn, args, kernel):
    """`fn`'s graph through the passes, which must make one rms_norm and fuse it into one qk_norm_rope, then
    lowered to the Triton kernel (interpreter) for kernel="triton": (the op's arguments, the graph's targets
    with the op, fn's output, the graph's output)."""
    with torch.no_grad():
        gm = AtenGraph(fn, *args)
        eager = fn(*args)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert fired(log) == {"rms_norm": 1, "qk_norm_rope": 1}, fired(log)
        (op,) = [n for n in gm.graph.nodes if n.target == torch.ops.omni_compile.rms_norm_rope.default]
        op_args, fused_targets = op.args, targets(gm)
        if kernel == "triton":
            log = run_passes(gm, CompileConfig(passes=["none", "+lower_fused_ops"], kernels={"rms_norm_rope": "triton"}))
            assert log.resolutions["rms_norm_rope"]["implementation"].startswith("triton")
        return op_args, fused_targets, eager, gm(*args)


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["whole", "prefix"])
@pytest.mark.parametrize("norm_kind", ["torch", "diffusers"])
def test_per_head_norm_then_rope_in_either_rounding(norm_kind, form, dtype, kernel):
    """FLUX's form (the whole sequence rotated) and HunyuanVideo's single-stream form (a prefix rotated), with
    torch's RMSNorm or diffusers' (which rounds before the weight in half precision)."""
    if kernel == "triton":
        require_triton_interpreter()
    b, s, text, h, d = 2, 11, 4 if form == "prefix" else 0, 3, 16
    norm = make_norm(norm_kind, d, dtype)
    x = torch.randn(b, s, h, d, dtype=dtype) * 3
    cos, sin = head_tables(s - text, d)

    def fn(x, cos, sin):
        n = norm(x)
        if not text:
            return per_head_rope(n, cos, sin)
        return torch.cat([per_head_rope(n[:, :-text], cos, sin), n[:, -text:]], dim=1)

    op_args, fused_targets, eager, fused = one_fused_op(fn, (x, cos, sin), kernel)
    cbw = norm_kind == "diffusers" and dtype == torch.bfloat16  # diffusers' RMSNorm casts only to a half weight
    assert op_args[7] is cbw and "aten.rsqrt.default" not in fused_targets
    assert fused.dtype == eager.dtype and fused.shape == eager.shape
    ref = head_reference(x, norm.weight, cos, sin, s - text)
    if dtype == torch.float32:
        assert rel_l2(fused, eager) < 1e-6 and rel_l2(fused, ref) < 1e-5
    else:  # the same roundings as eager: equal but for the order of fp32 operations
        assert rel_l2(fused, eager) < 4e-3 and rel_l2(fused, ref) < 1e-2
    if form == "prefix" and kernel == "native":  # the text tail is the norm's output as it is
        assert torch.equal(fused[:, s - text :], eager[:, s - text :])


@pytest.mark.parametrize("case", ["tail-rotated-too", "gap", "tail-read-twice"])
def test_prefix_near_misses_are_left_alone(case):
    d, s, text = 16, 9, 3
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    x = torch.randn(1, s, 2, d)
    cos, sin = head_tables(s - text, d)
    fns = {
        # the tail gets its own (different) rotation: not the identity the fused op would apply
        "tail-rotated-too": lambda n: torch.cat([per_head_rope(n[:, :-text], cos, sin),
                                                 per_head_rope(n[:, -text:], cos[:text], sin[:text])], 1),
        # a token dropped between the rotated part and the tail
        "gap": lambda n: torch.cat([per_head_rope(n[:, : s - text], cos, sin), n[:, s - text + 1 :]], 1),
        "tail-read-twice": lambda n: torch.cat([per_head_rope(n[:, :-text], cos, sin), n[:, -text:]], 1) + n.sum(),
    }  # fmt: skip

    def fn(x, cos, sin):
        return fns[case](norm(x))

    assert_left_alone(fn, x, cos, sin)


def complex_rope(x, freqs, unsqueeze_dim):
    """diffusers' complex rotary embedding (`apply_rotary_emb(..., use_real=False)`, Qwen-Image's, Z-Image's)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.unsqueeze(unsqueeze_dim)).flatten(3).type_as(x)


def complex_table(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.polar(torch.ones(shape, dtype=dtype), (torch.rand(shape, generator=g) * 6.28).to(dtype))


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["S,D/2 (Qwen-Image)", "1,S,D/2 (Z-Image)", "1,S,D/2 complex128 (Lumina2)"])
@pytest.mark.parametrize("norm_kind", ["torch", "diffusers"])
def test_per_head_norm_then_complex_rope(norm_kind, table, dtype, kernel):
    """The complex form: after `complex_mul` writes the product on real pairs, the norm and the rotation become one
    op reading the complex table's real view as both of its per-pair tables (a complex128 table in fp32)."""
    if kernel == "triton":
        require_triton_interpreter()
    b, s, h, d = 2, 7, 3, 16
    norm = make_norm(norm_kind, d, dtype)
    x = torch.randn(b, s, h, d, dtype=dtype) * 3
    freqs = complex_table((s, d // 2) if table.startswith("S") else (1, s, d // 2),
                          dtype=torch.float64 if "complex128" in table else torch.float32)  # fmt: skip
    dim = 1 if table.startswith("S") else 2

    def fn(x, freqs):
        return complex_rope(norm(x), freqs, dim)

    with torch.no_grad():
        gm = AtenGraph(fn, x, freqs)
        eager = fn(x, freqs)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert fired(log) == {"complex_mul": 1, "rms_norm": 1, "qk_norm_rope": 1}, fired(log)
        assert ROPE in targets(gm) and "aten.rsqrt.default" not in targets(gm)
        if kernel == "triton":
            log = run_passes(gm, CompileConfig(passes=["none", "+lower_fused_ops"], kernels={"rms_norm_rope": "triton"}))
            assert log.resolutions["rms_norm_rope"]["implementation"].startswith("triton")
        fused = gm(x, freqs)
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.detach().double()
    ref = torch.view_as_real(torch.view_as_complex(n.reshape(b, s, h, -1, 2)) * freqs.to(torch.complex128).unsqueeze(dim)).flatten(3)
    assert fused.dtype == dtype and fused.shape == eager.shape
    if dtype == torch.float32:
        assert rel_l2(fused, eager) < 1e-6 and rel_l2(fused, ref) < 1e-5
    else:
        assert rel_l2(fused, eager) < 4e-3 and rel_l2(fused, ref) < 1e-2


@pytest.mark.parametrize("case", ["per-sample-table", "norm-used-elsewhere"])
def test_complex_near_misses_are_left_alone(case):
    b, s, h, d = 2, 5, 2, 8
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    x = torch.randn(b, s, h, d)
    if case == "per-sample-table":  # [B, S, D/2] with B > 1: the op takes one table for the batch
        freqs = complex_table((b, s, d // 2))
        fn = lambda x, f: complex_rope(norm(x), f, 2)
    else:
        freqs = complex_table((s, d // 2))

        def fn(x, f):
            n = norm(x)
            return complex_rope(n, f, 1) + n

    assert_left_alone(fn, x, freqs)


def halves_rope(x, cos, sin, sequence_dim):
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-2, sequence_dim=sequence_dim)


def halves_tables(s, d, seed=0):
    """Rotate-half tables: [S, D], angle i and i + D/2 equal, as the models make them (cat of two copies)."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(s, d // 2, generator=g) * 6.28
    return torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["heads-first", "sequence-second"])
@pytest.mark.parametrize("norm_kind", ["torch", "diffusers"])
def test_per_head_norm_then_rotate_half_rope(norm_kind, layout, dtype, kernel):
    """Rotate-half RoPE (`apply_rotary_emb(use_real_unbind_dim=-2)`): Cosmos, CogView4 and OmniGen rotate q/k
    [B, H, S, D] (`sequence_dim=2`), ACE-Step [B, S, H, D] (`sequence_dim=1`); one op either way, the heads-first
    q a transposed view of it. 5 heads against 7 tokens: the layouts cannot be confused."""
    if kernel == "triton":
        require_triton_interpreter()
    b, s, h, d = 2, 7, 5, 20
    seq = 2 if layout == "heads-first" else 1
    norm = make_norm(norm_kind, d, dtype)
    x = torch.randn(b, h, s, d, dtype=dtype) * 3 if seq == 2 else torch.randn(b, s, h, d, dtype=dtype) * 3
    cos, sin = halves_tables(s, d)

    def fn(x, cos, sin):
        return halves_rope(norm(x), cos, sin, seq)

    op_args, fused_targets, eager, fused = one_fused_op(fn, (x, cos, sin), kernel)
    assert op_args[9] == "halves" and not {"aten.rsqrt.default", "aten.cat.default"} & set(fused_targets)
    assert fused.dtype == eager.dtype and fused.shape == eager.shape
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.detach().double()
    ref = halves_rope(n, cos.double(), sin.double(), seq)
    if dtype == torch.float32:
        assert rel_l2(fused, eager) < 1e-6 and rel_l2(fused, ref) < 1e-5
    else:
        assert rel_l2(fused, eager) < 4e-3 and rel_l2(fused, ref) < 1e-2


@pytest.mark.parametrize("case", ["pairs-not-halves", "halves-swapped", "norm-used-elsewhere"])
def test_rotate_half_near_misses_are_left_alone(case):
    """What looks like rotate-half but is not, exactly: the halves read as pairs (a reshape to [..., D/2, 2]), the
    rotated copy built as cat([first, -second]), the normalised q read elsewhere too."""
    b, h, s, d = 1, 3, 5, 8
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    x = torch.randn(b, h, s, d)
    cos, sin = halves_tables(s, d)

    def fn(x, cos, sin):
        n = norm(x)
        if case == "pairs-not-halves":
            first, second = n.reshape(b, h, s, d // 2, 2).unbind(-1)
            rotated = torch.cat([-second, first], dim=-1)
        elif case == "halves-swapped":
            first, second = n.reshape(b, h, s, 2, d // 2).unbind(-2)
            rotated = torch.cat([first, -second], dim=-1)
        else:
            return halves_rope(n, cos, sin, 2) + n
        return n * cos[None, None] + rotated * sin[None, None]

    assert_left_alone(fn, x, cos, sin)


# ---------------------------------------------------------------- LayerNorm QK-norm (CogView4, HunyuanDiT)
LAYER_ROPE = torch.ops.omni_compile.layer_norm_rope.default


def make_layer_norm(affine, d, dtype):
    norm = torch.nn.LayerNorm(d, eps=1e-5, elementwise_affine=affine != "none", bias=affine == "weight_bias")
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(d) * 0.5 + (1 if p is norm.weight else 0))
    return norm.to(dtype)


def rope_of(tables, x, cos, sin, seq):
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-2 if tables == "halves" else -1,
                            sequence_dim=seq)  # fmt: skip


def layer_chain(norm, tables, seq, start):
    """q normalised per head, then rotated from token `start` on: as HunyuanDiT writes it (start 0, a new tensor)
    and as CogView4 does (the image tokens after the text, written into the normalised q in place)."""

    def fn(x, cos, sin):
        n = norm(x)
        if not start:
            return rope_of(tables, n, cos, sin, seq)
        part = n[:, :, start:] if seq == 2 else n[:, start:]
        rotated = rope_of(tables, part, cos, sin, seq)
        if seq == 2:
            n[:, :, start:] = rotated
        else:
            n[:, start:] = rotated
        return n

    return fn


LAYER_FORMS = [  # (affine, tables, layout, start)
    ("weight_bias", "per_element", "heads-first", 0),  # HunyuanDiT
    ("none", "halves", "heads-first", 3),  # CogView4
    ("weight", "per_element", "sequence-second", 3),
    ("weight_bias", "halves", "sequence-second", 0),
    ("none", "per_element", "heads-first", 0),
    ("weight_bias", "halves", "heads-first", 3),
]


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine,tables,layout,start", LAYER_FORMS, ids=["-".join(map(str, f)) for f in LAYER_FORMS])
def test_per_head_layer_norm_then_rope(affine, tables, layout, start, dtype, kernel):
    """A LayerNorm QK-norm (with weight and bias, weight only or none) then RoPE (per-element or rotate-half tables,
    heads-first or sequence-second q, on every token or from a token on, written in place): one
    `omni_compile::layer_norm_rope`, against eager and float64, through the Triton kernel too. 5 heads against 7
    tokens: the layouts cannot be confused."""
    if kernel == "triton":
        require_triton_interpreter()
    b, s, h, d = 2, 7, 5, 12
    seq = 2 if layout == "heads-first" else 1
    norm = make_layer_norm(affine, d, dtype)
    x = (torch.randn(b, h, s, d) if seq == 2 else torch.randn(b, s, h, d)) * 3 + 1
    x = x.to(dtype)
    g = torch.Generator().manual_seed(1)
    angle = torch.rand(s - start, d, generator=g) * 6.28  # a column of its own per element: a misread column shows
    cos, sin = angle.cos(), angle.sin()
    fn = layer_chain(norm, tables, seq, start)
    with torch.no_grad():
        gm = AtenGraph(fn, x, cos, sin)
        eager = fn(x.clone(), cos, sin)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert fired(log) == {"qk_norm_rope": 1}, fired(log)
        (op,) = [n for n in gm.graph.nodes if n.target == LAYER_ROPE]
        assert op.args[6:] == (tables, start) and not {"aten.var_mean.correction", "aten.cat.default"} & targets(gm)
        if kernel == "triton":
            log = run_passes(gm, CompileConfig(passes=["none", "+lower_fused_ops"], kernels={"layer_norm_rope": "triton"}))
            assert log.resolutions["layer_norm_rope"]["implementation"].startswith("triton")
        fused = gm(x.clone(), cos, sin)
        ref_norm = torch.nn.LayerNorm(d, eps=1e-5, elementwise_affine=affine != "none", bias=affine == "weight_bias")
        ref_norm = ref_norm.double()
        ref_norm.load_state_dict({k: v.double() for k, v in norm.state_dict().items()})
        ref = layer_chain(ref_norm, tables, seq, start)(x.double(), cos.double(), sin.double())
    assert fused.dtype == eager.dtype and fused.shape == eager.shape
    if dtype == torch.float32:
        assert rel_l2(fused, eager) < 1e-6 and rel_l2(fused, ref) < 1e-5
    else:
        assert rel_l2(fused, eager) < 4e-3 and rel_l2(fused, ref) < 1e-2


@pytest.mark.parametrize("case", ["control", "unbiased-variance", "norm-over-heads", "norm-used-elsewhere",
                                  "suffix-elsewhere", "rotated-slice-not-written-back"])  # fmt: skip
def test_layer_norm_near_misses_are_left_alone(case):
    """What looks like a LayerNorm QK-norm and RoPE but is not, exactly: the variance with Bessel's correction, the
    statistics over another dim, the normalised q read elsewhere too, the rotated tokens written to other positions
    than the ones rotated, the rotated part returned without the unrotated one. The control, the same code written
    right, fuses."""
    b, h, s, d, start = 1, 3, 6, 8, 2
    x = torch.randn(b, h, s, d) + 1
    angle = torch.rand(s - start, d) * 6.28
    cos, sin = angle.cos(), angle.sin()

    def ln(x, dim=-1, correction=0):
        var, mean = torch.var_mean(x, dim, correction=correction, keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5)

    def fn(x, cos, sin):
        if case == "unbiased-variance":
            n = ln(x, correction=1)
        elif case == "norm-over-heads":
            n = ln(x, dim=1)
        else:
            n = ln(x)
        if case == "rotated-slice-not-written-back":
            return rope_of("halves", n[:, :, start:], cos, sin, 2)
        rotated = rope_of("halves", n[:, :, start:], cos, sin, 2)
        out = n.clone() if case == "norm-used-elsewhere" else n
        if case == "suffix-elsewhere":
            out[:, :, : s - start] = rotated
        else:
            out[:, :, start:] = rotated
        return out + n if case == "norm-used-elsewhere" else out

    if case != "control":
        return assert_left_alone(fn, x, cos, sin)
    with torch.no_grad():
        gm = AtenGraph(fn, x, cos, sin)
        eager = fn(x, cos, sin)
        assert fired(run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))) == {"qk_norm_rope": 1}
        assert rel_l2(gm(x, cos, sin), eager) < 1e-6


# ---------------------------------------------------------------- per-head tables (Mochi)
def mochi_rope(x, freqs_cos, freqs_sin, swap=False):
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()
    if swap:  # the odd elements taken for the even ones: another rotation
        x_even, x_odd = x_odd, x_even
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_kind", ["torch", "diffusers"])
def test_per_head_norm_then_rope_with_per_head_tables(norm_kind, dtype, kernel):
    """Mochi's rotation: the even and odd elements of the normalised q [B, S, H, D] in fp32 with [S, H, D/2] tables,
    a table per head (5 heads, 7 tokens); one op with the `per_head` tables, against eager and float64."""
    if kernel == "triton":
        require_triton_interpreter()
    b, s, h, d = 2, 7, 5, 12
    norm = make_norm(norm_kind, d, dtype)
    x = torch.randn(b, s, h, d, dtype=dtype) * 3
    angle = torch.rand(s, h, d // 2, generator=torch.Generator().manual_seed(2)) * 6.28
    cos, sin = angle.cos(), angle.sin()

    def fn(x, cos, sin):
        return mochi_rope(norm(x), cos, sin)

    op_args, fused_targets, eager, fused = one_fused_op(fn, (x, cos, sin), kernel)
    assert op_args[9] == "per_head" and "aten.rsqrt.default" not in fused_targets
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.detach().double()
    ref = mochi_rope(n, cos.double(), sin.double())
    assert fused.dtype == eager.dtype and fused.shape == eager.shape
    if dtype == torch.float32:
        assert rel_l2(fused, eager) < 1e-6 and rel_l2(fused, ref) < 1e-5
    else:
        assert rel_l2(fused, eager) < 4e-3 and rel_l2(fused, ref) < 1e-2


@pytest.mark.parametrize("case", ["even-odd-swapped", "per-sample-tables", "norm-used-elsewhere"])
def test_per_head_table_near_misses_are_left_alone(case):
    b, s, h, d = 2, 5, 3, 8
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    x = torch.randn(b, s, h, d)
    angle = torch.rand(b if case == "per-sample-tables" else 1, s, h, d // 2) * 6.28
    cos, sin = (angle.cos(), angle.sin()) if case == "per-sample-tables" else (angle.cos()[0], angle.sin()[0])

    def fn(x, cos, sin):
        n = norm(x)
        out = mochi_rope(n, cos, sin, swap=case == "even-odd-swapped")
        return out + n if case == "norm-used-elsewhere" else out

    assert_left_alone(fn, x, cos, sin)
