"""Step caching (`omni_compile.enable_step_cache`): the settings and their bounds, the schedule, the refusals, and
on a compiled flux-tiny pipeline the skips counted, zero recompiles, and the lossless output when nothing is
skipped."""

import types

import pytest
import torch

import omni_compile
from omni_compile.errors import ConfigError
from omni_compile.runtime.step_cache import StepCacheConfig, enable_step_cache, step_cache


def test_settings_and_their_bounds():
    assert StepCacheConfig.parse("first_block") == StepCacheConfig("first_block", 0.05)
    assert StepCacheConfig.parse("first_block:0.2") == StepCacheConfig("first_block", 0.2)
    assert StepCacheConfig.parse("schedule:0.75") == StepCacheConfig("schedule", fraction=0.75, warmup=2)
    assert StepCacheConfig.parse("schedule:0.5:4") == StepCacheConfig("schedule", fraction=0.5, warmup=4)
    assert StepCacheConfig.parse("first_block:0.2:5").text() == "first_block:0.2:5"
    assert StepCacheConfig.parse("schedule:1").text() == "schedule:1:2"
    assert StepCacheConfig.parse("taylor:0.25:3") == StepCacheConfig("taylor", fraction=0.25, warmup=3)
    assert "forecast to first order" in StepCacheConfig.parse("taylor").describe()
    bad = {
        "first_block:0": "threshold must be a number in (0, 1], not 0.0",
        "first_block:1.5": "threshold must be a number in (0, 1], not 1.5",
        "schedule:-0.5": "fraction must be a number in (0, 1], not -0.5",
        "schedule:0.5:0": "warmup must be an integer from 1 to 1000",
        "schedule:0.5:2.5": "warmup must be an integer",
        "schedule:x": "expected first_block[:THRESHOLD[:WARMUP]], schedule[:FRACTION[:WARMUP]] or taylor",
        "first_block:0.1:2:3": "expected first_block[:THRESHOLD[:WARMUP]]",
        "teacache": "step cache method 'teacache' is unknown; the methods are first_block, schedule, taylor",
    }
    for text, message in bad.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            StepCacheConfig.parse(text)
    with pytest.raises(ConfigError, match="threshold must be a number"):
        StepCacheConfig(threshold=True)


def test_the_schedule_spreads_the_computed_steps():
    def pattern(fraction, warmup, steps=10):
        return "".join("C" if StepCacheConfig("schedule", fraction=fraction, warmup=warmup).computes(i) else "."
                       for i in range(steps))  # fmt: skip

    assert pattern(1.0, 1) == "CCCCCCCCCC"
    assert pattern(0.5, 2) == "CC.C.C.C.C"
    assert pattern(0.75, 2) == "CC.CCC.CCC"
    assert pattern(0.25, 1) == "C...C...C."
    assert pattern(0.5, 4) == "CCCC.C.C.C"


class _Pipe:
    transformer = None


def test_refusals():
    from generic_model import MiniDiT

    with pytest.raises(ConfigError, match="takes a diffusers pipeline with a transformer, or the transformer"):
        enable_step_cache(_Pipe())
    with pytest.raises(ConfigError, match=r"cannot run on MiniDiT: diffusers has no block metadata .* for MiniBlock"):
        enable_step_cache(MiniDiT())
    with pytest.raises(ConfigError, match=r"needs at least two transformer blocks .*; Linear has 0"):
        enable_step_cache(torch.nn.Linear(2, 2))
    model = _tiny_flux()
    model._omni_artifact = types.SimpleNamespace(cuda_graphs=object())  # loaded with whole-step CUDA graphs
    with pytest.raises(ConfigError, match=r"whole-step CUDA graphs.*cuda_graphs=False"):
        enable_step_cache(model)
    del model._omni_artifact
    enable_step_cache(model, "schedule:0.5")
    with pytest.raises(ConfigError, match="already enabled on this model; call disable_step_cache"):
        enable_step_cache(model)
    # compiling after the hooks would drop them: refused, with the order to use
    with pytest.raises(ConfigError, match=r"transformer_blocks.0 has diffusers hooks \(omni_step_cache_head\).*first"):
        omni_compile.compile(model)
    omni_compile.disable_step_cache(model)
    assert step_cache(model) is None and not model.transformer_blocks[0]._diffusers_hook.hooks


def test_unregistered_block_classes_are_named():
    from diffusers import AuraFlowTransformer2DModel

    from dit_zoo import AURAFLOW_TINY

    model = AuraFlowTransformer2DModel(**AURAFLOW_TINY)
    with pytest.raises(ConfigError, match="no block metadata .* for AuraFlowSingleTransformerBlock; its First Block Cache"):
        enable_step_cache(model)


def test_taylor_forecasts_the_residual_linearly():
    """The forecast from the last two computed steps (s0, r0), (s1, r1): r1 + (r1 - r0)(s - s1)/(s1 - s0), per
    stream (a block without a text stream has None there); with one computed step, r1 as it is."""
    from omni_compile.runtime.step_cache import forecast

    r0 = (torch.tensor([1.0, 2.0]), torch.tensor([0.0]))
    r1 = (torch.tensor([2.0, 2.5]), torch.tensor([1.0]))
    got = forecast(((2, r0), (4, r1)), 5)  # half a computed interval on
    assert torch.equal(got[0], torch.tensor([2.5, 2.75])) and torch.equal(got[1], torch.tensor([1.5]))
    assert torch.equal(forecast(((1, (r0[0], None)), (2, (r1[0], None))), 4)[0], torch.tensor([4.0, 3.5]))
    assert forecast(((2, (r0[0], None)), (3, (r1[0], None))), 4)[1] is None
    assert forecast(((3, r1),), 5) is r1


def _tiny_flux(dtype=torch.float32):
    from omni_compile.models import resolve_model

    return resolve_model("flux-tiny").load(dtype=dtype, device="cpu", seed=0)


@pytest.mark.compile
def test_skips_counted_no_recompiles_lossless_when_nothing_is_skipped(fresh_dynamo):
    """On a compiled flux-tiny pipeline: a schedule computing every step (and a threshold nothing passes) gives the
    compiled pipeline's output; skipping gives the counted fraction, a different but near output, the same output
    again for the same seed (the state resets per pipeline call), and no compile of any kind."""
    from omni_compile.models import resolve_model
    from omni_compile.models.flux_pipeline import random_pipeline

    model = _tiny_flux()
    pipe = random_pipeline("flux-tiny", model, dtype=torch.float32, device="cpu", seed=0)
    pipe.set_progress_bar_config(disable=True)
    text_len = resolve_model("flux-tiny").text_len

    def run(steps=8):
        g = torch.Generator().manual_seed(0)
        return pipe(prompt="a red cat", height=64, width=64, num_inference_steps=steps, generator=g,
                    output_type="latent", max_sequence_length=text_len).images  # fmt: skip

    omni_compile.compile(model)
    lossless = run()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    with omni_compile.counters.expect(regions_compiled=0):
        for setting in ("schedule:1", "first_block:1e-12"):
            cache = enable_step_cache(pipe, setting)
            assert rel(run(), lossless) < 1e-6, setting
            assert (cache.stats.steps, cache.stats.computed) == (8, 8), setting
            omni_compile.disable_step_cache(pipe)
        cache = enable_step_cache(pipe, "schedule:0.5")  # warm-up 2, then every other step: 5 of 8
        skipped = run()
        assert (cache.stats.steps, cache.stats.computed) == (8, 5)
        assert 1e-4 < rel(skipped, lossless) < 0.1
        assert torch.equal(run(), skipped) and cache.stats.to_json() == {"steps": 16, "computed": 10,
                                                                          "fraction_computed": 0.625}  # fmt: skip
        cache.set_config(StepCacheConfig("taylor", fraction=0.5))  # same schedule, the skipped steps forecast
        forecast = run()
        assert (cache.stats.steps, cache.stats.computed) == (24, 15)
        assert 1e-4 < rel(forecast, lossless) < 0.1 and rel(forecast, skipped) > 1e-4  # it adds something else
        assert torch.equal(run(), forecast)  # the history resets with the pipeline call too
        cache.set_config(StepCacheConfig("taylor", fraction=1.0))
        assert rel(run(), lossless) < 1e-6  # nothing skipped: nothing forecast
        cache.set_config(StepCacheConfig("schedule", fraction=1.0))  # the server's per-request switch
        assert rel(run(), lossless) < 1e-6 and cache.stats.computed == 36
        omni_compile.disable_step_cache(pipe)
        assert rel(run(), lossless) < 1e-6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing traced again
    enable_step_cache(pipe, "schedule:0.5")
    omni_compile.uncompile(model)  # the hooks wrap the compiled forwards: uncompile takes them off first
    assert step_cache(pipe) is None and not model.transformer_blocks[0]._diffusers_hook.hooks
