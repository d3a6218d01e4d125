"""The `omni-compile` command in subprocesses: errors, a real build, and a warm start from its output."""

import json
import subprocess
import sys

import pytest

from conftest import BackgroundRun, selected, with_tests_dir_on_path


def cli(*args, env, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-P", "-m", "omni_compile.cli", *args],
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
        (["build", "--regions", "Block,2x"], "argument --regions: expected block class names like"),
        (["build", "--model-config", '{"num_layerz": 1}'], "FluxTransformer2DModel takes no config key(s) 'num_layerz'"),
        (["build", "diffusers:LTXVideoTransformer3DModel", "--model-config", '{"heads": 2}'],
         "LTXVideoTransformer3DModel takes no config key(s) 'heads'; its keys are"),
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
    assert "qk_norm_rope       on" in proc.stdout and "gated_residual     off" in proc.stdout
    assert "rms_norm_rope      native everywhere; triton on cuda/rocm (auto on cuda)" in proc.stdout
    assert "gated_residual     native everywhere; triton on cuda/rocm (opt-in)" in proc.stdout


@pytest.mark.compile
def test_build_then_warm_start(flux_jit_build, subprocess_env, tmp_path):
    cold_out, warm_out = flux_jit_build.path, tmp_path / "warm"
    progress = flux_jit_build.stderr
    assert "compiled FluxTransformerBlock" in progress and "wrote" in progress  # progress and summary
    report = flux_jit_build.report
    assert report["compilations"]["region_compiles"] == 2 and report["compilations"]["cache_hits"] == 0
    assert report["compilations"]["dynamo_graphs"] == 2 and report["compilations"]["aot_compiles"] == 0
    # Default passes (docs/passes.md): qk_norm_rope takes the 6 q/k norms into its 4 rms_norm_rope calls;
    # the attention pass resolves the one SDPA of each region (flux.joint) to TORCH_SDPA, which keeps torch's
    # node: a resolution in the report, not a match (a match is a rewrite).
    matches = {"complex_mul": 0, "rms_norm": 6, "qk_norm_rope": 4, "adaln": 5, "attention": 0, "lower_fused_ops": 9}
    assert report["passes"]["matches"] == matches
    assert [r["name"] for r in report["regions"]] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    # the compiled forward of each bucket against eager's (the artifact build's bound)
    parity = report["parity"]["buckets"]["64x64"]
    assert parity["finite"] and parity["output_shape"] == [1, 16, 16] and parity["rel_l2_vs_eager"] < 1e-4
    assert report["buckets"] == [{"bucket": "64x64", "first_call_seconds": report["buckets"][0]["first_call_seconds"],
                                  "region_compiles": 2}]  # fmt: skip
    implementations = report["fused_op_implementations"]
    assert {op: r["implementation"] for op, r in implementations.items()} == {"rms_norm_rope": "native",
                                                                              "adaln": "native"}  # fmt: skip
    assert {op: r["count"] for op, r in implementations.items()} == {"rms_norm_rope": 4, "adaln": 5}
    assert "not on cpu" in implementations["adaln"]["reason"]
    bundle = report["compiler"]["cache_bundle"]
    assert report["compiler"]["name"] == "inductor-jit" and report["compiler"]["warm_start"] is None
    assert (cold_out / "inductor_cache.bin").stat().st_size == bundle["bytes"] > 0

    # A second process with an empty Inductor cache directory warm-starts from the bundle.
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache-b"))
    proc = cli(
        "build",
        "flux-tiny",
        "--mode",
        "jit",
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
    assert warm["compilations"]["region_compiles"] == 2 and warm["compilations"]["cache_hits"] == 2
    warm_start = warm["compiler"]["warm_start"]
    assert warm_start["bytes"] == bundle["bytes"] and warm_start["pass_logs"] == 2
    # Cache hits skip the passes; the report still says what they matched (seeded from the cold report).
    assert warm["passes"]["matches"] == matches
    assert warm["fused_op_implementations"] == implementations
    assert warm["attention"]["per_role"] == report["attention"]["per_role"]
    assert [c["passes"] for r in warm["regions"] for c in r["compiles"]] == [
        c["passes"] for r in report["regions"] for c in r["compiles"]
    ]
    assert [c["graph_hash"] for r in warm["regions"] for c in r["compiles"]] == [
        c["graph_hash"] for r in report["regions"] for c in r["compiles"]
    ]


def _generic_env(subprocess_env):
    return with_tests_dir_on_path(subprocess_env)


def _generic_build(out) -> list[str]:
    return [
        "build",
        "diffusers:LTXVideoTransformer3DModel",
        "--mode",
        "jit",
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
        str(out),
        "--json",
        "-q",
    ]


@pytest.fixture(scope="module", autouse=True)
def generic_build(request, tmp_path_factory, subprocess_env):
    """The BackgroundRun of test_build_generic_model's build, started with this module's first test so that it
    runs beside the others (None when that test is not selected)."""
    if not selected(request, "test_build_generic_model"):
        yield None
        return
    root = tmp_path_factory.mktemp("generic")
    run = BackgroundRun([sys.executable, "-P", "-m", "omni_compile.cli", *_generic_build(root / "ltx")],
                        _generic_env(subprocess_env), root / "log")  # fmt: skip
    yield run
    run.stop()


@pytest.mark.compile
def test_build_generic_model(subprocess_env, generic_build):
    env = _generic_env(subprocess_env)
    missing = cli(*_generic_build("unused")[:4], "--shapes", "64x64x9", "--dtype", "fp32", "--device", "cpu", env=env)
    assert_user_error(missing, "--example-inputs module:function")
    proc = generic_build.result()
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"]["family"] == "generic" and report["compilations"]["region_compiles"] == 1
    assert report["passes"]["matches"]["rms_norm"] == 6


def test_required_kernel_missing_on_cpu_is_a_clear_error(subprocess_env, tmp_path):
    env = {k: v for k, v in subprocess_env.items() if k != "TRITON_INTERPRET"}
    proc = cli("build", "flux-tiny", "--kernels", "rms_norm_rope=triton", "--out", str(tmp_path / "o"), env=env)
    assert_user_error(
        proc,
        "the triton kernel for rms_norm_rope was requested but cannot be used: the triton kernel runs on "
        "cuda/rocm, not on cpu (or set TRITON_INTERPRET=1 to run it on CPU for testing)",
    )
    assert not (tmp_path / "o").exists()
    assert_user_error(cli("build", "--kernels", "rms_norm=cuda", env=env), "kernel choice rms_norm='cuda' is not valid")
    assert_user_error(cli("build", "--kernels", "nope=triton", env=env), "kernel choice for unknown fused op 'nope'")


def test_help_imports_no_torch(subprocess_env):
    """`omni-compile --help` and every command's `--help` build the parser without importing torch, diffusers or
    FastAPI (issue 22: help under a second; what is imported, not a timing)."""
    code = (
        "import sys\n"
        "from omni_compile.cli import main\n"
        "for argv in (['--help'], ['build', '--help'], ['serve', '--help'], ['inspect', '--help'], ['cache', '--help'],"
        " ['verify', '--help'], ['pipeline', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "heavy = sorted(m for m in ('torch', 'diffusers', 'fastapi', 'transformers') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=subprocess_env, capture_output=True, text=True,
                          check=False, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stderr, proc.stderr[-2000:]
