"""Prebuilt artifacts on a CUDA GPU (the default format there, Inductor standalone files): our Triton
kernels and the attention backend survive the ahead-of-time compile, the load compiles nothing (no Dynamo
graph, no Inductor graph), and CUDA graphs (one per bucket) replay the same outputs. Skipped without a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_cli import cli

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

SHAPES = "64x64,64x128"


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory, subprocess_env):
    root = tmp_path_factory.mktemp("cuda-artifact")
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    proc = cli("build", "flux-tiny", "--shapes", SHAPES, "--dtype", "bf16", "--device", "cuda", "--out",
               str(root / "art"), env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "art"


def test_cuda_manifest_has_triton_kernels_and_a_gpu_attention_backend(cuda_artifact):
    m = json.loads((cuda_artifact / "manifest.json").read_text())
    assert m["platform"]["kind"] == "cuda" and m["build"]["dtype"] == "bf16"
    impls = m["fusion"]["fused_op_implementations"]
    assert impls and all(v["implementation"].startswith("triton") for v in impls.values()), impls
    role = m["attention"]["per_role"]["flux.joint"]
    assert role["implementation"] in ("CUDNN_ATTN", "FA3_ATTN", "FA4_ATTN", "FLASH_ATTN", "TORCH_SDPA"), role
    assert m["attention"]["backends"] == [role["implementation"]]
    # auto on a GPU measured the capable backends per shape (two buckets) and took the fastest
    assert len(role["measured"]) == 2 and "fastest measured" in role["reason"], role
    assert all(p["finite"] and p["rel_l2_vs_eager"] < 3e-2 for p in m["parity"].values()), m["parity"]


LOAD_SCRIPT = r"""
import json, sys, torch
import omni_compile
from torch._dynamo.utils import counters
from omni_compile.artifact.loader import _compilations
from omni_compile.config import ShapeBucket
from omni_compile.models import resolve_model

path, graphs = sys.argv[1], sys.argv[2] == "1"
spec = resolve_model("flux-tiny")
model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
refs = {}
with torch.no_grad():
    for b in json.loads(open(path + "/manifest.json").read())["build"]["buckets"]:
        inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(b), dtype=torch.bfloat16, device="cuda",
                                             text_len=spec.text_len, seed=1)
        refs[b] = (inputs, model(**inputs)[0].float())
counters.clear()
loaded = omni_compile.load(path, weights=model, device="cuda", cuda_graphs=graphs)
errs, again = {}, {}
with torch.no_grad():
    for b, (inputs, ref) in refs.items():
        out = loaded(**inputs)[0].float()
        errs[b] = float((out - ref).norm() / ref.norm())
    for b, (inputs, ref) in refs.items():  # a second call per bucket: a replay on the same inputs
        first = loaded(**inputs)[0].clone()
        second = loaded(**inputs)[0]
        again[b] = bool(torch.equal(first, second))
art = loaded._omni_artifact
print("RESULT " + json.dumps({
    "errs": errs, "again": again, "compilations": _compilations(),
    "dynamo_stats": dict(counters["stats"]), "inductor": dict(counters["inductor"]),
    "regions_compiled": omni_compile.counters.regions_compiled, "stats": art.stats,
    "graphs": None if art.cuda_graphs is None else dict(art.cuda_graphs.stats, graphs=art.cuda_graphs.graphs),
}))
"""


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "no-cuda-graphs"])
def test_cuda_artifact_loads_with_zero_compilations(cuda_artifact, subprocess_env, graphs):
    proc = subprocess.run([sys.executable, "-P", "-c", LOAD_SCRIPT, str(cuda_artifact), "1" if graphs else "0"],
                          env=subprocess_env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["compilations"] == 0 and res["regions_compiled"] == 0 and not res["dynamo_stats"], res
    m = json.loads((cuda_artifact / "manifest.json").read_text())
    assert m["build"]["format"] == "inductor-standalone"
    # every graph comes from its file (an FX-cache hit)
    assert res["inductor"].get("fxgraph_cache_hit") == len({e["file"] for r in m["regions"] for es in r["buckets"].values()
                                                           for e in es}), res  # fmt: skip
    assert set(res["errs"]) == set(SHAPES.split(",")) and all(e < 3e-2 for e in res["errs"].values()), res
    assert all(res["again"].values()), res
    if graphs:
        # one graph per bucket, captured on the bucket's first call; the other four calls replay
        assert res["graphs"]["graphs"] == 2 and res["graphs"]["captures"] == 2, res
        assert res["graphs"]["replays"] == 4, res
    else:
        assert res["graphs"] is None and res["stats"]["compiled_calls"] > 0


def test_cuda_verify_cli(cuda_artifact, subprocess_env):
    proc = cli("verify", str(cuda_artifact), "--json", env=subprocess_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["ok"] and res["compilations"] == 0, res


def test_cuda_artifact_refused_on_cpu(cuda_artifact, subprocess_env):
    """The same artifact asked to run on the CPU: a platform difference, refused with the list."""
    proc = cli("verify", str(cuda_artifact), "--device", "cpu", env=subprocess_env, timeout=300)
    assert proc.returncode == 2 and "device kind" in proc.stderr, proc.stderr[-2000:]


def test_fa3_artifact_calls_fa3_and_loads_with_zero_compilations(tmp_path, subprocess_env):
    """FA3_ATTN inside the standalone files: the manifest records it, a fresh process loads and runs it."""
    import torch

    from omni_compile.attention.backends import BACKENDS, AttentionCall
    from omni_compile.platform import current_platform

    why = BACKENDS["FA3_ATTN"].check(current_platform("cuda"), AttentionCall(torch.bfloat16, 16), explicit=True)
    if why:
        pytest.skip(f"FA3_ATTN: {why}")
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    art = tmp_path / "art"
    proc = cli("build", "flux-tiny", "--shapes", "64x64", "--dtype", "bf16", "--device", "cuda", "--attention-backend",
               "FA3_ATTN", "--out", str(art), env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads((art / "manifest.json").read_text())
    assert m["attention"]["backends"] == ["FA3_ATTN"], m["attention"]
    code = "\n".join(p.read_text() for p in (art / "report").rglob("*.py"))
    assert "attention_fa3" in code, "no generated code calls omni_compile::attention_fa3"
    proc = subprocess.run([sys.executable, "-P", "-c", LOAD_SCRIPT, str(art), "1"], env=subprocess_env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["compilations"] == 0 and all(e < 3e-2 for e in res["errs"].values()), res
