"""Models with no adapter, built ahead of time: diffusers LTX-Video, Chroma and Qwen-Image (tiny configs,
tests/generic_model.py), each through `module:Class` and through a saved diffusers directory, then
`verify` and `omni_compile.load` with zero compilations.

The class builds compile (minutes on 2 CPU cores); the directory builds hold other weights of the same
architecture and take every file from the class builds' store, so they export and compile nothing and
check parity on their own weights (`--parity always`). The models are built at the same time, one
subprocess each (a build runs mostly one compiler process at a time, so one build leaves a core idle).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import with_tests_dir_on_path
from generic_model import GENERIC_MODELS
from test_cli import assert_user_error, cli

pytestmark = [pytest.mark.compile, pytest.mark.timeout(1800)]  # every model's builds in the first test's setup


@pytest.fixture(scope="module")
def env(subprocess_env, tmp_path_factory):
    return with_tests_dir_on_path(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path_factory.mktemp("inductor-generic")))


def _build_model(name: str, root: Path, env: dict) -> dict:
    """The class build of model `name` into a new file store, then the build of its saved directory (written
    beforehand to root/weights) from that store: {"name", "class": ART, "dir": ART, "weights": DIR, "progress":
    the class build's stderr}."""
    cls, config, inputs, shape = GENERIC_MODELS[name]
    env = dict(env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))  # one per concurrent build
    store = f"file://{root / 'store'}"
    art = root / "class"
    proc = cli("build", cls, "--model-config", json.dumps(config), "--example-inputs", inputs, "--shapes", shape,
               "--device", "cpu", "--store", store, "--out", str(art), env=env, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = proc.stderr
    weights = root / "weights"
    art_dir = root / "dir"
    proc = cli("build", str(weights), "--example-inputs", inputs, "--shapes", shape, "--store", store,
               "--parity", "always", "--out", str(art_dir), env=env, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"name": name, "class": art, "dir": art_dir, "weights": weights, "progress": progress}


def _selected_models(request) -> list[str]:
    """The models of GENERIC_MODELS that the selected tests of this module build (all, unless -k or node
    ids narrow the run)."""
    mine = (item for item in request.session.items if getattr(item, "module", None) is request.module)
    specs = (getattr(item, "callspec", None) for item in mine)
    chosen = {spec.params["built"] for spec in specs if spec is not None and "built" in spec.params}
    return [name for name in GENERIC_MODELS if name in chosen]


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory, env):
    """{name: _build_model's result, or the exception it raised} for each model a selected test builds, all
    built at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    from omni_compile.models import resolve_model

    names = _selected_models(request)
    roots = {}
    for name in names:  # the directory builds' weights: same architecture, other (seeded) weights
        cls, config, _, _ = GENERIC_MODELS[name]
        roots[name] = tmp_path_factory.mktemp(name)
        model = resolve_model(cls, model_config=config).load(dtype=torch.float32, device="cpu", seed=7)
        model.save_pretrained(roots[name] / "weights")
    results = {}
    with ThreadPoolExecutor(max_workers=max(len(names), 1)) as pool:
        futures = {name: pool.submit(_build_model, name, roots[name], env) for name in names}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as e:  # fails that model's tests only
                results[name] = e
    return results


@pytest.fixture(scope="module", params=list(GENERIC_MODELS))
def built(request, builds):
    """One model of GENERIC_MODELS: {"name", "class": ART, "dir": ART, "weights": DIR, "progress": stderr}."""
    result = builds[request.param]
    if isinstance(result, Exception):
        raise result
    return result


def _manifest(art: Path) -> dict:
    return json.loads((art / "manifest.json").read_text())


def _files(m: dict) -> list[dict]:
    return [e for r in m["regions"] for es in r["buckets"].values() for e in es]


def test_class_build_compiles_every_region_and_records_its_inputs(built):
    cls, config, inputs, shape = GENERIC_MODELS[built["name"]]
    m = _manifest(built["class"])
    assert m["model"]["family"] == "generic" and m["model"]["source"] == cls
    assert m["build"]["example_inputs"] == inputs and m["build"]["dtype"] == "fp32" and m["build"]["seed"] == 0
    assert all(m["model"]["config"][k] == json.loads(json.dumps(v)) for k, v in config.items())
    blocks = [r for r in m["regions"] if r["kind"] == "block"]
    assert blocks and all(len(r["instances"]) >= 1 for r in blocks)
    assert m["compilations"]["aot_compiles"] == len(_files(m)) and m["store"]["published"] == len(_files(m))
    assert m["parity"][shape]["checked"] == "here" and m["parity"][shape]["rel_l2_vs_eager"] < 1e-4


def test_directory_build_reuses_the_class_build(built):
    """Same architecture, other weights: every file from the store, nothing exported or compiled, and parity
    checked here on the directory's weights."""
    a, b = _manifest(built["class"]), _manifest(built["dir"])
    assert b["model"]["source"] == str(built["weights"]) and b["model"]["config"] == a["model"]["config"]
    assert b["compilations"] == {"aot_compiles": 0, "region_exports": 0, "dynamo_graphs": 0}
    assert b["store"]["hits"] == len(_files(b)) == len(_files(a))
    shape = GENERIC_MODELS[built["name"]][3]
    assert b["parity"][shape]["checked"] == "here" and b["parity"][shape]["rel_l2_vs_eager"] < 1e-4


def _clis(*calls: list[str], env: dict) -> list[subprocess.CompletedProcess]:
    """`cli(*args)` for each `args` of `calls`, all at the same time (independent commands; about ten seconds
    each, mostly one core)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda args: cli(*args, env=env), calls))


def test_verify_both_artifacts(built, env):
    """The class artifact re-makes its seeded random weights; the directory artifact takes --weights."""
    shape = GENERIC_MODELS[built["name"]][3]
    calls = (["verify", str(built["class"]), "--json"],
             ["verify", str(built["dir"]), "--weights", str(built["weights"]), "--json"])  # fmt: skip
    for proc in _clis(*calls, env=env):
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(proc.stdout)
        assert res["ok"] and res["compilations"] == 0 and set(res["parity"]) == {shape}, res
        assert any(c.startswith("config matches") for c in res["checks"])


def test_verify_names_what_it_needs(built, env, tmp_path):
    m = _manifest(built["class"])
    m["build"]["example_inputs"] = None
    bare = tmp_path / "no-inputs"
    shutil.copytree(built["class"], bare)
    (bare / "manifest.json").write_text(json.dumps(m))
    no_weights, no_inputs = _clis(["verify", str(built["dir"])], ["verify", str(bare)], env=env)
    assert_user_error(no_weights, "pass them: weights=")
    assert_user_error(no_inputs, "records no example-input function; pass example_inputs=")


LOAD = r"""
import json, sys, torch
import omni_compile
from omni_compile.artifact.loader import _compilations
from omni_compile.config import ShapeBucket
from omni_compile.models import resolve_model
from omni_compile.models.registry import import_object

art, weights, inputs_ref, shape = sys.argv[1:]
model = resolve_model(weights).load(dtype=torch.float32, device="cpu")
inputs = import_object(inputs_ref, "inputs")(model, ShapeBucket.parse(shape), dtype=torch.float32, device="cpu",
                                             text_len=None, seed=3)
with torch.no_grad():
    ref = model(**inputs)[0].clone()
    before = _compilations()
    loaded = omni_compile.load(art, weights=model)
    got = loaded(**inputs)[0]
print("RESULT " + json.dumps({"err": float((got.double() - ref.double()).norm() / ref.double().norm()),
                              "compilations": _compilations() - before,
                              "calls": loaded._omni_artifact.stats["compiled_calls"]}))
"""


def test_fresh_process_loads_the_directory_artifact_with_zero_compilations(built, env):
    _, _, inputs, shape = GENERIC_MODELS[built["name"]]
    proc = subprocess.run([sys.executable, "-P", "-c", LOAD, str(built["dir"]), str(built["weights"]), inputs, shape],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["compilations"] == 0 and res["calls"] > 0 and res["err"] < 1e-4, res


def test_progress_is_readable(built):
    """One line per compiled file with its seconds and matches; no torch FutureWarning or C-shim log lines."""
    n = len(_files(_manifest(built["class"])))
    lines = built["progress"].splitlines()
    assert sum(ln.startswith("> compiling ") for ln in lines) == n
    assert sum(re.match(r"^>\s+compiled in \d+\.\ds: ", ln) is not None for ln in lines) == n, built["progress"]
    assert "LeafSpec" not in built["progress"] and "c-shim" not in built["progress"], built["progress"][-3000:]
