"""Compile the tiny presets and a generic diffusers model on the CPU: parity with eager, exact
compile counts, exact pass-match counts per region."""

import pytest
import torch

import omni_compile
from omni_compile.config import CompileConfig, ShapeBucket
from omni_compile.counters import counters
from omni_compile.models import resolve_model

from conftest import rel_l2
from dit_zoo import ZOO
from generic_model import LTX_TINY

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo", "no_inductor_cache")]

# Matches per region and bucket, read off the real graphs (see docs/passes.md).
FLUX_MATCHES = {
    # q, k, added q, added k norms; joint q and k rope; norm1, norm1_context, norm2, norm2_context;
    # the four gated residuals (attention and MLP, image and text streams).
    "FluxTransformerBlock": {"rms_norm": 4, "qk_norm_rope": 2, "adaln": 4, "gated_residual": 4},
    "FluxSingleTransformerBlock": {"rms_norm": 2, "qk_norm_rope": 2, "adaln": 1, "gated_residual": 1},
}
# Self- and cross-attention q, k norms; self-attention q, k rope; norm1 and norm3; attention and FFN gates.
WAN_MATCHES = {"WanTransformerBlock": {"rms_norm": 4, "qk_norm_rope": 2, "adaln": 2, "gated_residual": 2}}
FUSION_PASSES = ("rms_norm", "qk_norm_rope", "adaln", "gated_residual")


def _inputs(spec, model, shape, seed=1):
    return spec.adapter.example_inputs(
        model, ShapeBucket.parse(shape), dtype=torch.float32, device="cpu", text_len=spec.text_len, seed=seed
    )


def _check_buckets(preset, shapes, expected_matches, config=None):
    spec = resolve_model(preset)
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    first = [_inputs(spec, model, s, seed=1) for s in shapes]
    fresh = [_inputs(spec, model, s, seed=7) for s in shapes]  # new random inputs, same buckets
    with torch.no_grad():
        refs = [model(**inp)[0] for inp in first]
        fresh_refs = [model(**inp)[0] for inp in fresh]
    omni_compile.compile(model, config or CompileConfig(passes=["all"]))
    state = omni_compile.compile_state(model)
    assert {r.name: len(r.instances) for r in state.regions} == {k: 2 for k in expected_matches}
    for i in range(len(shapes)):
        before = len(state.records)
        # Exactly one compile per distinct block class, however many instances it has.
        with counters.expect(regions_compiled=len(expected_matches)), torch.no_grad():
            out = model(**first[i])[0]
        assert rel_l2(out, refs[i]) < 1e-5
        got = {r.region: {p: r.passes.get(p, 0) for p in FUSION_PASSES} for r in state.records[before:]}
        assert got == expected_matches
        with counters.expect(regions_compiled=0), torch.no_grad():
            out = model(**fresh[i])[0]
        assert rel_l2(out, fresh_refs[i]) < 1e-5
    return state


def test_flux_tiny_two_buckets():
    _check_buckets("flux-tiny", ["64x64", "128x64"], FLUX_MATCHES)


def test_wan_tiny_two_buckets():
    _check_buckets("wan-tiny", ["64x64x5", "64x96x9"], WAN_MATCHES)


@pytest.mark.parametrize("disabled", FUSION_PASSES)
def test_flux_tiny_each_pass_can_be_disabled(disabled):
    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inp = _inputs(spec, model, "64x64")
    with torch.no_grad():
        ref = model(**inp)[0]
    omni_compile.compile(model, CompileConfig(passes=["all", f"-{disabled}"]))
    with counters.expect(regions_compiled=2, pass_matches={disabled: 0}), torch.no_grad():
        out = model(**inp)[0]
    assert rel_l2(out, ref) < 1e-5
    records = omni_compile.compile_state(model).records
    assert all(disabled not in r.passes for r in records)
    for r in records:
        # The other passes match as before; qk_norm_rope finds its norms itself when rms_norm is off.
        expected = {p: n for p, n in FLUX_MATCHES[r.region].items() if p != disabled}
        assert {p: r.passes[p] for p in expected} == expected
        if disabled == "rms_norm":
            # No rms_norm op is left for the lowering: only the fused ones (rope, adaln, gated) lower.
            fused = sum(expected[p] for p in ("qk_norm_rope", "adaln", "gated_residual"))
            assert r.passes["lower_fused_ops"] == fused


def test_generic_adapter_ltx_video():
    spec = resolve_model(
        "diffusers:LTXVideoTransformer3DModel", example_inputs="generic_model:ltx_inputs", model_config=LTX_TINY
    )
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inp = spec.adapter.example_inputs(
        model, ShapeBucket.parse("64x96x9"), dtype=torch.float32, device="cpu", text_len=8, seed=1
    )
    with torch.no_grad():
        ref = model(**inp)[0]
    omni_compile.compile(model)
    with counters.expect(regions_compiled=1), torch.no_grad():
        out = model(**inp)[0]
    assert rel_l2(out, ref) < 1e-5
    (rec,) = omni_compile.compile_state(model).records
    # attn1 and attn2 q/k norms (torch.nn.RMSNorm) and norm1, norm2 (diffusers RMSNorm, no weight).
    assert rec.region == "LTXVideoTransformerBlock" and rec.passes["rms_norm"] == 6


def test_compile_twice_is_refused_and_uncompile_restores_eager():
    spec = resolve_model("wan-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    omni_compile.compile(model)
    with pytest.raises(omni_compile.ConfigError, match="already compiled"):
        omni_compile.compile(model)
    omni_compile.uncompile(model)
    with counters.expect(regions_compiled=0), torch.no_grad():
        model(**_inputs(spec, model, "64x64x5"))


def test_stride_canonicalisation_saves_a_compile():
    """FLUX's first single-stream block gets a fresh tensor, the others a slice: without giving
    size-1 dims canonical strides, Dynamo compiles that block twice at batch 1."""
    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inp = _inputs(spec, model, "64x64")
    with torch.no_grad():
        ref = model(**inp)[0]
    omni_compile.compile(model, CompileConfig(canonicalize_strides=False))
    with counters.expect(regions_compiled=3), torch.no_grad():
        out = model(**inp)[0]
    assert rel_l2(out, ref) < 1e-5
    regions = [r.region for r in omni_compile.compile_state(model).records]
    assert sorted(regions) == ["FluxSingleTransformerBlock", "FluxSingleTransformerBlock", "FluxTransformerBlock"]


def test_canonical_layout_of_block_inputs():
    """Size-1 dims get contiguous strides (a view); a permuted input is copied to the contiguous layout (one
    copy instead of a second graph); an expanded one (stride 0) and a contiguous one are passed as they are."""
    from omni_compile.graphs.layout import canonical_layout

    base = torch.randn(1, 32, 16)
    permuted = base.transpose(1, 2)  # [1, 16, 32], strides (512, 1, 16): a patch embedding's flatten + transpose
    out = canonical_layout(permuted)
    assert out.is_contiguous() and out.stride() == (512, 32, 1) and torch.equal(out, permuted)
    sliced = torch.randn(1, 40, 16)[:, 8:]  # batch stride 640: a slice of a longer sequence, a free view
    out = canonical_layout(sliced)
    assert out.stride() == (512, 16, 1) and out.data_ptr() == sliced.data_ptr()
    expanded = torch.randn(1, 1, 16).expand(2, 8, 16)
    assert canonical_layout(expanded) is expanded
    contiguous = torch.randn(2, 8, 16)
    assert canonical_layout(contiguous) is contiguous
    pair = canonical_layout((permuted, contiguous))
    assert isinstance(pair, tuple) and pair[0].is_contiguous() and pair[1] is contiguous


@pytest.mark.compile
def test_a_permuted_first_block_input_costs_no_second_compile(fresh_dynamo, no_inductor_cache):
    """PixArt feeds its first block the patch embedding's transposed output and the next ones contiguous
    block outputs: one compile for its one region."""
    cls, config, inputs_ref, shape = ZOO["pixart"]
    spec = resolve_model(cls, example_inputs=inputs_ref, model_config=config)
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inp = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.float32, device="cpu", seed=1)
    with torch.no_grad():
        ref = model(**inp)[0]
    omni_compile.compile(model, regions=spec.block_names(model), adapter=spec.adapter)
    with counters.expect(regions_compiled=1), torch.no_grad():
        out = model(**inp)[0]
    assert rel_l2(out, ref) < 1e-5
