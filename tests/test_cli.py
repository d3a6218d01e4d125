"""The `omni-compile` command in subprocesses: errors, a real build, and a warm start from its output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def cli(*args, env, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "omni_compile.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_user_error(proc, message):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("omni-compile: error: ") and message in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["build", "flux-huge"], "unknown model 'flux-huge'"),
        (["build", "--shapes", "64by64"], "malformed shape '64by64'"),
        (["build", "--shapes", "64x64x5"], "FLUX takes images"),
        (["build", "--passes=-nope"], "unknown pass 'nope'"),
        (["build", "--dtype", "int3"], "unknown dtype 'int3'"),
        (["build", "--config", '{"fullgraf": true}'], "unknown CompileConfig key(s) ['fullgraf']"),
        (["build", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_arguments(args, message, subprocess_env, tmp_path):
    assert_user_error(cli(*args, "--out", str(tmp_path / "o"), env=subprocess_env), message)


def test_directory_without_config(subprocess_env, tmp_path):
    (tmp_path / "model").mkdir()
    assert_user_error(cli("build", str(tmp_path / "model"), env=subprocess_env), "has no config.json")


def test_existing_output_needs_force(subprocess_env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert_user_error(cli("build", "--out", str(out), env=subprocess_env), "exists and is not empty; pass --force")
    assert (out / "keep.txt").read_text() == "precious"


def test_models_and_passes_lists(subprocess_env):
    proc = cli("models", env=subprocess_env)
    assert proc.returncode == 0 and all(n in proc.stdout for n in ("flux-dev", "flux-tiny", "wan-1.3b", "wan-tiny"))
    proc = cli("passes", env=subprocess_env)
    assert proc.returncode == 0 and "rms_norm" in proc.stdout and "lower_fused_ops" in proc.stdout


@pytest.mark.compile
def test_build_then_warm_start(subprocess_env, tmp_path):
    cold_out, warm_out = tmp_path / "cold", tmp_path / "warm"
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache-a"))
    proc = cli("build", "flux-tiny", "--shapes", "64x64", "--out", str(cold_out), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "compiled FluxTransformerBlock" in proc.stderr and "wrote" in proc.stderr  # progress and summary
    report = json.loads((cold_out / "build_report.json").read_text())
    assert report["totals"]["region_compiles"] == 2 and report["totals"]["cache_hits"] == 0
    assert report["passes"]["matches"] == {"rms_norm": 6, "lower_fused_ops": 6}
    assert [r["name"] for r in report["regions"]] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert report["buckets"][0]["output_finite"] and report["buckets"][0]["output_shape"] == [1, 16, 16]
    assert report["fused_op_implementations"]["rms_norm"]["implementation"] == "native"
    assert (cold_out / "inductor_cache.bin").stat().st_size == report["cache_bundle"]["bytes"] > 0
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []

    # A second process with an empty Inductor cache directory warm-starts from the bundle.
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache-b"))
    proc = cli(
        "build",
        "flux-tiny",
        "--shapes",
        "64x64",
        "--out",
        str(warm_out),
        "--cache-from",
        str(cold_out),
        "--json",
        "-q",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    warm = json.loads(proc.stdout)
    assert warm["totals"]["region_compiles"] == 2 and warm["totals"]["cache_hits"] == 2
    assert warm["warm_start"]["bytes"] == report["cache_bundle"]["bytes"]
    assert [c["graph_hash"] for r in warm["regions"] for c in r["compiles"]] == [
        c["graph_hash"] for r in report["regions"] for c in r["compiles"]
    ]


@pytest.mark.compile
def test_build_generic_model(subprocess_env, tmp_path):
    env = dict(subprocess_env, PYTHONPATH=os.pathsep.join([str(TESTS), subprocess_env.get("PYTHONPATH", "")]))
    args = [
        "build",
        "diffusers:LTXVideoTransformer3DModel",
        "--example-inputs",
        "generic_model:ltx_inputs",
        "--model-config",
        json.dumps(__import__("generic_model").LTX_TINY),
        "--shapes",
        "64x64x9",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "ltx"),
        "--json",
        "-q",
    ]
    missing = cli(*args[:2], "--shapes", "64x64x9", "--dtype", "fp32", "--device", "cpu", env=env)
    assert_user_error(missing, "--example-inputs module:function")
    proc = cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"]["family"] == "generic" and report["totals"]["region_compiles"] == 1
    assert report["passes"]["matches"]["rms_norm"] == 6
