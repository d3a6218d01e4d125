"""Prebuilt artifacts: `omni-compile build` (AOT) -> `omni_compile.load` with zero compilation.

One artifact per model (flux-tiny, wan-tiny; two shape buckets each) is built through the CLI in a
subprocess (minutes on 2 CPU cores: one AOTInductor package per region x signature): flux-tiny's is the
session's (`flux_artifact`, tests/conftest.py, also read by tests/test_inspect.py and tests/test_server.py),
wan-tiny's is built once for this module. Tamper tests work on copies of them.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import FLUX_ARTIFACT_BUCKETS, BackgroundRun, selected
from omni_compile.artifact import ArtifactError
from test_cli import assert_user_error, cli

pytestmark = pytest.mark.compile

MODELS = {"flux-tiny": "64x64,64x128", "wan-tiny": "64x64x5,64x96x5"}


@pytest.fixture(scope="module")
def artifacts(request, tmp_path_factory, subprocess_env):
    """{model: artifact directory}: flux-tiny the session's (read-only), wan-tiny built here, at the same time
    as the session's flux-tiny when that one is not built yet (one compiler process each on 2 CPU cores)."""
    assert MODELS["flux-tiny"] == ",".join(FLUX_ARTIFACT_BUCKETS)
    root = tmp_path_factory.mktemp("artifacts")
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    wan = BackgroundRun([sys.executable, "-P", "-m", "omni_compile.cli", "build", "wan-tiny", "--shapes",
                         MODELS["wan-tiny"], "--out", str(root / "wan-tiny")], env, root / "log-wan")  # fmt: skip
    try:
        flux = request.getfixturevalue("flux_artifact")
        proc = wan.result()
    finally:
        wan.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    for progress in (flux.stderr, proc.stderr):
        assert "compiling block" in progress and "wrote" in progress  # progress and summary
    assert [p.name for p in root.iterdir() if ".partial-" in p.name] == []
    return {"flux-tiny": flux.path, "wan-tiny": root / "wan-tiny"}


def test_manifest_describes_the_build(artifacts):
    m = json.loads((artifacts["flux-tiny"] / "manifest.json").read_text())
    assert m["schema"] == "omni-compile/artifact/1" and m["model"]["family"] == "flux"
    assert m["weights"]["reference"] == "random seed 0" and len(m["weights"]["tensors"]) > 50
    assert m["build"]["buckets"] == ["64x64", "64x128"] and m["build"]["mode"] == "aot"
    assert m["platform"]["kind"] == "cpu" and m["platform"]["torch_version"] == torch.__version__
    blocks = {r["name"]: r for r in m["regions"] if r["kind"] == "block"}
    assert set(blocks) == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    for r in blocks.values():
        assert set(r["buckets"]) == {"64x64", "64x128"}
        # one file per bucket serves every instance of the block
        for entries in r["buckets"].values():
            assert len(entries) == 1 and entries[0]["instances"] == r["instances"]
    glue = {r["name"] for r in m["regions"] if r["kind"] == "glue"}
    assert {"x_embedder", "context_embedder", "norm_out", "proj_out"} <= glue
    # the passes ran inside the AOT compiles: per bucket, the JIT build's counts (tests/test_cli.py) and the
    # glue's: norm_out's AdaLayerNormContinuous, one adaln more
    assert m["fusion"]["matches"] == {"complex_mul": 0, "rms_norm": 12, "qk_norm_rope": 8, "adaln": 12,
                                      "attention": 0, "lower_fused_ops": 20}  # fmt: skip
    assert m["attention"]["per_role"]["flux.joint"]["implementation"] == "TORCH_SDPA"
    assert all(p["rel_l2_vs_eager"] < 1e-4 for p in m["parity"].values())
    for r in m["regions"]:
        for entries in r["buckets"].values():
            for e in entries:
                assert (artifacts["flux-tiny"] / e["file"]).is_file()
    assert (artifacts["flux-tiny"] / "report" / "build_report.json").is_file()


def test_wan_manifest_keeps_the_attention_roles(artifacts):
    """The exported block is not a registered submodule, so roles come from the nodes' stack traces."""
    m = json.loads((artifacts["wan-tiny"] / "manifest.json").read_text())
    assert set(m["attention"]["per_role"]) == {"wan.self", "wan.cross"}
    assert {r["name"] for r in m["regions"] if r["kind"] == "block"} == {"WanTransformerBlock"}
    assert m["build"]["buckets"] == ["64x64x5", "64x96x5"]
    # Wan's rotary scatter pattern (allows several users: the pattern matcher's MULTIPLE, tested by identity)
    # matches in the AOT compile, whose config Inductor deep-copies with the pass manager in it
    block = next(r for r in m["regions"] if r["kind"] == "block")
    assert all(e["passes"]["qk_norm_rope"] == 2 for es in block["buckets"].values() for e in es), block


LOAD_SCRIPT = r"""
import json, sys, torch
import omni_compile
from torch._dynamo.utils import counters
from omni_compile.config import ShapeBucket
from omni_compile.models import resolve_model

name, path, how = sys.argv[1], sys.argv[2], sys.argv[3]
from omni_compile.artifact import loader
checked = loader.check(path)
# "preload": the compiled files load on a background thread while the model is made, as the server does
preloaded = loader.preload(path, checked) if how == "preload" else None
spec = resolve_model(name)
model = spec.load(dtype=torch.float32, device="cpu", seed=0)
refs = {}
with torch.no_grad():
    for b in json.loads(open(path + "/manifest.json").read())["build"]["buckets"]:
        inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(b), dtype=torch.float32, device="cpu",
                                             text_len=spec.text_len, seed=1)
        refs[b] = (inputs, model(**inputs)[0].clone())
counters.clear()
loaded = omni_compile.load(path, weights=model, checked=checked, preloaded=preloaded)
errs = {}
with torch.no_grad():
    for b, (inputs, ref) in refs.items():
        out = loaded(**inputs)[0]
        errs[b] = float((out.double() - ref.double()).norm() / ref.double().norm())
print("RESULT " + json.dumps({
    "errs": errs, "dynamo": {k: dict(v) for k, v in counters.items() if v},
    "regions_compiled": omni_compile.counters.regions_compiled, "stats": loaded._omni_artifact.stats,
}))
"""


@pytest.mark.parametrize("model,how", [("flux-tiny", "load"), ("wan-tiny", "load"), ("flux-tiny", "preload")])
def test_fresh_process_loads_with_zero_compilations(artifacts, subprocess_env, model, how):
    proc = subprocess.run([sys.executable, "-P", "-c", LOAD_SCRIPT, model, str(artifacts[model]), how],
                          env=subprocess_env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["dynamo"] == {} and res["regions_compiled"] == 0  # no Dynamo frame, no Inductor graph
    assert res["stats"]["compiled_calls"] > 0
    assert set(res["errs"]) == set(MODELS[model].split(",")) and all(e < 1e-4 for e in res["errs"].values()), res


def test_preload_hands_each_file_and_its_error_to_the_caller(artifacts, monkeypatch):
    """The background thread's result per file, in the caller's thread: a file that failed raises its own error
    from `load` (nothing is installed), the others load; a preload of another artifact is refused."""
    from omni_compile.models import resolve_model

    import omni_compile
    from omni_compile.artifact import loader

    art = artifacts["flux-tiny"]
    checked = loader.check(art)
    broken = _block_file(json.loads((art / "manifest.json").read_text()))
    real, calls = loader.load_package, []

    def load_package(path, *a, **k):
        calls.append(path.relative_to(art).as_posix())
        if calls[-1] == broken:
            raise RuntimeError(f"cannot read {calls[-1]}")
        return real(path, *a, **k)

    monkeypatch.setattr(loader, "load_package", load_package)
    pre = loader.preload(art, checked)
    model = resolve_model("flux-tiny").load(dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(RuntimeError, match=re.escape(f"cannot read {broken}")):
        omni_compile.load(art, weights=model, checked=checked, preloaded=pre)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing installed
    for e in checked[0].files():  # the thread may still be on the files after the broken one: wait for it
        with contextlib.suppress(RuntimeError):
            pre.get(e.file)
    assert sorted(calls) == sorted(e.file for e in checked[0].files())  # each file loaded once, on the thread
    with pytest.raises(KeyError, match="not a file of"):
        pre.get("nope.pt2")
    with pytest.raises(ValueError, match="preloaded= holds the files of"):
        omni_compile.load(artifacts["wan-tiny"], weights=model, preloaded=pre)
    assert loader.preload(art, (checked[0], ["device: another"])) is None  # a platform mismatch compiles instead


def _copy(artifacts, tmp_path, model="flux-tiny"):
    dst = tmp_path / "art"
    shutil.copytree(artifacts[model], dst)
    return dst, json.loads((dst / "manifest.json").read_text())


def _block_file(manifest):
    return next(r for r in manifest["regions"] if r["kind"] == "block")["buckets"]["64x64"][0]["file"]


def test_changed_byte_is_refused_naming_the_file(artifacts, tmp_path):
    import omni_compile

    art, m = _copy(artifacts, tmp_path)
    f = art / _block_file(m)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(omni_compile.ArtifactError, match=f"compiled file {_block_file(m)} fails its checksum"):
        omni_compile.load(art)


def test_missing_file_is_refused(artifacts, tmp_path, subprocess_env):
    art, m = _copy(artifacts, tmp_path)
    (art / _block_file(m)).unlink()
    assert_user_error(cli("verify", str(art), env=subprocess_env), f"compiled file {_block_file(m)} is missing")


def test_a_package_that_does_not_load_is_named_by_the_child_probe(artifacts, tmp_path):
    """probe_load loads every package in a child process; a broken one fails it with the file's name."""
    from omni_compile.artifact.loader import probe_load
    from omni_compile.artifact.manifest import read_manifest

    art, m = _copy(artifacts, tmp_path)
    probe_load(art, read_manifest(art))  # the intact copy loads
    (art / _block_file(m)).write_bytes(b"not a zip archive")
    with pytest.raises(ArtifactError, match=re.escape(f"loading failed while loading {_block_file(m)}")):
        probe_load(art, read_manifest(art))


def test_a_loader_crash_in_the_probe_is_reported_not_fatal(artifacts, tmp_path, monkeypatch):
    """A native crash (SIGSEGV) of AOTInductor's loader, as an H200 image with torch 2.11 showed: the
    probe reports the signal and the file instead of taking the process down."""
    from omni_compile.artifact import loader
    from omni_compile.artifact.manifest import read_manifest

    art, m = _copy(artifacts, tmp_path)
    typed = read_manifest(art)
    crashed = subprocess.CompletedProcess([], -11, stdout=f"loading {_block_file(m)}\n", stderr="")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: crashed)
    with pytest.raises(ArtifactError, match=re.escape(f"the loader crashed (SIGSEGV) while loading {_block_file(m)}")):
        loader.probe_load(art, typed)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("torch_version", "2.11.0+cu130", "torch version: artifact '2.11.0+cu130', here"),
        ("device_name", "NVIDIA H200", "device: artifact 'NVIDIA H200', here"),
    ],
)
def test_manifest_from_another_platform_is_refused(artifacts, tmp_path, field, value, message):
    import omni_compile

    art, m = _copy(artifacts, tmp_path)
    m["platform"][field] = value
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(omni_compile.ArtifactError, match=re.escape("built for another platform: " + message)):
        omni_compile.load(art)


def test_jit_fallback_compiles_instead(artifacts, tmp_path):
    import omni_compile

    art, m = _copy(artifacts, tmp_path)
    m["platform"]["torch_version"] = "0.0.0"
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="compiling just in time instead"):
        model = omni_compile.load(art, jit_fallback=True)
    state = omni_compile.compile_state(model)
    assert [r.name for r in state.regions] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    omni_compile.uncompile(model)


def test_weights_with_a_wrong_shape_are_refused(artifacts):
    import omni_compile
    from omni_compile.models import resolve_model

    model = resolve_model("flux-tiny").load(dtype=torch.float32, device="cpu")
    model.proj_out.weight = torch.nn.Parameter(torch.zeros(7, model.proj_out.weight.shape[1]))
    with pytest.raises(omni_compile.ArtifactError, match=r"proj_out.weight: shape \[7, 32\], the artifact was built for"):
        omni_compile.load(artifacts["flux-tiny"], weights=model)
    with pytest.raises(omni_compile.ArtifactError, match="dtype bfloat16, the artifact was built for float32"):
        omni_compile.load(artifacts["flux-tiny"], weights=model.to(torch.bfloat16))


def test_a_model_of_another_config_is_refused_naming_the_field(artifacts, tmp_path):
    """Same tensor shapes, another rotary split: the compiled regions would run and be wrong (rel L2 ~3e-2
    before this check), so the load refuses, naming the field and both values; verify does too."""
    import omni_compile
    from omni_compile.artifact.loader import verify
    from omni_compile.models import resolve_model

    model = resolve_model("flux-tiny", model_config={"axes_dims_rope": [2, 6, 8]}).load(dtype=torch.float32,
                                                                                          device="cpu")  # fmt: skip
    message = re.escape("axes_dims_rope: artifact [4, 6, 6], model [2, 6, 8]")
    with pytest.raises(omni_compile.ArtifactError, match=message):
        omni_compile.load(artifacts["flux-tiny"], weights=model)
    with pytest.raises(omni_compile.ArtifactError, match=message):
        verify(artifacts["flux-tiny"], weights=model)
    model.save_pretrained(tmp_path / "other")
    with pytest.raises(omni_compile.ArtifactError, match=message):
        omni_compile.load(artifacts["flux-tiny"], weights=tmp_path / "other")


def test_an_attention_backend_that_cannot_run_here_is_refused(artifacts, tmp_path):
    """The files call the backends the build chose; one that cannot run here refuses the load with the reason
    and the backends that would run (never a silent fallback)."""
    import omni_compile

    art, m = _copy(artifacts, tmp_path)
    assert m["attention"]["backends"] == ["TORCH_SDPA"]
    m["attention"]["backends"] = ["FA3_ATTN", "TORCH_SDPA"]
    (art / "manifest.json").write_text(json.dumps(m))
    message = ("its compiled regions call attention backends that cannot run here: FA3_ATTN: it runs on cuda, not on "
               "cpu. Install what is missing, or rebuild the artifact here (backends that would run: TORCH_SDPA; "
               "--attention-backend NAME picks one)")  # fmt: skip
    with pytest.raises(omni_compile.ArtifactError, match=re.escape(message)):
        omni_compile.load(art)


def test_the_manifest_is_read_typed_and_checked(artifacts, tmp_path):
    """Every reader gets the manifest through `read_manifest`: typed records, nothing lost (it writes back the
    same JSON), and an unknown or missing field is an error naming it, before anything loads."""
    import copy

    import omni_compile
    from omni_compile.artifact.manifest import Manifest, read_manifest

    art, m = _copy(artifacts, tmp_path)
    typed = read_manifest(art)
    assert typed.to_json() == m
    assert typed.build.buckets == m["build"]["buckets"] and typed.model.cls == m["model"]["class"]
    first = typed.regions[0].buckets[m["build"]["buckets"][0]][0]
    assert first.sha256 == m["regions"][0]["buckets"][m["build"]["buckets"][0]][0]["sha256"]
    assert len(typed.files()) == len({e["file"] for r in m["regions"] for es in r["buckets"].values() for e in es})
    bad = dict(m, extra=1)
    with pytest.raises(omni_compile.ArtifactError, match=re.escape("has unknown field(s) ['extra'] (written by a newer")):
        Manifest.from_json(bad)
    bad = copy.deepcopy(m)
    bucket = m["build"]["buckets"][0]
    del bad["regions"][0]["buckets"][bucket][0]["sha256"]
    (art / "manifest.json").write_text(json.dumps(bad))
    where = f"manifest.json.regions[0].buckets[{bucket!r}][0] has no field 'sha256'"
    with pytest.raises(omni_compile.ArtifactError, match=re.escape(where)):
        omni_compile.load(art)


def test_an_artifact_of_an_older_calling_convention_is_refused(artifacts, tmp_path):
    import omni_compile

    art, m = _copy(artifacts, tmp_path)
    del m["build"]["region_call"]
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(omni_compile.ArtifactError, match="built by an older omni-compile\\); rebuild it"):
        omni_compile.load(art)


def test_unknown_bucket_is_refused_with_the_supported_list(artifacts):
    import omni_compile
    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model

    spec = resolve_model("flux-tiny")
    model = omni_compile.load(artifacts["flux-tiny"])
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("128x128"), dtype=torch.float32, device="cpu",
                                         text_len=spec.text_len)  # fmt: skip
    with pytest.raises(omni_compile.ArtifactError, match="the artifact holds the shape buckets 64x64, 64x128"):
        with torch.no_grad():
            model(**inputs)


def test_verify_cli(artifacts, subprocess_env):
    proc = cli("verify", str(artifacts["wan-tiny"]), "--json", env=subprocess_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["ok"] and res["compilations"] == 0 and set(res["parity"]) == {"64x64x5", "64x96x5"}
    assert any("compiled files match their sha256" in c for c in res["checks"])


STANDALONE_LOAD = r"""
import json, sys, torch
import omni_compile
from torch._dynamo.utils import counters
from omni_compile.artifact.loader import _compilations
from omni_compile.config import ShapeBucket
from omni_compile.models import resolve_model

spec = resolve_model("flux-tiny")
model = spec.load(dtype=torch.float32, device="cpu", seed=0)
inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x64"), dtype=torch.float32, device="cpu",
                                     text_len=spec.text_len, seed=1)
with torch.no_grad():
    ref = model(**inputs)[0].clone()
    loaded = omni_compile.load(sys.argv[1], weights=model)
    out = loaded(**inputs)[0]
print("RESULT " + json.dumps({"err": float((out.double() - ref.double()).norm() / ref.double().norm()),
    "compilations": _compilations(), "hits": counters["inductor"].get("fxgraph_cache_hit", 0),
    "calls": loaded._omni_artifact.stats["compiled_calls"]}))
"""


def _standalone_build(out, store) -> list[str]:
    return ["build", "flux-tiny", "--shapes", "64x64", "--format", "inductor-standalone", "--store", store, "--out",
            str(out), "-q"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def standalone_first_node(request, tmp_path_factory, subprocess_env):
    """(BackgroundRun, root) of the first node's build of test_standalone_format_builds_shares_through_a_store_
    and_loads (into root/a, publishing into the file store root/store), started with this module's first test
    so that it runs beside the others (None when that test is not selected)."""
    if not selected(request, "test_standalone_format_builds_shares_through_a_store_and_loads"):
        yield None
        return
    root = tmp_path_factory.mktemp("standalone")
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor-a"))
    run = BackgroundRun([sys.executable, "-P", "-m", "omni_compile.cli", *_standalone_build(root / "a",
                         f"file://{root / 'store'}")], env, root / "log-a")  # fmt: skip
    yield run, root
    run.stop()


def test_standalone_format_builds_shares_through_a_store_and_loads(tmp_path, subprocess_env, standalone_first_node):
    """--format inductor-standalone (the CUDA default) on the CPU: the passes run inside the compile,
    the files go through a store to a second node with their call specs, and a fresh process loads
    them with no Dynamo graph and no Inductor compile (every graph an FX-cache hit from the file)."""
    run, root = standalone_first_node
    proc = run.result()  # node a, into an empty store
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-b"))
    proc = cli(*_standalone_build(tmp_path / "b", f"file://{root / 'store'}"), env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (root / "a", tmp_path / "b"))
    assert a["build"]["format"] == "inductor-standalone"
    files = [e for r in a["regions"] for es in r["buckets"].values() for e in es]
    assert files and all(e["file"].endswith(".bin") and e["pytree"]["in"] and e["pytree"]["out"] for e in files)
    # per bucket, the same matches as the AOTInductor build (test_manifest_describes_the_build: two buckets)
    assert a["fusion"]["matches"] == {"complex_mul": 0, "rms_norm": 6, "qk_norm_rope": 4, "adaln": 6, "attention": 0,
                                      "lower_fused_ops": 10}  # fmt: skip
    assert a["compilations"]["aot_compiles"] == len(files) and b["compilations"]["aot_compiles"] == 0
    assert b["store"]["hits"] == len(files) and b["fusion"]["matches"] == a["fusion"]["matches"]
    sums = lambda m: sorted((e["file"], e["sha256"], json.dumps(e["pytree"])) for r in m["regions"]
                            for es in r["buckets"].values() for e in es)  # fmt: skip
    assert sums(a) == sums(b)
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-load"))
    proc = subprocess.run([sys.executable, "-P", "-c", STANDALONE_LOAD, str(tmp_path / "b")], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["compilations"] == 0 and res["hits"] == len(files) and res["calls"] > 0, res
    assert res["err"] < 1e-4, res


def test_format_is_checked(tmp_path, subprocess_env):
    assert_user_error(cli("build", "flux-tiny", "--mode", "jit", "--format", "aoti-package", "--out",
                          str(tmp_path / "o"), env=subprocess_env),
                      "--format chooses an artifact build's compiled-file format; use it with --mode aot")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_not_an_artifact(tmp_path, subprocess_env):
    assert_user_error(cli("verify", str(tmp_path), env=subprocess_env), "no manifest.json; not an omni-compile artifact")
    assert_user_error(cli("build", "--mode", "aot", "--cache-from", str(tmp_path), "--out", str(tmp_path / "o"),
                          env=subprocess_env), "--cache-from warm-starts a JIT build; use it with --mode jit")  # fmt: skip


def test_bucket_output_of_each_output_form():
    """What the parity checks compare: the sample of a tuple or an output object; a list of tensors (one per image,
    as ZImageTransformer2DModel returns) as their values concatenated; anything else is refused, named."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    from omni_compile.artifact.parity import bucket_output

    t = torch.arange(6.0).view(2, 3)
    assert bucket_output((t,)) is t and bucket_output(Transformer2DModelOutput(sample=t)) is t and bucket_output(t) is t
    per_image = [torch.ones(2, 2), torch.zeros(3)]
    expected = torch.tensor([1.0, 1, 1, 1, 0, 0, 0])
    assert torch.equal(bucket_output(Transformer2DModelOutput(sample=per_image)), expected)
    assert torch.equal(bucket_output((per_image,)), expected)
    with pytest.raises(TypeError, match="output sample is a list of int, str; omni-compile compares a tensor or a list"):
        bucket_output(([1, "a"],))
