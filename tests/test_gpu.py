"""GPU checks (skipped without CUDA): the passes on the real CUDA graphs of the tiny presets in bf16."""

import pytest
import torch

import omni_compile
from omni_compile.config import ShapeBucket
from omni_compile.models import resolve_model

from test_compile_models import FLUX_MATCHES, FUSION_PASSES, WAN_MATCHES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "preset,shape,expected",
    [
        ("flux-tiny", "128x128", FLUX_MATCHES),
        ("wan-tiny", "64x96x9", WAN_MATCHES),
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
    omni_compile.compile(model, omni_compile.CompileConfig(passes=["all"], kernels={"*": "triton"}))
    with torch.no_grad():
        out = model(**inputs)[0]
    records = omni_compile.compile_state(model).records
    assert {r.region: {p: r.passes[p] for p in FUSION_PASSES} for r in records} == expected
    # Asked for by name, every fused op lowers to its Triton kernel, embedded in Inductor's code.
    for r in records:
        assert r.resolutions, r.region
        for op, res in r.resolutions.items():
            assert res["implementation"] == "triton (embedded)", (r.region, op, res)
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


def test_kernels_are_embedded_in_inductor_code(fresh_dynamo, no_inductor_cache):
    """The generated code launches our Triton kernels itself: no call back into the op's Python."""
    from torch._inductor.utils import run_and_get_code

    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
    inputs = spec.adapter.example_inputs(
        model, ShapeBucket.parse("64x64"), dtype=torch.bfloat16, device="cuda", text_len=spec.text_len, seed=1
    )
    omni_compile.compile(model, omni_compile.CompileConfig(passes=["all"], kernels={"*": "triton"}))
    with torch.no_grad():
        _, codes = run_and_get_code(lambda: model(**inputs))
    code = "\n".join(codes)
    for kernel in ("_rms_norm_rope_kernel", "_adaln_kernel", "_gated_residual_kernel"):
        assert kernel in code, kernel
    assert "omni_compile.rms_norm_rope_triton" not in code and "omni_compile.adaln_triton" not in code


@pytest.mark.parametrize("preset,shape", [("flux-tiny", "128x128"), ("wan-tiny", "64x96x9")])
def test_paired_rope_launch_matches_separate_launches(preset, shape, fresh_dynamo, no_inductor_cache):
    """q's and k's norm + RoPE as one launch (the default) give what two launches give, on the compiled model,
    and both stay at the eager model's level (bf16)."""
    spec = resolve_model(preset)
    outs, paired = {}, {}
    for pair in (True, False):
        torch._dynamo.reset()
        model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
        inputs = spec.adapter.example_inputs(
            model, ShapeBucket.parse(shape), dtype=torch.bfloat16, device="cuda", text_len=spec.text_len, seed=1
        )
        with torch.no_grad():
            ref = model(**inputs)[0].double()
        omni_compile.compile(model, omni_compile.CompileConfig(pass_options={"lower_fused_ops": {"pair": pair}}))
        with torch.no_grad():
            outs[pair] = model(**inputs)[0].double()
        records = omni_compile.compile_state(model).records
        paired[pair] = [r.resolutions.get("rms_norm_rope", {}).get("paired", 0) for r in records]
        assert float((outs[pair] - ref).norm() / ref.norm()) < 1e-2, pair
    assert all(n == 2 for n in paired[True]) and not any(paired[False]), paired
    assert float((outs[True] - outs[False]).norm() / outs[False].norm()) < 1e-3


@pytest.mark.parametrize("name,rotated", [("cogview4", 2), ("hunyuan-dit", 3)])
def test_layer_norm_qk_norm_and_rope_on_cuda(name, rotated, fresh_dynamo, no_inductor_cache):
    """A LayerNorm QK-norm and its RoPE (CogView4: no affine, rotate-half on the image tokens; HunyuanDiT: weight and
    bias, per-element tables, q and k of self-attention, q of cross-attention) as `layer_norm_rope` launches of the
    Triton kernel (asked for by name while it is opt-in; q and k paired), on the tiny models in bf16, at the eager
    model's level."""
    from dit_zoo import ZOO

    ref_s, config, inputs_ref, shape = ZOO[name]
    spec = resolve_model(ref_s, example_inputs=inputs_ref, model_config=config)
    model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.bfloat16, device="cuda",
                                         text_len=spec.text_len, seed=1)  # fmt: skip
    with torch.no_grad():
        ref = model(**inputs)[0].double()
        omni_compile.compile(model, omni_compile.CompileConfig(kernels={"layer_norm_rope": "triton"}))
        out = model(**inputs)[0].double()
    records = omni_compile.compile_state(model).records
    assert [r.passes["qk_norm_rope"] for r in records] == [rotated] * len(records)
    for r in records:
        res = r.resolutions["layer_norm_rope"]
        assert res["implementation"] == "triton (embedded)" and res.get("paired") == 2, (r.region, res)
    assert float((out - ref).norm() / ref.norm()) < 1e-2
