"""GPU checks (skipped without CUDA): the passes on the real CUDA graphs of the tiny presets in bf16."""

import pytest
import torch

import omni_compile
from omni_compile.config import ShapeBucket
from omni_compile.models import resolve_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "preset,shape,expected",
    [
        ("flux-tiny", "128x128", {"FluxTransformerBlock": 4, "FluxSingleTransformerBlock": 2}),
        ("wan-tiny", "64x96x9", {"WanTransformerBlock": 4}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiny_presets_on_cuda(preset, shape, expected, dtype, fresh_dynamo, no_inductor_cache):
    spec = resolve_model(preset)
    model = spec.load(dtype=dtype, device="cuda", seed=0)
    inputs = spec.adapter.example_inputs(
        model, ShapeBucket.parse(shape), dtype=dtype, device="cuda", text_len=spec.text_len, seed=1
    )
    with torch.no_grad():
        ref = model(**inputs)[0]
    omni_compile.compile(model)
    with torch.no_grad():
        out = model(**inputs)[0]
    records = omni_compile.compile_state(model).records
    assert {r.region: r.passes["rms_norm"] for r in records} == expected
    assert all(r.resolutions["rms_norm"]["implementation"] == "native" for r in records)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_op_matches_float64_on_cuda(dtype, with_weight):
    x = torch.randn(3, 77, 4, 128, device="cuda", dtype=dtype)
    w = torch.randn(128, device="cuda", dtype=dtype) if with_weight else None
    out = torch.full_like(x, float("nan"))
    out.copy_(torch.ops.omni_compile.rms_norm(x, w, 1e-6, False))
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    if w is not None:
        ref = ref * w.double()
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((out.double() - ref).norm() / ref.norm()) < tol
