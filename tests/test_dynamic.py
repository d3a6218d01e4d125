"""`omni-compile build --dynamic LOW-HIGH:STEP`: regions compiled once with symbolic sequence lengths serve every
size of the range (no file per bucket, no compile at a new size), on the CLI, through `omni_compile.load` and in
the server; the range's parsing and refusals; the families of calls a file serves; sizes read from the inputs in
a symbolic graph, so that the fusion patterns match as they do on static shapes."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import rel_l2
from omni_compile.models import resolve_model
from test_cli import assert_user_error, cli

import omni_compile
from omni_compile.artifact import aot
from omni_compile.artifact.dynamic import DynamicSpec, families
from omni_compile.artifact.manifest import ArtifactError
from omni_compile.build.session import BuildOptions, BuildSession
from omni_compile.config import ConfigError, DynamicRange, ShapeBucket

RANGE = "64-128:16"
# Pass matches per block with static shapes on the CPU (tests/test_artifact.py's flux-tiny build, per file)
FLUX_BLOCK_MATCHES = {"FluxTransformerBlock": {"rms_norm": 4, "qk_norm_rope": 2, "adaln": 4},
                      "FluxSingleTransformerBlock": {"rms_norm": 2, "qk_norm_rope": 2, "adaln": 1}}  # fmt: skip


# ---------------------------------------------------------------- the range and the families (no compile)
def test_range_parse_and_sizes():
    r = DynamicRange.parse("512-1536:64")
    assert (r.low, r.high, r.step) == (512, 1536, 64) and DynamicRange.parse("512-1536") == r
    assert r.contains(512, 1536) and r.contains(1024, 576)
    assert not r.contains(1600, 1024) and not r.contains(1024, 1000) and not r.contains(448, 512)
    assert [str(b) for b in r.probes()] == ["512x576", "1536x1472"]
    assert [str(b) for b in r.probes(81, 2)] == ["512x576x81@2", "1536x1472x81@2"]
    assert str(r.middle()) == "1024x1088" and r.contains(1024, 1088)
    assert DynamicRange.from_json(r.to_json()) == r and DynamicRange.from_json(None) is None


@pytest.mark.parametrize("text,message", [
    ("512x1536", "expected LOW-HIGH[:STEP]"),
    ("0-128:16", "must be positive"),
    ("512-540:64", "multiple of STEP (64)"),
    ("512-1000:64", "multiple of STEP (64)"),
])  # fmt: skip
def test_range_refused(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):  # fmt: skip
        DynamicRange.parse(text)


def test_session_buckets():
    """Probes first (per frame count and batch of the given shapes), then the given shapes; the middle is checked."""
    s = BuildSession.resolve(BuildOptions(model="flux-tiny", device="cpu", dynamic=RANGE, shapes="64x64,96x96"))
    assert [str(b) for b in s.buckets] == ["64x80", "128x112", "64x64", "96x96"]
    assert [str(b) for b in s.check_buckets] == ["96x112"] and s.dynamic == DynamicRange(64, 128, 16)
    # a preset's own shapes outside the range are dropped; given ones are an error
    s = BuildSession.resolve(BuildOptions(model="flux-tiny", device="cpu", dynamic="128-192:32"))
    assert all(s.dynamic.contains(b.height, b.width) for b in s.buckets)
    with pytest.raises(ConfigError, match=r"--shapes 64x64 outside --dynamic 128-192:32"):
        BuildSession.resolve(BuildOptions(model="flux-tiny", device="cpu", dynamic="128-192:32", shapes="64x64"))
    with pytest.raises(ConfigError, match="FLUX needs height and width divisible by 16"):
        BuildSession.resolve(BuildOptions(model="flux-tiny", device="cpu", dynamic="64-128:8"))


def _key(*tensors, flag=None):
    return aot.call_key(tensors, {"flag": flag})


def test_families_and_matching():
    a = _key(torch.zeros(1, 20, 32), torch.zeros(28, 16), torch.zeros(1, 32))
    b = _key(torch.zeros(1, 56, 32), torch.zeros(64, 16), torch.zeros(1, 32))
    other = _key(torch.zeros(1, 20, 32), torch.zeros(28, 16), torch.zeros(1, 32), flag=True)  # another value
    assert families({"a": a, "b": b, "o": other}) == [["a", "b"], ["o"]]
    spec = DynamicSpec.of([a, b])
    assert spec.shape == [(0, 1), (1, 0)] and spec.contiguous == [0, 1, 2]
    assert DynamicSpec.of([a]) is None
    assert aot.describe_key(a, spec.shape) == "1x*x32, *x16, 1x32, None"
    assert spec.matches(a, _key(torch.zeros(1, 36, 32), torch.zeros(44, 16), torch.zeros(1, 32)))
    assert not spec.matches(a, _key(torch.zeros(2, 36, 32), torch.zeros(44, 16), torch.zeros(1, 32)))  # batch
    assert not spec.matches(a, _key(torch.zeros(1, 36, 32), torch.zeros(44, 16), torch.zeros(1, 64)))  # width
    assert not spec.matches(a, _key(torch.zeros(1, 36, 32), torch.zeros(44, 16), torch.zeros(1, 32), flag=True))
    strided = torch.zeros(1, 32, 36).transpose(1, 2)  # [1, 36, 32], not contiguous
    assert not spec.matches(a, aot.call_key((strided, torch.zeros(44, 16), torch.zeros(1, 32)), {"flag": None}))
    assert DynamicSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_jit_mode_refuses_dynamic(tmp_path, subprocess_env):
    proc = cli("build", "flux-tiny", "--mode", "jit", "--dynamic", RANGE, "--out", str(tmp_path / "o"),
               env=subprocess_env)  # fmt: skip
    assert_user_error(proc, "--dynamic compiles regions with symbolic sizes into an artifact; use it with --mode aot")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- a Wan block with symbolic sizes
@pytest.mark.compile
def test_wan_block_fuses_with_symbolic_sizes(tmp_path):
    """Wan's block exported with a symbolic sequence length fuses as with static shapes (rms_norm 4, qk_norm_rope
    2, adaln 2: the sizes are read from the inputs, and the manager is not deep-copied), and runs another length."""
    from omni_compile.compiler import make_pass_manager
    from omni_compile.config import CompileConfig
    from omni_compile.platform import current_platform

    spec = resolve_model("wan-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    block, calls = model.blocks[0], []
    hook = block.register_forward_pre_hook(lambda m, a, k: calls.append(aot.canonical_call(a, k)), with_kwargs=True)
    with torch.no_grad():
        for shape in ("64x80x5", "128x112x5"):
            model(**spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.float32, device="cpu",
                                                   text_len=8))  # fmt: skip
    hook.remove()
    keys = [aot.call_key(*c) for c in calls]
    dyn = DynamicSpec.of(keys)
    assert aot.describe_key(keys[0], dyn.shape) == "1x*x32, 1x8x32, 1x6x32, 1x*x1x16, 1x*x1x16"
    pm = make_pass_manager(CompileConfig(), current_platform("cpu"), spec.adapter)
    cf = aot.compile_package(block, calls[-1], tmp_path / "wan.pt2", pm, "wan@dyn", dynamic=dyn)
    assert {k: cf.passes[k] for k in ("rms_norm", "qk_norm_rope", "adaln")} == {"rms_norm": 4, "qk_norm_rope": 2,
                                                                                "adaln": 2}  # fmt: skip
    from omni_compile.artifact.loader import load_package

    runner = load_package(tmp_path / "wan.pt2")
    args, kwargs = calls[0]  # the other recorded length: [1, 20, 32]
    with torch.no_grad():
        got = runner(aot.module_state(block), aot.tensor_leaves(args, kwargs))
        ref = block(*args, **kwargs)
    assert got.shape == ref.shape and rel_l2(got, ref) < 1e-5


# ---------------------------------------------------------------- the flux-tiny --dynamic artifact
@pytest.fixture(scope="module")
def dynamic_artifact(tmp_path_factory, subprocess_env):
    root = tmp_path_factory.mktemp("dynamic")
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    proc = cli("build", "flux-tiny", "--dynamic", RANGE, "--out", str(root / "art"), env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "art", proc.stderr


@pytest.mark.compile
def test_dynamic_build_one_file_per_region(dynamic_artifact):
    art, stderr = dynamic_artifact
    m = json.loads((art / "manifest.json").read_text())
    assert m["build"]["dynamic"] == {"min": 64, "max": 128, "step": 16, "checked": ["96x112"]}
    assert m["build"]["buckets"] == ["64x80", "128x112", "64x64", "128x128"]  # probes, then the preset's shapes
    for region in m["regions"]:
        files = {e["file"] for es in region["buckets"].values() for e in es}
        assert len(files) == 1, (region["name"], files)  # every bucket runs the one file
    blocks = {r["name"]: next(iter(r["buckets"].values()))[0] for r in m["regions"] if r["kind"] == "block"}
    for name, entry in blocks.items():
        assert "*" in entry["call"] and entry["dynamic"]["shape"], entry
        assert {k: entry["passes"][k] for k in FLUX_BLOCK_MATCHES[name]} == FLUX_BLOCK_MATCHES[name]
    assert set(m["parity"]) == {"64x80", "128x112", "64x64", "128x128", "96x112"}
    assert all(p["rel_l2_vs_eager"] < 1e-4 for p in m["parity"].values())
    assert m["compilations"]["aot_compiles"] == len(m["regions"]) == 8
    assert "compiling block FluxTransformerBlock [1x8x32, 1x*x32, *x16, *x16, None, 1x32]" in stderr


@pytest.mark.compile
def test_dynamic_artifact_runs_any_size_of_the_range_without_compiling(dynamic_artifact):
    from omni_compile.artifact.loader import _compilations

    art, _ = dynamic_artifact
    spec = resolve_model("flux-tiny")
    eager = spec.load(dtype=torch.float32, device="cpu", seed=0)
    before = (_compilations(), omni_compile.counters.aot_compiles, omni_compile.counters.region_exports)
    model = omni_compile.load(art)
    for shape in ("80x112", "128x64", "112x96", "64x128"):  # none recorded by the build
        inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.float32, device="cpu",
                                             text_len=spec.text_len, seed=3)  # fmt: skip
        with torch.no_grad():
            got, ref = model(**inputs)[0], eager(**inputs)[0]
        assert got.shape == ref.shape and rel_l2(got, ref) < 1e-4, shape
    assert (_compilations(), omni_compile.counters.aot_compiles, omni_compile.counters.region_exports) == before
    assert model._omni_artifact.stats["compiled_calls"] > 0
    # batch was static in the build (the probes have batch 1): refused, naming the range
    inputs = spec.adapter.example_inputs(model, ShapeBucket(80, 112, batch=2), dtype=torch.float32, device="cpu",
                                         text_len=spec.text_len)  # fmt: skip
    with pytest.raises(ArtifactError, match=r"and every size of 64-128:16 \(HEIGHTxWIDTH\)"), torch.no_grad():
        model(**inputs)


@pytest.mark.compile
def test_verify_runs_the_checked_size(dynamic_artifact, subprocess_env):
    art, _ = dynamic_artifact
    proc = cli("verify", str(art), env=subprocess_env)
    assert proc.returncode == 0, proc.stderr
    assert "96x112 rel L2" in proc.stdout + proc.stderr and "0 compilation(s)" in proc.stdout + proc.stderr


@pytest.mark.compile
def test_server_serves_sizes_of_the_range(dynamic_artifact):
    """A size of the range that is no bucket: 200 with an image of that size; outside the range: 400 naming it."""
    import base64
    import io

    from omni_compile.server import ServeConfig, build_app
    from PIL import Image
    from test_server import call
    from test_server_engine import _serving

    art, _ = dynamic_artifact
    with _serving(build_app(ServeConfig(artifact=str(art), device="cpu", warmup_steps=0))) as port:
        req = {"prompt": "a", "size": "112x80", "num_inference_steps": 2}
        status, body = call(port, "/v1/images/generations", req)
        assert status == 200, body
        image = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
        assert image.size == (112, 80)
        status, body = call(port, "/v1/images/generations", {**req, "size": "144x80"})
        assert status == 400 and body["error"]["param"] == "size"
        assert "and every width and height from 64 to 128 in steps of 16" in body["error"]["message"]
        status, models = call(port, "/v1/models")
        assert models["data"][0]["dynamic"] == {"min": 64, "max": 128, "step": 16}


@pytest.mark.gpu
@pytest.mark.compile
def test_dynamic_artifact_on_cuda(tmp_path, subprocess_env):
    """On a GPU (Inductor standalone files, our Triton kernels, a measured attention backend, CUDA graphs): sizes
    of the range that no forward recorded run within the bf16 bound, with no compile, one CUDA graph each."""
    from omni_compile.artifact.loader import _compilations

    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = cli("build", "flux-tiny", "--dtype", "bf16", "--device", "cuda", "--dynamic", RANGE, "--out",
               str(tmp_path / "art"), env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert m["build"]["format"] == "inductor-standalone" and m["build"]["dynamic"]["checked"] == ["96x112"]
    impls = m["fusion"]["fused_op_implementations"]
    assert impls and all(v["implementation"].startswith("triton") for v in impls.values()), impls
    spec = resolve_model("flux-tiny")
    eager = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
    before = _compilations()
    model = omni_compile.load(tmp_path / "art")
    for shape in ("80x112", "128x64", "80x112"):
        inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.bfloat16, device="cuda",
                                             text_len=spec.text_len, seed=3)  # fmt: skip
        with torch.no_grad():
            got, ref = model(**inputs)[0], eager(**inputs)[0]
        assert got.shape == ref.shape and rel_l2(got, ref) < 3e-2, shape
    assert _compilations() == before
    graphs = model._omni_artifact.cuda_graphs
    assert graphs.max_graphs == 8 and graphs.stats["captures"] == 2 and graphs.stats["replays"] == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_sizes_from_inputs_gives_each_size_one_node():
    """A size read from an intermediate (one more user of it) and a second node of the same size become one node per
    size, read from the inputs after the placeholders; the graph computes the same at another size."""
    import operator

    from omni_compile.graphs.symbolic import sizes_from_inputs
    from torch.export import Dim

    class Twice(torch.nn.Module):
        def forward(self, text, image):
            joint = torch.cat([text, image], dim=1)  # [1, 8 + S, 4]
            return joint.reshape(1, joint.shape[1], 2, 2) + (joint * 2).reshape(1, joint.shape[1], 2, 2)

    text, image = torch.randn(1, 8, 4), torch.randn(1, 20, 4)
    gm = torch.export.export(Twice(), (text, image), dynamic_shapes=(None, {1: Dim.AUTO}), strict=False).module()
    g = gm.graph
    cat = next(n for n in g.nodes if n.target is torch.ops.aten.cat.default)
    second = [n for n in g.nodes if n.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default)][-1]
    with g.inserting_before(second):  # as Inductor's graphs have it: the size read from the concatenation
        read = g.call_function(torch.ops.aten.sym_size.int, (cat, 1))
    read.meta["val"] = cat.meta["val"].shape[1]
    second.args = (second.args[0], [read if isinstance(a, torch.fx.Node) else a for a in second.args[1]])
    sizes = lambda: [n for n in g.nodes if isinstance(n.meta.get("val"), torch.SymInt)]
    assert len(cat.users) == 3 and len({str(n.meta["val"]) for n in sizes()}) < len(sizes())
    assert sizes_from_inputs(g) > 0
    g.eliminate_dead_code()
    gm.recompile()
    after = sizes()
    assert len({str(n.meta["val"]) for n in after}) == len(after)  # one node per size
    assert all(n.args[0].op == "placeholder" for n in after if n.target is torch.ops.aten.sym_size.int)
    assert {n.target for n in after} <= {torch.ops.aten.sym_size.int, operator.add} and len(cat.users) == 2
    other = torch.randn(1, 36, 4)
    torch.testing.assert_close(gm(text, other), Twice()(text, other))
    assert sizes_from_inputs(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)).graph) == 0  # no symbolic size: as is
