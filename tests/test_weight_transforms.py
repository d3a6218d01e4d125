"""Load-time weight transforms (`omni_compile.weights`): `fuse_projections` on tiny FLUX and Wan.

Parity against the untransformed model (fp32, random weights), the transform runs once per bind (a
counter: compiling runs it, steps do not), one copy of the weights in memory, and an artifact built
with it loads into weights given unfused.
"""

from __future__ import annotations

import pytest
import torch

import omni_compile
from omni_compile.config import ShapeBucket
from omni_compile.counters import counters
from omni_compile.errors import ConfigError
from omni_compile.models import resolve_model
from omni_compile.weights import FUSED_FROM, apply_transforms, fuse_projections

from conftest import rel_l2
from test_cli import assert_user_error, cli

CASES = {"flux-tiny": "64x64", "wan-tiny": "64x64x5"}
# attention modules `fuse_projections` fuses per tiny model (one count per module, whatever it fuses in it)
FUSED = {"flux-tiny": 4, "wan-tiny": 4}


def _model_and_inputs(preset):
    spec = resolve_model(preset)
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(CASES[preset]), dtype=torch.float32, device="cpu",
                                         text_len=spec.text_len, seed=1)  # fmt: skip
    return model, inputs


def _storage_bytes(model) -> int:
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


@pytest.mark.parametrize("preset", list(CASES))
def test_fused_eager_model_matches_and_keeps_one_copy(preset):
    model, inputs = _model_and_inputs(preset)
    with torch.no_grad():
        ref = model(**inputs)[0]
    bytes_before = _storage_bytes(model)
    with counters.expect(weight_transforms=FUSED[preset]):
        assert apply_transforms(model, ["fuse_projections"]) == {"fuse_projections": FUSED[preset]}
    fused = [m for m in model.modules() if getattr(m, "fused_projections", False)]
    assert len(fused) == FUSED[preset]
    shared = 0
    for m in fused:
        for name, parts in FUSED_FROM.items():
            if hasattr(m, name):  # each separate Linear's weight and bias are views into the fused ones
                for part in parts:
                    for attr in ("weight", "bias"):
                        got, whole = getattr(getattr(m, part), attr), getattr(getattr(m, name), attr)
                        assert got.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(), (name, part)
                        shared += 1
    assert shared > 0
    assert _storage_bytes(model) == bytes_before  # no second copy of the fused weights
    with torch.no_grad():
        out = model(**inputs)[0]
    assert rel_l2(out, ref) < 1e-6
    with counters.expect(weight_transforms=0):  # done once: a second call finds it done
        assert fuse_projections(model) == 0


@pytest.mark.compile
@pytest.mark.parametrize("preset", list(CASES))
def test_compile_runs_the_transform_once_and_matches_the_untransformed_model(preset, fresh_dynamo):
    model, inputs = _model_and_inputs(preset)
    with torch.no_grad():
        ref = model(**inputs)[0]
    with counters.expect(weight_transforms=FUSED[preset]):
        omni_compile.compile(model, omni_compile.CompileConfig(weight_transforms=["fuse_projections"]))
    with counters.expect(weight_transforms=0), torch.no_grad():
        outs = [model(**inputs)[0] for _ in range(3)]
    for out in outs:
        assert rel_l2(out, ref) < 1e-5
    records = omni_compile.compile_state(model).records
    # the fusion passes still find QK-norm + RoPE behind the fused projection's split
    assert sum(r.passes.get("qk_norm_rope", 0) for r in records) > 0


def test_unknown_transform_is_refused():
    model, _ = _model_and_inputs("flux-tiny")
    with pytest.raises(ConfigError, match=r"unknown weight transform\(s\) \['fuse_qkv'\]; known: fuse_projections"):
        apply_transforms(model, ["fuse_qkv"])
    with pytest.raises(ConfigError, match="unknown weight transform"):
        omni_compile.compile(model, omni_compile.CompileConfig(weight_transforms=["fuse_qkv"]))
    assert not any(getattr(m, "fused_projections", False) for m in model.modules())  # nothing was changed


def test_cli_flag_is_checked_before_anything_runs(tmp_path, subprocess_env):
    proc = cli("build", "flux-tiny", "--weight-transforms", "fuse_qkv", "--out", str(tmp_path / "a"), env=subprocess_env)
    assert_user_error(proc, "unknown weight transform(s) ['fuse_qkv']; known: fuse_projections")
    assert not (tmp_path / "a").exists()


@pytest.mark.compile
def test_artifact_records_the_transform_and_loads_unfused_weights(tmp_path, subprocess_env, fresh_dynamo):
    """Built with fuse_projections, loaded into a model given unfused: the load runs the transform, then
    checks the weights it binds; parity against the unfused model's eager output, nothing compiled."""
    import json

    from omni_compile.artifact.loader import verify

    art = tmp_path / "wan"
    proc = cli("build", "wan-tiny", "--shapes", CASES["wan-tiny"], "--weight-transforms", "fuse_projections",
               "--out", str(art), "-q", env=subprocess_env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["weights"]["transforms"] == {"fuse_projections": FUSED["wan-tiny"]}
    assert manifest["build"]["compile_config"]["weight_transforms"] == ["fuse_projections"]
    assert "blocks.0.attn1.to_qkv.weight" in manifest["weights"]["tensors"]

    model, inputs = _model_and_inputs("wan-tiny")
    with torch.no_grad():
        ref = model(**inputs)[0]
    with counters.expect(weight_transforms=FUSED["wan-tiny"]):
        loaded = omni_compile.load(art, weights=model)
    with counters.expect(weight_transforms=0, regions_compiled=0), torch.no_grad():
        out = loaded(**inputs)[0]
    assert rel_l2(out, ref) < 1e-4
    result = verify(art)  # fresh seeded weights, unfused, against their own eager output
    assert result["ok"] and result["compilations"] == 0, result
