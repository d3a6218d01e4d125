"""LoRA adapters (`omni_compile.lora_adapters`): merged into the bound weights in place with zero compiles, on a
compiled model and on a loaded artifact; the base weights back bit for bit; scales and switches without drift;
the diffusers/PEFT and kohya layouts; files that do not fit refused with the keys named."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from conftest import rel_l2
from omni_compile.models import resolve_model

import omni_compile
from omni_compile.config import ShapeBucket
from omni_compile.errors import ConfigError

TARGETS = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_out.0", "transformer_blocks.1.ff.net.2",
           "single_transformer_blocks.0.proj_out"]  # fmt: skip


def _flux_tiny():
    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x64"), dtype=torch.float32, device="cpu",
                                         text_len=spec.text_len, seed=1)  # fmt: skip
    return model, inputs


def _write_lora(path, model, targets=TARGETS, rank=4, seed=0, layout="diffusers", alpha=None):
    """A random LoRA for `targets` of `model`; returns {module: delta W} as the file means it (float64)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    tensors, deltas = {}, {}
    for t in targets:
        lin = modules[t]
        a = torch.randn(rank, lin.in_features, generator=g) * 0.2
        b = torch.randn(lin.out_features, rank, generator=g) * 0.2
        if layout == "diffusers":
            tensors[f"transformer.{t}.lora_A.weight"], tensors[f"transformer.{t}.lora_B.weight"] = a, b
        else:  # kohya: down/up, with an alpha
            tensors[f"{t}.lora_down.weight"], tensors[f"{t}.lora_up.weight"] = a, b
            if alpha is not None:
                tensors[f"{t}.alpha"] = torch.tensor(float(alpha))
        deltas[t] = (b.double() @ a.double()) * ((alpha / rank) if alpha is not None else 1.0)
    save_file(tensors, str(path))
    return deltas


def _merged_copy(model, deltas, scale):
    ref = copy.deepcopy(model)
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for t, d in deltas.items():
            w = modules[t].weight
            w.copy_((w.double() + scale * d).to(w.dtype))
    return ref


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.compile
def test_lora_on_a_compiled_model_zero_compiles_and_bit_exact_unload(tmp_path, fresh_dynamo):
    model, inputs = _flux_tiny()
    deltas = _write_lora(tmp_path / "style.safetensors", model)
    eager = copy.deepcopy(model)
    base_digest = _digest(model)
    omni_compile.compile(model)
    with torch.no_grad():
        base = model(**inputs)[0]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    loras = omni_compile.lora_adapters(model)
    with omni_compile.counters.expect(regions_compiled=0, lora_merges=4 * 3), torch.no_grad():
        loras.load("style", tmp_path / "style.safetensors")
        assert loras.describe()["loaded"]["style"]["modules"] == 4 and loras.describe()["active"] is None
        for scale in (1.0, 0.5, 1.0):  # switching scales restores the base first: no drift
            loras.activate("style", scale)
            out = model(**inputs)[0]
            ref = _merged_copy(eager, deltas, scale)(**inputs)[0]
            assert rel_l2(out, ref) < 1e-5, scale
        assert rel_l2(out, base) > 1e-3  # the adapter changes the output
        loras.activate("style", 1.0)  # what is merged already: nothing to do
        loras.activate(None)
        assert _digest(model) == base_digest  # the base weights, bit for bit
        assert torch.equal(model(**inputs)[0], base)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing traced again
    loras.activate("style", 0.25)
    loras.unload("style")  # the applied one: the base comes back first
    assert _digest(model) == base_digest and loras.describe() == {"loaded": {}, "active": None}


@pytest.mark.compile
def test_lora_on_an_fp8_model(tmp_path, fresh_dynamo, monkeypatch):
    """On fp8 Linears the merge dequantizes, adds and quantizes again in place: zero compiles, the output of an
    fp8 model built from the merged weights up to one more e4m3 rounding, the base back bit for bit."""
    from omni_compile.weights import apply_transforms

    monkeypatch.setenv("OMNI_COMPILE_FP8_ANY_DEVICE", "1")  # torch's CPU _scaled_mm (see tests/test_fp8.py)
    model, inputs = _flux_tiny()
    deltas = _write_lora(tmp_path / "style.safetensors", model)
    merged_first = _merged_copy(model, deltas, 1.0)  # the LoRA merged before the fp8 transform: the reference
    apply_transforms(merged_first, ["fp8"], _blocks(merged_first))
    omni_compile.compile(model, precision="fp8")
    with torch.no_grad():
        base = model(**inputs)[0]
        ref = merged_first(**inputs)[0]
    base_digest = _digest(model)  # the e4m3 weights and their scales
    loras = omni_compile.lora_adapters(model)
    with omni_compile.counters.expect(regions_compiled=0, lora_merges=4), torch.no_grad():
        loras.load("style", tmp_path / "style.safetensors")
        loras.activate("style", 1.0)
        out = model(**inputs)[0]
        change = rel_l2(ref, base)  # what the LoRA does to the output
        assert change > 5e-2, change
        assert rel_l2(out, ref) < change / 10, (rel_l2(out, ref), change)  # one more e4m3 rounding of the weights
        loras.activate(None)
        assert _digest(model) == base_digest
        assert torch.equal(model(**inputs)[0], base)


def _blocks(model):
    from omni_compile.graphs import find_regions

    return [m for r in find_regions(model) for _, m in r.instances]


def test_kohya_layout_with_alpha(tmp_path):
    model, inputs = _flux_tiny()
    deltas = _write_lora(tmp_path / "k.safetensors", model, targets=TARGETS[:2], rank=4, layout="kohya", alpha=2)
    eager = copy.deepcopy(model)
    loras = omni_compile.lora_adapters(model)
    adapter = loras.load("k", tmp_path / "k.safetensors")
    assert {m: s for m, (_, _, s) in adapter.deltas.items()} == dict.fromkeys(TARGETS[:2], 0.5)  # alpha / rank
    loras.activate("k", 2.0)
    with torch.no_grad():
        assert rel_l2(model(**inputs)[0], _merged_copy(eager, deltas, 2.0)(**inputs)[0]) < 1e-5


def test_files_that_do_not_fit_are_refused_with_the_keys_named(tmp_path):
    from safetensors.torch import save_file

    model, _ = _flux_tiny()
    digest = _digest(model)
    loras = omni_compile.lora_adapters(model)
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 7),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 4),
               "transformer.transformer_blocks.9.attn.to_k.lora_A.weight": torch.zeros(4, 32),
               "transformer.transformer_blocks.9.attn.to_k.lora_B.weight": torch.zeros(32, 4),
               "transformer.norm_out.lora_A.weight": torch.zeros(4, 32),
               "transformer.norm_out.lora_B.weight": torch.zeros(32, 4),
               "transformer.x_embedder.lora_B.weight": torch.zeros(32, 4)}, str(tmp_path / "bad.safetensors"))  # fmt: skip
    with pytest.raises(ConfigError) as e:
        loras.load("bad", tmp_path / "bad.safetensors")
    msg = str(e.value)
    assert msg.startswith("LoRA 'bad' (bad.safetensors) does not fit FluxTransformer2DModel: ")
    in_features = model.transformer_blocks[0].attn.to_q.in_features
    for part in (("transformer_blocks.0.attn.to_q: lora_A [4, 7] and lora_B [32, 4] do not fit a Linear "
                  f"{in_features} -> {model.transformer_blocks[0].attn.to_q.out_features}"),
                 "transformer_blocks.9.attn.to_k: no such module in FluxTransformer2DModel",
                 "norm_out: a AdaLayerNormContinuous, not a Linear", "x_embedder: has lora_B but not its pair"):  # fmt: skip
        assert part in msg, (part, msg)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=r"LoRA 'j': .*junk.safetensors is not a safetensors file"):
        loras.load("j", tmp_path / "junk.safetensors")
    with pytest.raises(ConfigError, match="no file"):
        loras.load("m", tmp_path / "missing.safetensors")
    with pytest.raises(ConfigError, match="no LoRA named 'nope' is loaded"):
        loras.activate("nope")
    with pytest.raises(ConfigError, match="LoRA name 'a b'"):
        loras.load("a b", tmp_path / "bad.safetensors")
    _write_lora(tmp_path / "ok.safetensors", model)
    loras.load("ok", tmp_path / "ok.safetensors")
    with pytest.raises(ConfigError, match="already loaded"):
        loras.load("ok", tmp_path / "ok.safetensors")
    with pytest.raises(ConfigError, match="scale must be a number from -10 to 10"):
        loras.activate("ok", 100.0)
    assert _digest(model) == digest and loras.describe()["loaded"].keys() == {"ok"}  # nothing applied


@pytest.mark.compile
def test_lora_on_a_loaded_artifact(flux_artifact, fresh_dynamo):
    """The artifact's compiled files take the weights as inputs: the merged weights are what they compute with,
    with zero compiles and nothing loaded again."""
    import tempfile
    from pathlib import Path

    model, inputs = _flux_tiny()
    eager = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "style.safetensors"
        deltas = _write_lora(path, model)
        loaded = omni_compile.load(flux_artifact.path, weights=model)
        with torch.no_grad():
            base = loaded(**inputs)[0]
        loras = omni_compile.lora_adapters(loaded)
        loras.load("style", path)
    with omni_compile.counters.expect(regions_compiled=0, aot_compiles=0), torch.no_grad():
        loras.activate("style", 0.7)
        out = loaded(**inputs)[0]
        assert rel_l2(out, _merged_copy(eager, deltas, 0.7)(**inputs)[0]) < 1e-5
        loras.activate(None)
        assert torch.equal(loaded(**inputs)[0], base)
