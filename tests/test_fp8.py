"""fp8 GEMMs (the lossy weight transform `fp8`): the Linear against float64 arithmetic of its quantized operands,
which Linears the transform takes, the compiled model against the eager fp8 one, and the refusals.

On this CPU torch `_scaled_mm` runs (slowly): the transform's device check is lifted for these tests only with
OMNI_COMPILE_FP8_ANY_DEVICE=1; without it a CPU model is refused, as a user's would be."""

from __future__ import annotations

import pytest
import torch

import omni_compile
from omni_compile.config import ShapeBucket
from omni_compile.counters import counters
from omni_compile.errors import ConfigError
from omni_compile.models import resolve_model
from omni_compile.ops.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_rows
from omni_compile.weights import apply_transforms, quantize_fp8

from conftest import rel_l2
from test_cli import assert_user_error, cli


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setenv("OMNI_COMPILE_FP8_ANY_DEVICE", "1")


def test_quantized_rows_and_the_linear_against_float64():
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = (torch.randn(3, 5, 64, generator=g) * torch.logspace(-2, 2, 64)).to(torch.bfloat16)  # rows of mixed scale
    x[0, 0] = 0  # a zero row: zeros out, not NaN
    q, s = quantize_rows(x.reshape(-1, 64))
    assert q.dtype == FP8 and s.shape == (15, 1) and q.float().abs().amax(-1).max() <= FP8_MAX
    assert torch.equal(q.float().abs().amax(-1)[1:], torch.full((14,), FP8_MAX))  # each row's max maps to 448
    fp8 = Fp8Linear.from_linear(linear)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (48,) and fp8.weight_scale.dtype == torch.float32
    y = fp8(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.bfloat16 and torch.equal(y[0, 0], fp8.bias.to(y.dtype))
    # what the GEMM computes: the dequantized operands' product, in float64, plus the bias
    wd = fp8.weight.double() * fp8.weight_scale.double()[:, None]
    ref = (q.double() * s.double()) @ wd.T + linear.bias.double()
    assert rel_l2(y.reshape(-1, 48).double(), ref) < 8e-3  # bf16 output rounding
    # and against the bf16 Linear it replaces: the fp8 cost
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    assert 1e-3 < rel_l2(y.double(), exact) < 6e-2


def _blocks(model):
    from omni_compile.graphs import find_regions

    return [m for r in find_regions(model) for _, m in r.instances]


def _flux_tiny(dtype=torch.float32):
    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=dtype, device="cpu", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x64"), dtype=dtype, device="cpu",
                                         text_len=spec.text_len, seed=1)  # fmt: skip
    return model, inputs


def test_the_transform_takes_the_blocks_linears_but_modulation(any_device):
    model, _ = _flux_tiny()
    assert quantize_fp8(model, _blocks(model)) == 34  # 2 double blocks x 12 Linears + 2 single blocks x 5
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert "transformer_blocks.0.attn.to_q" in fp8 and "single_transformer_blocks.1.proj_out" in fp8
    assert "transformer_blocks.0.ff_context.net.2" in fp8
    for kept in ("transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
                 "single_transformer_blocks.0.norm.linear", "x_embedder", "context_embedder", "proj_out"):  # fmt: skip
        assert type(model.get_submodule(kept)) is torch.nn.Linear, kept
    assert quantize_fp8(model, _blocks(model)) == 0  # already done: nothing twice
    with pytest.raises(ConfigError, match="fp8 needs the model's blocks"):
        apply_transforms(model, ["fp8"])


def test_fp8_keep_leaves_the_named_linears(any_device):
    """`fp8_keep` patterns (module paths, fnmatch) keep those Linears in the model's dtype; a pattern that matches
    nothing fp8 takes is an error naming real paths; fp8_keep without fp8 is an error."""
    model, _ = _flux_tiny()
    keep = ["transformer_blocks.*.ff.net.2", "single_transformer_blocks.1.*"]
    assert quantize_fp8(model, _blocks(model), keep) == 34 - 2 - 5
    assert type(model.get_submodule("transformer_blocks.0.ff.net.2")) is torch.nn.Linear
    assert type(model.get_submodule("single_transformer_blocks.1.proj_out")) is torch.nn.Linear
    assert isinstance(model.get_submodule("single_transformer_blocks.0.proj_out"), Fp8Linear)
    assert quantize_fp8(model, _blocks(model), keep) == 0  # once
    fresh, _ = _flux_tiny()
    with pytest.raises(ConfigError, match=r"fp8_keep pattern\(s\) \['blocks\.\*\.ff'\] match none of the 34 Linears "
                                          r"fp8 takes \(module paths such as transformer_blocks\.0\."):
        quantize_fp8(fresh, _blocks(fresh), ["blocks.*.ff"])
    assert not any(isinstance(m, Fp8Linear) for m in fresh.modules())
    with pytest.raises(ConfigError, match="fp8_keep names Linears to keep out of fp8, but the weight transform fp8 is"):
        omni_compile.compile(fresh, {"fp8_keep": ["*.ff.net.2"]})
    with counters.expect(weight_transforms=32):
        omni_compile.compile(fresh, {"weight_transforms": ["fp8"], "fp8_keep": ["*.ff.net.2"]})
    assert type(fresh.get_submodule("transformer_blocks.1.ff.net.2")) is torch.nn.Linear


def _lossless_and_eager_fp8(model, inputs):
    """(the model's output, the output of an eager copy with the fp8 transform) on `inputs`."""
    import copy

    eager8 = copy.deepcopy(model)
    apply_transforms(eager8, ["fp8"], _blocks(eager8))
    with torch.no_grad():
        return model(**inputs)[0], eager8(**inputs)[0]


@pytest.mark.compile
def test_compiled_fp8_matches_eager_fp8_and_reports_its_cost(any_device, fresh_dynamo, no_inductor_cache):
    model, inputs = _flux_tiny()
    lossless, expected = _lossless_and_eager_fp8(model, inputs)
    # fp8_act: the double block's two FFN GELUs (ff, ff_context) fold into their quantizations (the single block's
    # GELU feeds a concatenation); each normed input is quantized once for all its projections: q/k/v and their
    # context twins (2 + 2 merges), the single block's q/k/v/proj_mlp (3); and every norm whose only reader is
    # that quantization writes e4m3 rows itself (norm1, norm1_context, the two FFN norms, the single block's: 5)
    with counters.expect(weight_transforms=34, regions_compiled=2, pass_matches={"fp8_act": 2 + 7 + 5}):
        omni_compile.compile(model, precision="fp8")
        with torch.no_grad():
            out = model(**inputs)[0]
    assert rel_l2(out, expected) < 1e-5  # the compiled regions compute what the eager fp8 model does
    cost = rel_l2(out, lossless)
    assert 1e-4 < cost < 2e-2, cost  # lossy, within the bound docs/fast-mode.md states for random weights


def test_refusals(tmp_path, subprocess_env, monkeypatch):
    monkeypatch.delenv("OMNI_COMPILE_FP8_ANY_DEVICE", raising=False)
    model, _ = _flux_tiny()
    with pytest.raises(ConfigError, match="fp8 needs a CUDA GPU of compute capability 8.9 or more .* on cpu"):
        omni_compile.compile(model, omni_compile.CompileConfig(weight_transforms=["fp8"]))
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    with pytest.raises(ConfigError, match="unknown precision 'int4'; choose lossless or fp8"):
        omni_compile.compile(model, precision="int4")
    with pytest.raises(ConfigError, match="fp8 needs a CUDA GPU of compute capability 8.9 or more .* on cpu"):
        omni_compile.compile(model, precision="fp8")
    with pytest.raises(ConfigError, match="fp8 and fuse_projections do not go together yet"):
        apply_transforms(model, ["fuse_projections", "fp8"])
    proc = cli("build", "flux-tiny", "--weight-transforms", "fp8", "--out", str(tmp_path / "a"), env=subprocess_env)
    assert_user_error(proc, "weight transform fp8 needs a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, "
                            "Blackwell); the model is on cpu. Leave fp8 off here")  # fmt: skip
    assert not (tmp_path / "a").exists()


@pytest.mark.compile
def test_fp8_artifact_builds_loads_and_reports_its_cost(tmp_path, subprocess_env, fresh_dynamo, any_device):
    """An fp8 artifact (two Linears kept by --fp8-keep): the build checks the compiled regions against the eager fp8
    model (lossless bound) and prints and reports the cost against the model as given; loading quantizes the given
    weights as the build did (the weights check passes on the quantized ones), compiles nothing, and computes what
    the eager fp8 model does; verify and inspect report the cost too."""
    import copy
    import json

    from omni_compile.artifact.loader import verify

    art = tmp_path / "fp8"
    env = dict(subprocess_env, OMNI_COMPILE_FP8_ANY_DEVICE="1")
    proc = cli("build", "flux-tiny", "--shapes", "64x64", "--precision", "fp8", "--fp8-keep", "*.ff.net.2",
               "--out", str(art), env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp8 (lossy): rel L2 against the model as given 64x64 " in proc.stdout + proc.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["build"]["compile_config"]["weight_transforms"] == ["fp8"]
    assert manifest["build"]["compile_config"]["fp8_keep"] == ["*.ff.net.2"]
    assert manifest["weights"]["transforms"] == {"fp8": 32}  # the two double blocks' ff.net.2 kept
    build_report = json.loads((art / "report" / "build_report.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    from omni_compile.build.report import SCHEMA_FILE

    jsonschema.validate(build_report, json.loads(SCHEMA_FILE.read_text()), cls=jsonschema.Draft202012Validator)
    (bucket,) = build_report["parity"]["buckets"].values()
    assert bucket["rel_l2_vs_eager"] < 1e-4, bucket  # compiled = eager fp8
    assert 1e-4 < bucket["rel_l2_vs_lossless"] < 2e-2, bucket  # the documented fp8 cost

    model, inputs = _flux_tiny()
    eager8 = copy.deepcopy(model)
    apply_transforms(eager8, ["fp8"], _blocks(eager8), ["*.ff.net.2"])
    with torch.no_grad():
        expected = eager8(**inputs)[0]
    with counters.expect(weight_transforms=32):  # the load keeps what the build kept (the weights check agrees)
        loaded = omni_compile.load(art, weights=model)
    with counters.expect(weight_transforms=0, regions_compiled=0), torch.no_grad():
        out = loaded(**inputs)[0]
    assert rel_l2(out, expected) < 1e-4
    result = verify(art)
    assert result["ok"] and result["compilations"] == 0, result
    assert result["lossy"]["transforms"] == ["fp8"] and 1e-4 < result["lossy"]["rel_l2_vs_lossless"]["64x64"] < 2e-2
    from omni_compile.inspect import InspectOptions, inspect

    report = inspect(InspectOptions(target=str(art)), tmp_path / "inspect")  # the build's figure, as it reported it
    assert report["quality"] == {"lossy": ["weight transform fp8"],
                                 "buckets": {"64x64": {"rel_l2_vs_lossless": bucket["rel_l2_vs_lossless"]}}}


@pytest.mark.compile
def test_inspect_reports_the_cost_of_fp8(tmp_path, any_device, fresh_dynamo):
    """`inspect flux-tiny --precision fp8`: the compiled fp8 model's output against the model as given, per bucket,
    in the report (schema-valid) and in the summary line."""
    import io
    import json
    from pathlib import Path

    from rich.console import Console

    from omni_compile.config import CompileConfig
    from omni_compile.inspect import InspectOptions, inspect
    from omni_compile.inspect.report import print_summary

    opts = InspectOptions(target="flux-tiny", shapes="64x64", compile=CompileConfig(weight_transforms=["fp8"]),
                          dynamo=False)  # fmt: skip
    report = inspect(opts, tmp_path)
    quality = report["quality"]
    assert quality["lossy"] == ["weight transform fp8"] and list(quality["buckets"]) == ["64x64"]
    assert 1e-4 < quality["buckets"]["64x64"]["rel_l2_vs_lossless"] < 2e-2, quality
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(omni_compile.__file__).parent / "inspect" / "schema.json").read_text())
    jsonschema.validate(json.loads(json.dumps(report)), schema, cls=jsonschema.Draft202012Validator)
    out = io.StringIO()
    print_summary(Console(file=out, width=200), report)
    assert "quality: weight transform fp8 (lossy): rel L2 against the model as given 64x64 " in out.getvalue()
    from omni_compile.inspect.collect import lossy_options

    lossy_attention = CompileConfig(attention={"default": {"backend": "CUDNN_ATTN"},
                                               "per_role": {"flux.joint": {"backend": "SAGE_ATTN"}}})  # fmt: skip
    assert lossy_options(lossy_attention) == ["attention SAGE_ATTN"] and lossy_options(CompileConfig()) == []


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="fp8 GEMMs need a CUDA GPU of compute capability 8.9 or more")
def test_fp8_linear_on_cuda_against_float64():
    """The real `_scaled_mm` (rowwise scales, bf16 out) at a W1 projection's shape: the product of the dequantized
    operands within bf16 rounding, and the fp8 cost against the bf16 Linear within the documented bound."""
    g = torch.Generator(device="cuda").manual_seed(0)
    linear = torch.nn.Linear(3072, 3072, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 4096, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    fp8 = Fp8Linear.from_linear(linear)
    y = fp8(x)
    q, s = quantize_rows(x.reshape(-1, 3072))
    wd = fp8.weight.double() * fp8.weight_scale.double()[:, None]
    ref = (q.double() * s.double()) @ wd.T + linear.bias.double()
    assert rel_l2(y.reshape(-1, 3072).double(), ref) < 8e-3
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    assert 1e-3 < rel_l2(y.double(), exact) < 6e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="fp8 GEMMs need a CUDA GPU of compute capability 8.9 or more")
def test_compiled_fp8_on_cuda(fresh_dynamo, no_inductor_cache):
    """flux-tiny in bf16 on the GPU with the fp8 transform, no test switch: compiled equals eager fp8 up to bf16
    rounding, and the lossy cost is within the documented bound."""
    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x64"), dtype=torch.bfloat16, device="cuda",
                                         text_len=spec.text_len, seed=1)  # fmt: skip
    lossless, expected = _lossless_and_eager_fp8(model, inputs)
    with counters.expect(weight_transforms=34, regions_compiled=2, pass_matches={"fp8_act": 2 + 7 + 5}):
        omni_compile.compile(model, omni_compile.CompileConfig(weight_transforms=["fp8"]))
        with torch.no_grad():
            out = model(**inputs)[0]
    assert rel_l2(out, expected) < 2e-2  # bf16: Inductor's fused quantization rounds a little differently
    assert 1e-3 < rel_l2(out, lossless) < 6e-2
