"""The complex_mul pass: the complex form of RoPE (`view_as_real(view_as_complex(x) * freqs_cis)`) in real
arithmetic, so Inductor compiles it instead of falling back to eager for complex operators. ATen graphs as
Inductor's post-grad passes see them, and Qwen-Image and Lumina2 (tiny) through Inductor."""

import pytest
import torch

from omni_compile.config import CompileConfig

from conftest import rel_l2
from test_passes import AtenGraph, fired, run_passes, targets

CONFIG = CompileConfig(passes=["-lower_fused_ops"])


def qwen_rope(x, freqs):
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    return apply_rotary_emb_qwen(x, freqs, use_real=False)


def rope64(x, freqs):
    """float64 reference: the same rotation on complex128 values."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.to(torch.complex128).unsqueeze(1)).flatten(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["x*f", "f*x"])
def test_complex_rope_in_real_arithmetic(dtype, order):
    x = torch.randn(2, 16, 3, 8, dtype=dtype)
    freqs = torch.polar(torch.ones(16, 4), torch.randn(16, 4))
    fn = qwen_rope if order == "x*f" else (
        lambda x, f: torch.view_as_real(f.unsqueeze(1) * torch.view_as_complex(x.float().reshape(2, 16, 3, 4, 2)))
        .flatten(3).type_as(x))  # fmt: skip
    with torch.no_grad():
        gm = AtenGraph(fn, x, freqs)
        eager = fn(x, freqs)
        assert "aten.view_as_complex.default" in targets(gm)
        log = run_passes(gm, CONFIG)
        assert fired(log).get("complex_mul") == 1
        assert "aten.view_as_complex.default" not in targets(gm)
        out = gm(x, freqs)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_l2(out, eager) < tol and rel_l2(out, rope64(x, freqs)) < tol


def test_a_product_used_elsewhere_is_left_alone():
    x = torch.randn(1, 4, 2, 8)
    freqs = torch.polar(torch.ones(4, 4), torch.randn(4, 4))

    def fn(x, f):
        p = torch.view_as_complex(x.reshape(1, 4, 2, 4, 2)) * f.unsqueeze(1)
        return torch.view_as_real(p).flatten(3), p.abs()

    with torch.no_grad():
        gm = AtenGraph(fn, x, freqs)
        log = run_passes(gm, CONFIG)
    assert "complex_mul" not in fired(log)


@pytest.mark.compile
@pytest.mark.parametrize("name", ["qwen-image", "lumina2"])
def test_through_inductor_no_complex_op_left(name, fresh_dynamo, no_inductor_cache, tmp_path):
    """Every rotation of q and k is rewritten, and fused with the norm before it: the graph Inductor lowers holds no
    complex op (only the `view_as_real` of the complex table, a view), and the output matches eager."""
    import omni_compile
    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model

    from dit_zoo import ZOO
    from generic_model import GENERIC_MODELS

    cls, config, inputs_ref, shape = {**GENERIC_MODELS, **ZOO}[name]
    spec = resolve_model(cls, example_inputs=inputs_ref, model_config=config)
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.float32, device="cpu", seed=1)
    with torch.no_grad():
        ref = model(**inputs)[0]
    omni_compile.compile(model, CompileConfig(dump_dir=str(tmp_path)), regions=spec.block_names(model),
                         adapter=spec.adapter)  # fmt: skip
    with torch.no_grad():
        out = model(**inputs)[0]
    records = omni_compile.compile_state(model).records
    assert records and all(r.passes["complex_mul"] >= 2 for r in records), [(r.region, r.passes) for r in records]
    # and each rotation fused with the q/k norm before it (qk_norm_rope's complex form)
    assert all(r.passes["qk_norm_rope"] == r.passes["complex_mul"] for r in records), [r.passes for r in records]
    finals = sorted(tmp_path.rglob("*.lower_fused_ops.after.py"))
    assert len(finals) == len(records)
    for f in finals:
        assert "aten.view_as_complex" not in f.read_text(), f
    assert rel_l2(out, ref) < 1e-5
