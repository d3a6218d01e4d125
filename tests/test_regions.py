"""Region discovery and model resolution (no compilation)."""

import json

import pytest
import torch

from omni_compile.errors import ConfigError, OmniCompileError
from omni_compile.graphs import find_regions
from omni_compile.models import resolve_model


@pytest.fixture(scope="module")
def flux_tiny():
    spec = resolve_model("flux-tiny")
    return spec, spec.load(dtype=torch.float32, device="cpu", seed=0)


def test_flux_regions(flux_tiny):
    _, model = flux_tiny
    regions = find_regions(model)
    assert [(r.name, r.paths) for r in regions] == [
        ("FluxTransformerBlock", ["transformer_blocks.0", "transformer_blocks.1"]),
        ("FluxSingleTransformerBlock", ["single_transformer_blocks.0", "single_transformer_blocks.1"]),
    ]
    assert regions[0].structure_hash != regions[1].structure_hash
    # Deterministic: a second model of the same config hashes the same.
    again = resolve_model("flux-tiny").load(dtype=torch.float32, device="cpu", seed=1)
    assert [r.structure_hash for r in find_regions(again)] == [r.structure_hash for r in regions]


def test_instances_that_differ_in_structure_become_separate_regions():
    spec = resolve_model("wan-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    model.blocks[1].attn1.norm_q.eps = 1e-3  # a block built with another config
    regions = find_regions(model)
    assert [(r.name, r.paths) for r in regions] == [
        ("WanTransformerBlock#1", ["blocks.0"]),
        ("WanTransformerBlock#2", ["blocks.1"]),
    ]


class _Indexed(torch.nn.Module):
    """A block that keeps its index in the model (for logs, never read) and a scale its forward reads."""

    def __init__(self, index: int, scale: float = 1.0):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.position_in_model = index
        self.scale = scale

    def forward(self, x):
        return self.proj(x) * self.scale


class _IndexedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Indexed(i) for i in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_an_attribute_no_code_reads_does_not_split_a_region():
    """Z-Image's blocks keep their index (`layer_id`), which no code reads: one region, not one per block. An
    attribute the forward reads still splits them."""
    model = _IndexedModel()
    assert [(r.name, r.paths) for r in find_regions(model)] == [("_Indexed", ["blocks.0", "blocks.1", "blocks.2"])]
    model.blocks[2].scale = 2.0
    assert [(r.name, r.paths) for r in find_regions(model)] == [
        ("_Indexed#1", ["blocks.0", "blocks.1"]),
        ("_Indexed#2", ["blocks.2"]),
    ]


def test_region_errors():
    with pytest.raises(OmniCompileError, match="found no repeated blocks in Linear"):
        find_regions(torch.nn.Linear(2, 2))
    model = resolve_model("wan-tiny").load(dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(OmniCompileError, match=r"none of the block classes \['NoSuchBlock'\]"):
        find_regions(model, ["NoSuchBlock"])


def test_presets_are_reproducible(flux_tiny):
    spec, model = flux_tiny
    again = spec.load(dtype=torch.float32, device="cpu", seed=0)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_local_diffusers_directory(tmp_path, flux_tiny):
    _, model = flux_tiny
    model.save_pretrained(tmp_path / "transformer")  # the layout of a snapshot's transformer/ folder
    for path in (tmp_path / "transformer", tmp_path):  # a pipeline directory resolves to its transformer/
        spec = resolve_model(str(path))
        assert spec.adapter.family == "flux" and spec.weights.endswith(".safetensors")
        loaded = spec.load(dtype=torch.float32, device="cpu")
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_local_directory_errors(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ConfigError, match="holds no \\*.safetensors weights"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(ConfigError, match="has no _class_name"):
        resolve_model(str(tmp_path))


def test_model_argument_errors():
    with pytest.raises(ConfigError, match="unknown model 'flux-huge'"):
        resolve_model("flux-huge")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        resolve_model("no_such_module:Model")
    with pytest.raises(ConfigError, match="'builtins:int' is not a torch nn.Module class"):
        resolve_model("builtins:int")


def test_generic_adapter_needs_example_inputs():
    from omni_compile.config import ShapeBucket

    spec = resolve_model("diffusers:LTXVideoTransformer3DModel")
    assert spec.adapter.family == "generic"
    with pytest.raises(ConfigError, match="--example-inputs module:function"):
        spec.adapter.example_inputs(None, ShapeBucket(64, 64), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(
    "preset,shape,message",
    [
        ("flux-tiny", "64x64x5", "FLUX takes images"),
        ("flux-tiny", "72x64", "divisible by 16"),
        ("wan-tiny", "64x64", "needs frames"),
        ("wan-tiny", "64x64x6", "frames = 4k\\+1"),
    ],
)
def test_bucket_checks(preset, shape, message):
    from omni_compile.config import ShapeBucket

    with pytest.raises(ConfigError, match=message):
        resolve_model(preset).adapter.check_bucket(ShapeBucket.parse(shape))


# ------------------------------------------------------------------ models that declare no _repeated_blocks


class _Block(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.inner = torch.nn.ModuleList([torch.nn.Linear(dim, dim) for _ in range(2)])  # nested: part of the block

    def forward(self, x):
        return self.proj(x) + sum(m(x) for m in self.inner)


class _Other(_Block):
    pass


class _Undeclared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(3)])
        self.stage = torch.nn.Module()
        self.stage.tail = torch.nn.ModuleList([_Other(), _Other()])  # at any depth
        self.mixed = torch.nn.ModuleList([_Block(), _Other()])  # not one class: glue
        self.single = torch.nn.ModuleList([_Block()])  # not repeated: glue

    def forward(self, x):
        for m in [*self.blocks, *self.stage.tail, *self.mixed, *self.single]:
            x = m(x)
        return self.embed(x)


def test_lists_of_identical_blocks_are_the_regions_of_an_undeclared_model():
    from omni_compile.graphs.regions import discover_block_classes

    model = _Undeclared()
    assert discover_block_classes(model) == ["_Block", "_Other"]
    regions = find_regions(model)
    assert [(r.name, r.paths) for r in regions] == [
        ("_Block", ["blocks.0", "blocks.1", "blocks.2", "mixed.0", "single.0"]),
        ("_Other", ["stage.tail.0", "stage.tail.1", "mixed.1"]),
    ]
    # a declared list wins
    assert [r.name for r in find_regions(model, ["_Other"])] == ["_Other"]


def test_a_model_without_repeated_blocks_says_how_to_declare_them():
    from omni_compile.errors import OmniCompileError

    with pytest.raises(OmniCompileError) as e:
        find_regions(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert str(e.value) == (
        "found no repeated blocks in Sequential: it declares no `_repeated_blocks` and holds no nn.ModuleList of two "
        "or more modules of one class. Name its block classes: --regions Class1,Class2 (build, inspect), "
        "omni_compile.compile(model, regions=[...]), or `_repeated_blocks` on the class"
    )
    with pytest.raises(OmniCompileError, match=r"none of the block classes \['Nope'\] occurs in _Undeclared; check the "
                       r"class names \(its lists of identical blocks hold \['_Block', '_Other'\]\)"):
        find_regions(_Undeclared(), ["Nope"])


def test_sd3_declares_no_repeated_blocks_and_is_found_by_its_block_list():
    from diffusers import SD3Transformer2DModel

    from omni_compile.graphs.regions import discover_block_classes

    assert not getattr(SD3Transformer2DModel, "_repeated_blocks", None)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4)  # fmt: skip
    assert discover_block_classes(model) == ["JointTransformerBlock"]
    spec = resolve_model("diffusers:SD3Transformer2DModel", regions=["JointTransformerBlock"])
    assert spec.block_names(model) == ["JointTransformerBlock"]
    assert resolve_model("diffusers:SD3Transformer2DModel").block_names(model) is None  # found when compiled
