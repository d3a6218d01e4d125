"""Attention backend selection: the contract (explicit fails closed, auto falls back and says why), the
config syntaxes, roles, and the attention pass on the tiny presets."""

import json
import logging

import pytest
import torch

from conftest import rel_l2, require_triton_interpreter
from omni_compile.attention import backends as B
from omni_compile.attention.backends import base, flash_build
from omni_compile.attention.backends import BACKENDS, AttentionCall, preference
from omni_compile.attention.config import AttentionConfig, check_roles, parse_attention_text
from omni_compile.attention.select import AttentionBackendError, check_explicit_choices, resolve
from omni_compile.errors import ConfigError
from omni_compile.platform import Platform


def plat(kind, name="", cap=None):
    return Platform(kind, name, cap, "2.11.0", "3.6.0", "13.0" if kind == "cuda" else None, "6.4" if kind == "rocm" else None)


H200 = plat("cuda", "NVIDIA H200", (9, 0))
A100 = plat("cuda", "NVIDIA A100", (8, 0))
T4 = plat("cuda", "Tesla T4", (7, 5))
B200 = plat("cuda", "NVIDIA B200", (10, 0))
CPU = plat("cpu", "x86_64")
ROCM = plat("rocm", "AMD Instinct MI300X", (9, 4))
XPU = plat("xpu", "Intel Data Center GPU Max")
BF16_128 = AttentionCall(dtype=torch.bfloat16, head_dim=128, q_len=4608, kv_len=4608)
FLASH = ["FA3_ATTN", "FA4_ATTN", "FLASH_ATTN"]  # the FlashAttention backends, in the CUDA preference order


def explicit(name, role="wan.self"):
    return AttentionConfig.from_json({"default": {"backend": name}}), role


@pytest.fixture(autouse=True)
def cudnn_present(monkeypatch):
    """The platforms here are described, not real: take cuDNN as present (this CPU torch build has none)."""
    import dataclasses

    real = BACKENDS["CUDNN_ATTN"]
    monkeypatch.setitem(BACKENDS, "CUDNN_ATTN", dataclasses.replace(real, available=lambda platform: None))
    return real


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setattr(B.FlashBuild, "module", lambda self: None)


@pytest.fixture
def fa2_only(monkeypatch):
    """Only an FA2 build is installed (what `FlashBuild.module` finds is by module)."""
    monkeypatch.setattr(base, "has_module", lambda name: name == "flash_attn")
    monkeypatch.setattr(flash_build, "spec_is_package", lambda name: True)


def reason_of(name, platform, call=BF16_128, role="wan.self"):
    config, role = explicit(name, role)
    with pytest.raises(AttentionBackendError) as e:
        resolve(config, role, platform, call)
    return str(e.value)


# ------------------------------------------------------------------ explicit choices fail closed


@pytest.mark.parametrize(
    "backend,platform,call,why",
    [
        ("CUDNN_ATTN", CPU, BF16_128, "it runs on cuda, not on cpu"),
        ("CUDNN_ATTN", T4, BF16_128, "it needs compute capability 8.0 or newer; Tesla T4 has 7.5"),
        ("CUDNN_ATTN", H200, AttentionCall(torch.bfloat16, 12, 64, 64),
         "head_size=12 is unsupported (cuDNN attention takes head sizes <= 256 that are multiples of 8)"),
        ("CUDNN_ATTN", H200, AttentionCall(torch.float32, 128, 64, 64),
         "dtype float32 is unsupported (CUDNN_ATTN takes bfloat16 or float16)"),
        ("CUDNN_ATTN", H200, AttentionCall(torch.bfloat16, 128, 64, 64, "key_padding"),
         "the call has an attention mask (key-padding) and CUDNN_ATTN takes no attention mask"),
        ("CUDNN_ATTN", H200, AttentionCall(torch.bfloat16, 128, 64, 1),
         "kv_len=1 is unsupported by cuDNN attention"),
        ("TRITON_ATTN", H200, AttentionCall(torch.float16, 300, 64, 64),
         "head_size=300 is unsupported (the Triton kernel takes head sizes 16..256)"),
        ("TRITON_ATTN", H200, AttentionCall(torch.float16, 64, 64, 64, "other"),
         "the call has an attention mask (other) and TRITON_ATTN takes only a key-padding mask"),
        ("TRITON_ATTN", CPU, BF16_128,
         "it runs on cuda/rocm/xpu, not on cpu (or set TRITON_INTERPRET=1 to run it on CPU for testing)"),
        ("SAGE_ATTN", XPU, BF16_128, "it runs on cuda/rocm, not on xpu"),
        ("FLASH_ATTN", T4, BF16_128, "it needs compute capability 8.0 or newer; Tesla T4 has 7.5"),
    ],
)
def test_explicit_unsupported_raises_with_the_failed_requirement(backend, platform, call, why, no_flash, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    msg = reason_of(backend, platform, call)
    assert msg.startswith(
        f"attention backend {backend} was explicitly selected for role 'wan.self' via attention_config.default "
        "but cannot be used: "
    ), msg
    assert why in msg, msg


def test_a_torch_build_without_cudnn_says_so(cudnn_present):
    if torch.backends.cudnn.is_available():
        pytest.skip("this torch build has cuDNN")
    assert cudnn_present.check(H200, BF16_128) == "this torch build has no cuDNN"


def test_explicit_error_names_what_would_work(no_flash):
    msg = reason_of("CUDNN_ATTN", H200, AttentionCall(torch.bfloat16, 12, 64, 64))
    assert msg.endswith("Choose TORCH_SDPA, or auto."), msg
    assert reason_of("CUDNN_ATTN", H200, AttentionCall(torch.bfloat16, 128, 64, 1)).endswith("Choose TORCH_SDPA, or auto.")


def test_flash_attention_builds_per_architecture(fa2_only):
    # FA2 serves Ampere and Hopper; FA3 Hopper only; on Blackwell only FA4 counts, an FA2 build is ignored.
    assert resolve(*explicit("FLASH_ATTN"), A100, BF16_128).backend == "FLASH_ATTN"
    assert B.installed_flash_modules() == {"FLASH_ATTN": "flash_attn", "FA3_ATTN": None, "FA4_ATTN": None}
    assert "FlashAttention-2 serves sm8x and sm90 GPUs, not sm100 (NVIDIA B200)" in reason_of("FLASH_ATTN", B200)
    assert "FlashAttention-3 serves sm90 GPUs, not sm80 (NVIDIA A100)" in reason_of("FA3_ATTN", A100)
    assert "FlashAttention-4 (CuTe DSL) is not installed (pip install flash-attn-4)" in reason_of("FA4_ATTN", B200)
    assert resolve(AttentionConfig(), "flux.joint", B200, BF16_128).backend == "CUDNN_ATTN"


def test_flash_attention_missing_names_the_install(no_flash):
    msg = reason_of("FA3_ATTN", H200)
    assert "FlashAttention-3 is not installed (pip install 'omni-compile[fa3]' (the fa3-fwd wheel" in msg, msg
    assert msg.endswith("Choose CUDNN_ATTN or TORCH_SDPA, or auto."), msg
    assert "FlashAttention-2 is not installed (pip install flash-attn)" in reason_of("FLASH_ATTN", H200)


def test_a_build_that_does_not_import_is_not_capable(monkeypatch, tmp_path):
    """A FlashAttention package that is present but fails to import (FA4 without the CUTLASS DSL's
    libraries, say) is refused with the import error, and auto skips it."""
    (tmp_path / "fa3_fwd_interface.py").write_text("import no_such_cutlass_dsl\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    B.import_error.cache_clear()
    try:
        msg = reason_of("FA3_ATTN", H200)
        assert ("FlashAttention-3 is installed but does not import here (ModuleNotFoundError: No module named "
                "'no_such_cutlass_dsl'); pip install 'omni-compile[fa3]'") in msg, msg
        res = resolve(AttentionConfig(measure=False), "flux.joint", H200, BF16_128)
        assert res.backend == "CUDNN_ATTN" and res.skipped[0][0] == "FA3_ATTN", res
    finally:
        B.import_error.cache_clear()


def test_fa3_fwd_takes_bf16_only(monkeypatch):
    """The fa3-fwd wheel is built without FA3's fp16 kernels; FA3's own hopper build has them."""
    monkeypatch.setattr(base, "has_module", lambda name: name == "fa3_fwd_interface")
    fp16 = AttentionCall(torch.float16, 128, 4608, 4608)
    assert resolve(*explicit("FA3_ATTN"), H200, BF16_128).backend == "FA3_ATTN"
    assert "dtype float16 is unsupported (fa3_fwd_interface takes bfloat16)" in reason_of("FA3_ATTN", H200, fp16)
    res = resolve(AttentionConfig(measure=False), "flux.joint", H200, fp16)
    assert res.backend == "CUDNN_ATTN" and res.skipped[0][0] == "FA3_ATTN", res
    assert resolve(AttentionConfig(measure=False), "flux.joint", H200, BF16_128).backend == "FA3_ATTN"
    monkeypatch.setattr(base, "has_module", lambda name: name == "flash_attn_interface")
    assert resolve(*explicit("FA3_ATTN"), H200, fp16).backend == "FA3_ATTN"
    assert "head_size=300 is unsupported (FlashAttention-3 takes head sizes multiples of 8 from 8 to 256)" in reason_of(
        "FA3_ATTN", H200, AttentionCall(torch.bfloat16, 300, 64, 64))


def test_probe_with_unknown_head_size_skips_the_head_size_check():
    assert BACKENDS["CUDNN_ATTN"].check(H200, AttentionCall(dtype=torch.bfloat16)) is None
    assert BACKENDS["CUDNN_ATTN"].check(H200, AttentionCall(dtype=torch.bfloat16, head_dim=12)) is not None


def test_platform_requirements_fail_before_any_graph(no_flash):
    config = AttentionConfig.from_json({"per_role": {"wan.cross": {"backend": "CUDNN_ATTN"}}})
    with pytest.raises(AttentionBackendError, match="role 'wan.cross' via attention_config.per_role\\['wan.cross'\\]"):
        check_explicit_choices(config, CPU)
    check_explicit_choices(config, H200)  # shape requirements wait for the graph


# ------------------------------------------------------------------ automatic selection falls back


def test_auto_walks_the_preference_list_and_logs_each_skip(no_flash, caplog):
    caplog.set_level(logging.INFO, logger="omni_compile.attention")
    res = resolve(AttentionConfig(), "flux.joint", H200, BF16_128)
    assert res.backend == "CUDNN_ATTN"
    assert [n for n, _ in res.skipped] == ["FA3_ATTN", "FA4_ATTN", "FLASH_ATTN", "TRITON_ATTN"]
    assert dict(res.skipped)["TRITON_ATTN"].startswith("automatic on cuda only for a call with a key bias")
    line = caplog.records[-1].getMessage()
    assert line.startswith("Resolved attention backend 'CUDNN_ATTN' for role='flux.joint' via attention_config.default")
    assert "(skipped FA3_ATTN: FlashAttention-3 is not installed" in line


@pytest.mark.parametrize(
    "call,expected,skips",
    [
        (AttentionCall(torch.bfloat16, 12, 64, 64), "TORCH_SDPA", [*FLASH, "CUDNN_ATTN", "TRITON_ATTN"]),  # no fast one
        (AttentionCall(torch.bfloat16, 128, 64, 1), "TORCH_SDPA", [*FLASH, "CUDNN_ATTN", "TRITON_ATTN"]),  # KV length 1
        (AttentionCall(torch.float32, 128, 64, 64), "TORCH_SDPA", [*FLASH, "CUDNN_ATTN", "TRITON_ATTN"]),
        (AttentionCall(torch.bfloat16, 128, 64, 64, "key_padding"), "TORCH_SDPA",
         [*FLASH, "CUDNN_ATTN", "TRITON_ATTN"]),
        # a key bias: no vendor flash kernel takes one; unmeasured, the Triton kernel ranks above SDPA
        (AttentionCall(torch.bfloat16, 128, 64, 64, "key_bias"), "TRITON_ATTN", [*FLASH, "CUDNN_ATTN"]),
    ],
)
def test_auto_takes_the_first_capable_backend(call, expected, skips, no_flash):
    res = resolve(AttentionConfig(), "wan.self", H200, call)
    assert res.backend == expected and [n for n, _ in res.skipped] == skips


def test_auto_prefers_flash_when_installed(fa2_only):
    assert resolve(AttentionConfig(), "flux.joint", A100, BF16_128).backend == "FLASH_ATTN"


def test_preference_lists_per_platform_never_hold_lossy_backends():
    assert preference(CPU) == ["TORCH_SDPA"] and preference(T4) == ["TORCH_SDPA"]
    assert preference(XPU)[0] == "TRITON_ATTN"
    for p in (H200, A100, B200, CPU, ROCM, XPU, T4):
        order = preference(p)
        assert order[-1] == "TORCH_SDPA" and not any(BACKENDS[n].lossy for n in order)
    assert BACKENDS["SAGE_ATTN"].lossy


# ------------------------------------------------------------------ choice by measurement

W2_SELF = AttentionCall(torch.bfloat16, 128, 32760, 32760, batch=1, heads=12)


def test_auto_takes_the_fastest_measured_backend(monkeypatch, caplog):
    """On a GPU, auto times every capable backend on the call's shape; a dropped one is never chosen."""
    from omni_compile.attention import measure

    monkeypatch.setattr(base, "has_module", lambda name: name == "fa3_fwd_interface")
    seen = []

    def fake(backends, shape):
        seen.append((backends, shape))
        return {"FA3_ATTN": 9.76, "CUDNN_ATTN": 11.58, "TORCH_SDPA": "RuntimeError: no kernel"}

    monkeypatch.setattr(measure, "measure", fake)
    caplog.set_level(logging.INFO, logger="omni_compile.attention")
    res = resolve(AttentionConfig(), "wan.self", H200, W2_SELF, measure=True)
    assert res.backend == "FA3_ATTN" and res.reason == "fastest measured"
    assert seen == [(("FA3_ATTN", "CUDNN_ATTN", "TORCH_SDPA"), measure.Shape(1, 12, 32760, 32760, 128, torch.bfloat16,
                                                                            "cuda"))]  # fmt: skip
    assert res.measured == ("1x32760x12x128 kv 32760 bfloat16", fake(None, None))
    line = caplog.records[-1].getMessage()
    assert ("fastest measured on 1x32760x12x128 kv 32760 bfloat16: FA3_ATTN 9.760 ms, CUDNN_ATTN 11.580 ms, "
            "TORCH_SDPA dropped (RuntimeError: no kernel)") in line, line
    monkeypatch.setattr(measure, "measure", lambda b, s: {"FA3_ATTN": 0.41, "CUDNN_ATTN": 0.40, "TORCH_SDPA": 0.40})
    assert resolve(AttentionConfig(), "flux.joint", H200, W2_SELF, measure=True).backend == "CUDNN_ATTN"  # tie: order
    # measure off, a CPU, an explicit choice or an unknown shape: nothing is timed
    monkeypatch.setattr(measure, "measure", lambda b, s: pytest.fail("timed"))
    assert resolve(AttentionConfig(), "wan.self", H200, W2_SELF, measure=False).backend == "FA3_ATTN"
    assert resolve(AttentionConfig(), "wan.self", CPU, W2_SELF, measure=True).backend == "TORCH_SDPA"
    assert resolve(*explicit("CUDNN_ATTN"), H200, W2_SELF, measure=True).backend == "CUDNN_ATTN"
    assert resolve(AttentionConfig(), "wan.self", H200, BF16_128, measure=True).backend == "FA3_ATTN"


def test_measure_drops_a_backend_whose_output_is_off(monkeypatch):
    """`measure` compares each candidate with TORCH_SDPA first (on the CPU here, with perf_counter timing)."""
    from omni_compile.attention import measure

    real = measure.runner
    monkeypatch.setattr(measure, "runner", lambda name: (lambda q, k, v, s: q * 0) if name == "BROKEN" else real(name))
    times = measure.measure.__wrapped__(("TORCH_SDPA", "BROKEN"), measure.Shape(1, 2, 64, 64, 16, torch.float32, "cpu"))
    assert isinstance(times["TORCH_SDPA"], float) and times["TORCH_SDPA"] > 0
    assert times["BROKEN"] == "output off by rel L2 1.0e+00 against TORCH_SDPA"
    assert measure.fastest(times) == "TORCH_SDPA" and measure.fastest({"A": "failed"}) is None


def test_device_times_run_a_warm_up_then_each_timed_call_once():
    """`device_times_ms` (the build's timer and bench/attention.py's): one warm-up call (it may compile), then `reps`
    timed ones; on the CPU wall time, on a GPU the device time of each call queued behind a spin kernel."""
    from omni_compile.attention import measure

    calls = []
    times = measure.device_times_ms(lambda: calls.append(1), "cpu", 7)
    assert len(calls) == 8 and len(times) == 7 and all(t >= 0 for t in times)


def test_measure_is_part_of_the_config_and_its_hash():
    from omni_compile.config import CompileConfig

    off = AttentionConfig.from_json(parse_attention_text("measure=false,default.backend=auto"))
    assert off.measure is False and AttentionConfig().measure is True
    assert off.to_json()["measure"] is False
    assert CompileConfig(attention={"measure": False}).compute_hash() != CompileConfig().compute_hash()


# ------------------------------------------------------------------ config syntax, roles, env and CLI


def test_per_role_replaces_the_default_and_inherits_nothing():
    config = AttentionConfig.from_json(
        {"default": {"backend": "CUDNN_ATTN"}, "per_role": {"wan.cross": {}}}
    )
    assert config.for_role("wan.self").backend == "CUDNN_ATTN"
    assert config.for_role("wan.cross").backend == "auto"  # its own entry: the default's backend is not inherited
    assert config.for_role("wan.cross").source == "attention_config.per_role['wan.cross']"


def test_dotted_and_json_syntax_agree():
    dotted = parse_attention_text("default.backend=cudnn_attn, per_role.wan.cross.backend=TORCH_SDPA")
    js = parse_attention_text('{"default": {"backend": "CUDNN_ATTN"}, "per_role": {"wan.cross": {"backend": "TORCH_SDPA"}}}')
    assert AttentionConfig.from_json(dotted).to_json() == AttentionConfig.from_json(js).to_json()
    assert AttentionConfig.from_json(dotted).to_json()["per_role"] == {"wan.cross": {"backend": "TORCH_SDPA"}}


@pytest.mark.parametrize(
    "text,error",
    [
        ("default.backend=FLASH", "unknown attention backend 'FLASH'; choose auto or one of TORCH_SDPA, CUDNN_ATTN, "
                                  "FA3_ATTN, FA4_ATTN, FLASH_ATTN, TRITON_ATTN, SAGE_ATTN"),
        ("measure=maybe", "measure takes true or false"),
        ('{"measure": 1}', "attention_config.measure must be true or false, not 1"),
        ('{"default": {"backend": "XLA"}}', "attention_config.default.backend: unknown attention backend 'XLA'"),
        ('{"default": {"backend": "CUDNN_ATTN", "quant": "fp8"}}', "has unknown key(s) ['quant']"),
        ('{"defaults": {}}', "attention config has unknown key(s) ['defaults']"),
        ("per_role.backend=TORCH_SDPA", "names no role"),
        ("wan.cross=TORCH_SDPA", "must look like default.backend=NAME, per_role.ROLE.backend=NAME or measure="),
        ('{"default": ', "attention config is not valid JSON"),
    ],
)
def test_config_errors(text, error):
    with pytest.raises(ConfigError) as e:
        parse_attention_text(text)
    assert error in str(e.value), str(e.value)


def test_env_var_replaces_the_default_backend(monkeypatch):
    monkeypatch.setenv("OMNI_COMPILE_ATTENTION_BACKEND", "cudnn_attn")
    config = AttentionConfig.from_json({"per_role": {"wan.cross": {"backend": "TORCH_SDPA"}}}).with_env()
    assert config.default.backend == "CUDNN_ATTN" and config.default.source == "OMNI_COMPILE_ATTENTION_BACKEND"
    assert config.for_role("wan.cross").backend == "TORCH_SDPA"
    monkeypatch.setenv("OMNI_COMPILE_ATTENTION_BACKEND", "nope")
    with pytest.raises(ConfigError, match="OMNI_COMPILE_ATTENTION_BACKEND: unknown attention backend 'nope'"):
        AttentionConfig().with_env()


def test_unknown_roles_are_errors_listing_the_models_roles():
    from omni_compile.models.registry import ADAPTERS

    wan = ADAPTERS["wan"]
    config = AttentionConfig.from_json({"per_role": {"wan.crosss": {"backend": "TORCH_SDPA"}}})
    with pytest.raises(ConfigError, match=r"unknown role\(s\) \['wan.crosss'\] for wan; its roles are wan.self, wan.cross"):
        check_roles(config, wan.attention_roles, wan.family)
    assert wan.attention_role("attn1") == "wan.self" and wan.attention_role("attn2") == "wan.cross"
    assert ADAPTERS["flux"].attention_role("attn") == "flux.joint"


def test_cli_flag_env_var_and_json_config_agree(subprocess_env, tmp_path):
    """The three spellings of one explicit choice stop the build with the same error, before the model loads."""
    from test_cli import assert_user_error, cli

    why = "attention backend CUDNN_ATTN was explicitly selected for role 'default' via {} but cannot be used: " \
          "it runs on cuda, not on cpu. Choose TORCH_SDPA, or auto."  # fmt: skip
    out = str(tmp_path / "o")
    assert_user_error(cli("build", "--out", out, "--attention-backend", "CUDNN_ATTN", env=subprocess_env),
                      why.format("attention_config.default"))  # fmt: skip
    assert_user_error(cli("build", "--out", out, "--attention", "default.backend=CUDNN_ATTN", env=subprocess_env),
                      why.format("attention_config.default"))  # fmt: skip
    cfg = json.dumps({"attention": {"default": {"backend": "CUDNN_ATTN"}}})
    assert_user_error(cli("build", "--out", out, "--config", cfg, env=subprocess_env), why.format("attention_config.default"))
    env = dict(subprocess_env, OMNI_COMPILE_ATTENTION_BACKEND="CUDNN_ATTN")
    assert_user_error(cli("build", "--out", out, env=env), why.format("OMNI_COMPILE_ATTENTION_BACKEND"))
    assert_user_error(cli("build", "--out", out, "--attention-backend", "FA9", env=subprocess_env),
                      "--attention-backend: unknown attention backend 'FA9'")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_attention_listing(subprocess_env):
    from test_cli import cli

    proc = cli("attention", "--device", "cpu", env=subprocess_env)
    assert proc.returncode == 0, proc.stderr
    assert "automatic order: TORCH_SDPA" in proc.stdout
    assert "CUDNN_ATTN   unavailable: it runs on cuda, not on cpu" in proc.stdout
    assert "SAGE_ATTN" in proc.stdout and "(lossy, explicit only)" in proc.stdout


# ------------------------------------------------------------------ the attention pass on the tiny presets


def _compile_tiny(preset, shape, dtype, config, seed=1):
    return _compile_tiny_on("cpu", preset, shape, dtype, config, seed)


def _compile_tiny_on(device, preset, shape, dtype, config, seed=1):
    import omni_compile
    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model

    spec = resolve_model(preset)
    model = spec.load(dtype=dtype, device=device, seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=dtype, device=device,
                                         text_len=spec.text_len, seed=seed)  # fmt: skip
    with torch.no_grad():
        ref = model(**inputs)[0]
    omni_compile.compile(model, omni_compile.CompileConfig(**config))
    with torch.no_grad():
        out = model(**inputs)[0]
    records = omni_compile.compile_state(model).records
    return records, float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.compile
def test_pass_finds_each_role_and_leaves_sdpa_on_cpu(fresh_dynamo, no_inductor_cache):
    records, err = _compile_tiny("wan-tiny", "64x96x9", torch.float32, {})
    (rec,) = records
    assert rec.passes["attention"] == 0  # both resolved to TORCH_SDPA: torch's nodes stay, nothing rewritten
    assert {role: (r["implementation"], r["count"]) for role, r in rec.attention.items()} == {
        "wan.self": ("TORCH_SDPA", 1),
        "wan.cross": ("TORCH_SDPA", 1),
    }
    assert err < 1e-5
    records, _ = _compile_tiny("wan-tiny", "64x96x9", torch.float32, {"passes": ["-attention"]})
    assert "attention" not in records[0].passes and records[0].attention == {}


@pytest.mark.compile
def test_explicit_triton_attention_per_role_under_the_interpreter(fresh_dynamo, no_inductor_cache):
    """per_role puts Wan's cross-attention on our Triton kernel (the interpreter, bf16) and keeps self-attention
    on SDPA; the compiled model matches eager bf16."""
    require_triton_interpreter()
    config = {"attention": {"per_role": {"wan.cross": {"backend": "TRITON_ATTN"}}}}
    records, err = _compile_tiny("wan-tiny", "64x96x9", torch.bfloat16, config)
    (rec,) = records
    assert {role: r["implementation"] for role, r in rec.attention.items()} == {
        "wan.self": "TORCH_SDPA",
        "wan.cross": "TRITON_ATTN",
    }
    assert err < 2e-2, err


@pytest.mark.compile
def test_explicit_backend_that_cannot_take_the_dtype_stops_the_compile(fresh_dynamo, no_inductor_cache):
    from omni_compile.errors import find_user_error

    require_triton_interpreter()
    with pytest.raises(Exception) as e:
        _compile_tiny("flux-tiny", "64x64", torch.float32, {"attention": {"default": {"backend": "TRITON_ATTN"}}})
    err = find_user_error(e.value)
    assert isinstance(err, AttentionBackendError), e.value
    assert "for role 'flux.joint'" in str(err) and "dtype float32 is unsupported (TRITON_ATTN takes bfloat16 or float16)" in str(err)


def test_attention_config_changes_the_pass_uuid():
    from omni_compile.passes.attention import AttentionPass

    a = AttentionPass(platform=CPU, config=AttentionConfig()).uuid()
    b = AttentionPass(platform=CPU, config=AttentionConfig.from_json({"per_role": {"wan.cross": {"backend": "TORCH_SDPA"}}})).uuid()
    assert a != b and a == AttentionPass(platform=CPU, config=AttentionConfig()).uuid()


# ------------------------------------------------------------------ GPU: every backend that runs here

GPU_SHAPES = {"W1": (1, 4608, 4608, 24, 128), "W2 self": (1, 32760, 32760, 12, 128), "W2 cross": (1, 32760, 512, 12, 128),
              "odd": (2, 1000, 777, 8, 72)}  # fmt: skip
# Relative L2 error against float64 each backend must stay within (bf16 inputs); SAGE_ATTN is lossy.
BOUNDS = {"CUDNN_ATTN": 1e-2, "FA3_ATTN": 1e-2, "FA4_ATTN": 1e-2, "FLASH_ATTN": 1e-2, "TRITON_ATTN": 1e-2,
          "TORCH_SDPA": 1e-2, "SAGE_ATTN": 3e-2, "FA3_FP8_ATTN": 8e-2}  # fmt: skip


def _backend_fn(name):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v, s, pin=None):
        with sdpa_kernel(pin) if pin is not None else torch.no_grad():
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=s).transpose(1, 2)

    if name == "TORCH_SDPA":
        return sdpa
    if name == "CUDNN_ATTN":
        return lambda q, k, v, s: sdpa(q, k, v, s, SDPBackend.CUDNN_ATTENTION)
    if name in B.FLASH_BUILDS or name == "FA3_FP8_ATTN":
        from omni_compile.attention.measure import runner

        return runner(name)
    from omni_compile.attention import sage, triton_attn

    op = triton_attn.attention_triton if name == "TRITON_ATTN" else sage.attention_sage_triton
    return lambda q, k, v, s: op(q, k, v, None, s)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES), ids=list(GPU_SHAPES))
@pytest.mark.parametrize("name", list(BOUNDS))
def test_backends_match_float64_on_cuda(name, shape):
    from omni_compile.platform import current_platform

    B, Sq, Skv, H, D = GPU_SHAPES[shape]
    call = AttentionCall(torch.bfloat16, D, Sq, Skv)
    why = BACKENDS[name].check(current_platform("cuda"), call, explicit=True)
    if why:
        pytest.skip(f"{name}: {why}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for s in (Sq, Skv, Skv))
    scale = D**-0.5
    out = _backend_fn(name)(q, k, v, scale)
    rows = 384
    qd, kd, vd = q[:, :rows].double(), k.double(), v.double()
    ref = torch.einsum("bhqk,bkhd->bqhd", (torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale).softmax(-1), vd)
    assert out.shape == q.shape and out.dtype == q.dtype and out.isfinite().all()
    err = float((out[:, :rows].double() - ref).norm() / ref.norm())
    assert err < BOUNDS[name], f"{name} {shape}: rel L2 {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["CUDNN_ATTN", "TRITON_ATTN", "SAGE_ATTN", "FA3_ATTN", "FA4_ATTN", "FLASH_ATTN",
                                     "FA3_FP8_ATTN"])
def test_attention_pass_on_cuda(backend, fresh_dynamo, no_inductor_cache):
    """flux-tiny and wan-tiny in bf16 on CUDA with each backend explicit: every call routed, output near eager."""
    import omni_compile
    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model
    from omni_compile.platform import current_platform

    why = BACKENDS[backend].check(current_platform("cuda"), AttentionCall(torch.bfloat16, 16), explicit=True)
    if why:
        pytest.skip(f"{backend}: {why}")
    for preset, shape, roles in (("flux-tiny", "128x128", {"flux.joint"}), ("wan-tiny", "64x96x9", {"wan.self", "wan.cross"})):
        torch._dynamo.reset()
        spec = resolve_model(preset)
        model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
        inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.bfloat16, device="cuda",
                                             text_len=spec.text_len, seed=1)  # fmt: skip
        with torch.no_grad():
            ref = model(**inputs)[0]
        omni_compile.compile(model, omni_compile.CompileConfig(attention={"default": {"backend": backend}}))
        with torch.no_grad():
            out = model(**inputs)[0]
        records = omni_compile.compile_state(model).records
        seen = {role: r["implementation"] for rec in records for role, r in rec.attention.items()}
        assert seen == {role: backend for role in roles}, seen
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        assert err < (5e-2 if backend in ("SAGE_ATTN", "FA3_FP8_ATTN") else 2e-2), (preset, backend, err)


@pytest.mark.gpu
def test_measured_choice_on_cuda(fresh_dynamo, no_inductor_cache):
    """auto on the GPU: the pass times the capable backends on each call's shape and runs the fastest."""
    from omni_compile.attention.measure import fastest

    records, err = _compile_tiny_on("cuda", "wan-tiny", "64x96x9", torch.bfloat16, {})
    (rec,) = records
    for role in ("wan.self", "wan.cross"):
        entry = rec.attention[role]
        (times,) = entry["measured"].values()
        assert entry["implementation"] == fastest(times) and "TORCH_SDPA" in times, entry
    assert err < 2e-2


class _SelfAttentionBlock(torch.nn.Module):
    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.heads = heads

    def attend(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(self.attend(q, k, v).transpose(1, 2).reshape(b, s, d)) + x


class _ExplicitAttentionBlock(_SelfAttentionBlock):
    """Attention written out: softmax(q kᵀ / sqrt(d)) v, no SDPA call."""

    def __init__(self, dim=32, heads=2):
        super().__init__(dim, heads)

    def attend(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


@pytest.mark.compile
def test_attention_written_out_is_found_as_an_attention_call(fresh_dynamo, no_inductor_cache):
    """Inductor's own attention patterns (fuse_attention) turn an explicit softmax(QKᵀ)V into SDPA before our
    passes run, so the attention pass routes it like any SDPA call (on a GPU: to the measured backend)."""
    import omni_compile

    model = torch.nn.Sequential(_ExplicitAttentionBlock(), _ExplicitAttentionBlock()).eval()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        ref = model(x)
        omni_compile.compile(model, regions=["_ExplicitAttentionBlock"])
        out = model(x)
    (rec,) = omni_compile.compile_state(model).records
    assert [r["count"] for r in rec.attention.values()] == [1], rec.attention
    assert float((out - ref).norm() / ref.norm()) < 1e-5


# ------------------------------------------------------------------ key-padding masks through FA3's seqused_k


def _fa3_stub_forward(q, k, v, seqused_k=None, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                      v_descale=None, **unused):  # fmt: skip
    """FA3's `_flash_attn_forward` contract, in float64: row b attends to its first seqused_k[b] keys; fp8 operands
    are multiplied by their per-(batch, head) descale factors, and the output is bf16 then."""
    assert not causal and not unused, unused
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    if q.dtype == torch.float8_e4m3fn:  # the fp8 operands times their scales, exactly
        pairs = ((q, q_descale), (k, k_descale), (v, v_descale))
        q, k, v = (t.double() * d.double()[:, None, :, None] for t, d in pairs)
    mask = None
    if seqused_k is not None:
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (k.shape[0],)
        mask = (torch.arange(k.shape[1])[None, :] < seqused_k[:, None].long())[:, None, None, :]
    t = (x.transpose(1, 2).double() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2).to(out_dtype), None


@pytest.fixture
def fa3_stub(monkeypatch):
    """fa3_fwd_interface "installed": a module whose forward is the float64 reference above."""
    import sys
    import types

    stub = types.ModuleType("fa3_fwd_interface")
    stub._flash_attn_forward = _fa3_stub_forward
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", stub)
    monkeypatch.setattr(base, "has_module", lambda name: name == "fa3_fwd_interface")
    from omni_compile.attention.backends import fa3_fp8

    caches = (flash_build.forward, flash_build.seqused_forward, fa3_fp8._fa3_forward)  # each holds the build it found
    for cache in caches:
        cache.cache_clear()
    yield stub
    for cache in caches:
        cache.cache_clear()


def _masked_reference(q, k, v, keep, scale):
    t = (x.transpose(1, 2).double() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=keep[:, None, None, :], scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kind", ["prefix", "scattered", "all kept"])
def test_kept_keys_first_is_the_masked_attention(kind, fa3_stub):
    """Attention does not depend on the order of keys: the kept keys moved first and attended to by count equal the
    masked attention for any key-padding mask, not only text padding at the end (float64 against SDPA's mask)."""
    g = torch.Generator().manual_seed(0)
    B, Sq, Skv, H, D = 3, 11, 37, 2, 8
    q, k, v = (torch.randn(B, s, H, D, generator=g, dtype=torch.float64) for s in (Sq, Skv, Skv))
    keep = {
        "prefix": torch.arange(Skv)[None, :] < torch.tensor([37, 20, 1])[:, None],
        "scattered": torch.rand(B, Skv, generator=g) < 0.6,
        "all kept": torch.ones(B, Skv, dtype=torch.bool),
    }[kind]
    keep[:, 0] |= kind == "scattered"  # every row keeps a key (an empty row is NaN for SDPA)
    k2, v2, used = base.keys_first(k, v, keep)
    assert used.tolist() == keep.sum(1).tolist() and used.dtype == torch.int32
    for b in range(B):  # kept keys first, in their order; the rest after
        n = int(used[b])
        assert torch.equal(k2[b, :n], k[b, keep[b]]) and torch.equal(v2[b, n:], v[b, ~keep[b]])
    out = BACKENDS["FA3_ATTN"].runner()(q, k, v, 0.3, key_mask=keep)
    assert float((out - _masked_reference(q, k, v, keep, 0.3)).abs().max()) < 1e-12


def test_fa3_takes_key_padding_masks_and_no_other(fa3_stub):
    masked = AttentionCall(torch.bfloat16, 128, 4608, 4608, mask="key_padding")
    other = AttentionCall(torch.bfloat16, 128, 4608, 4608, mask="other")
    assert resolve(*explicit("FA3_ATTN"), H200, masked).backend == "FA3_ATTN"
    assert resolve(AttentionConfig(measure=False), "flux.joint", H200, masked).backend == "FA3_ATTN"
    why = "the call has an attention mask (other) and FA3_ATTN takes only a key-padding mask (bool, [B, 1, 1, S_kv])"
    assert why in reason_of("FA3_ATTN", H200, other)
    res = resolve(AttentionConfig(measure=False), "flux.joint", H200, other)
    assert res.backend == "TORCH_SDPA" and ("FA3_ATTN", why) in res.skipped, res.skipped
    # the builds without seqused_k still take no mask
    for name in ("FA4_ATTN", "FLASH_ATTN", "CUDNN_ATTN"):
        assert BACKENDS[name].requirements(H200, masked).endswith(f"and {name} takes no attention mask"), name


def test_masked_calls_are_measured_with_a_mask(fa3_stub, monkeypatch):
    """A key-padding call is timed too (on the CPU here), with a mask that keeps no prefix: a backend that ignored
    the order of kept keys would be off against TORCH_SDPA and dropped."""
    from omni_compile.attention import measure

    shape = measure.Shape(2, 2, 40, 64, 16, torch.bfloat16, "cpu", key_padding=True)
    assert measure.Shape.of(AttentionCall(torch.bfloat16, 16, 40, 64, mask="key_padding", batch=2, heads=2),
                            "cpu") == shape  # fmt: skip
    assert measure.Shape.of(AttentionCall(torch.bfloat16, 16, 40, 64, mask="other", batch=2, heads=2), "cpu") is None
    assert shape.describe() == "2x40x2x16 kv 64 key-padding mask bfloat16"
    assert shape.key_mask().sum().item() == 2 * 56 and not shape.key_mask()[:, 7].any()
    real = measure.runner

    def prefix_only(q, k, v, scale, key_mask=None):  # takes the kept count as a prefix length without moving keys
        op = BACKENDS["FA3_ATTN"].load_seqused()
        return op(q, k, v, key_mask.sum(1, dtype=torch.int32), scale)

    monkeypatch.setattr(measure, "runner", lambda name: prefix_only if name == "PREFIX_ONLY" else real(name))
    times = measure.measure.__wrapped__(("FA3_ATTN", "TORCH_SDPA", "PREFIX_ONLY"), shape)
    assert isinstance(times["FA3_ATTN"], float) and isinstance(times["TORCH_SDPA"], float), times
    assert times["PREFIX_ONLY"].startswith("output off by rel L2"), times


def test_a_key_bias_is_timed_with_one_on_the_triton_kernel(monkeypatch):
    """A call with a key bias is measured with a bias (every 8th key at -10000, random values elsewhere) on the
    Triton kernel (the interpreter here) and SDPA, which agree; on an H200 those are the two candidates."""
    from omni_compile.attention import measure

    require_triton_interpreter()
    call = AttentionCall(torch.bfloat16, 16, 40, 24, mask="key_bias", batch=2, heads=2)
    shape = measure.Shape.of(call, "cpu")
    assert shape == measure.Shape(2, 2, 40, 24, 16, torch.bfloat16, "cpu", key_bias=True)
    assert shape.describe() == "2x40x2x16 kv 24 key bias bfloat16"
    bias = shape.inputs()["key_bias"]
    assert bias.shape == (2, 2, 24) and bias.stride(1) == 0 and (bias[..., 7::8] == -10000).all()
    times = measure.measure.__wrapped__(("TRITON_ATTN", "TORCH_SDPA"), shape)
    assert all(isinstance(t, float) for t in times.values()), times
    seen = []
    monkeypatch.setattr(measure, "measure", lambda b, s: seen.append((b, s)) or {"TRITON_ATTN": 0.02, "TORCH_SDPA": 0.04})
    call = AttentionCall(torch.bfloat16, 64, 6144, 128, mask="key_bias", batch=1, heads=32)
    res = resolve(AttentionConfig(), "generic.attn2", H200, call, measure=True)
    assert res.backend == "TRITON_ATTN" and res.reason == "fastest measured"
    assert seen == [(("TRITON_ATTN", "TORCH_SDPA"), measure.Shape(1, 32, 6144, 128, 64, torch.bfloat16, "cuda",
                                                                  key_bias=True))]  # fmt: skip
    assert res.measured[0] == "1x6144x32x64 kv 128 key bias bfloat16"


def test_key_biases_are_float_masks_the_same_for_every_query():
    """A float mask whose shape is [B or 1, H or 1, 1, S_kv] once padded to 4 dims is a key bias, however it was made
    (diffusers' `(1 - mask) * -10000` repeated per head); a bool mask, a per-query mask or another batch is not."""
    from omni_compile.passes.attention import _bias_rows, _key_bias

    B, H, S = 2, 3, 12
    q, k = torch.empty(B, H, 5, 8), torch.empty(B, H, S, 8)

    def found(fn, *args):
        _, mask = _mask_graph(fn, *args)
        return _key_bias(mask, q, k) is not None

    m = torch.ones(B, S)
    def ltx(m):  # diffusers' LTX-Video: the additive text mask, repeated per head
        return ((1 - m) * -10000.0)[:, None, :].repeat_interleave(H, dim=0).view(B, H, -1, S)

    assert found(ltx, m) and found(lambda m: m[:, None, None, :], m) and found(lambda m: m[0], m)
    assert not found(lambda m: m[:, None, :], m)  # [B, 1, S] aligns B with the heads (SDPA broadcasts from the right)
    assert not found(lambda m: m[:, None, None, :] > 0, m)  # bool: a key-padding mask or nothing
    assert not found(lambda m: m[:, None, None, :].expand(B, H, 5, S) * 1, m)  # per query (a materialized copy)
    assert not found(lambda m: torch.cat([m, m])[:, None, None, :], m)  # 2B rows
    assert not found(lambda m: m[:, None, None, :S - 1], m)  # not every key
    rows = _bias_rows(torch.arange(S, dtype=torch.float32)[None, :], q)
    assert rows.shape == (B, H, S) and rows.stride() == (0, 0, 1) and rows[1, 2, 5] == 5


@pytest.mark.compile
def test_a_key_bias_runs_on_the_triton_kernel_under_the_interpreter(fresh_dynamo, no_inductor_cache):
    """LTX-Video writes its text mask as `(1 - mask) * -10000` and repeats it per head: a key bias. By name, its
    cross-attention runs our Triton kernel with the bias added to the scores (half the text tokens dropped); the
    compiled model matches eager bf16, and the self-attention stays with SDPA."""
    import omni_compile
    from generic_model import LTX_TINY

    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model

    require_triton_interpreter()
    spec = resolve_model("diffusers:LTXVideoTransformer3DModel", example_inputs="generic_model:ltx_inputs",
                         model_config=LTX_TINY)  # fmt: skip
    model = spec.load(dtype=torch.bfloat16, device="cpu", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x96x9"), dtype=torch.bfloat16, device="cpu",
                                         text_len=8, seed=1)  # fmt: skip
    inputs["encoder_attention_mask"][:, 1::2] = 0
    with torch.no_grad():
        ref = model(**inputs)[0]
        inputs["encoder_attention_mask"][:] = 1
        unmasked = model(**inputs)[0]
        inputs["encoder_attention_mask"][:, 1::2] = 0
    omni_compile.compile(model, {"attention": {"per_role": {"generic.attn2": {"backend": "TRITON_ATTN"}}}})
    with torch.no_grad():
        out = model(**inputs)[0]
    (rec,) = omni_compile.compile_state(model).records
    assert {role: (r["implementation"], r["count"]) for role, r in rec.attention.items()} == {
        "generic.attn1": ("TORCH_SDPA", 1),
        "generic.attn2": ("TRITON_ATTN", 1),
    }
    assert rec.passes["attention"] == 1
    assert rel_l2(out, ref) < 2e-2 < rel_l2(unmasked, ref), (rel_l2(out, ref), rel_l2(unmasked, ref))


class _MaskedBlock(torch.nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.heads = heads

    def forward(self, x, keep):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.o(a.transpose(1, 2).reshape(b, s, d)) + x


class _MaskedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_MaskedBlock(), _MaskedBlock()])

    def forward(self, x, keep):
        for block in self.blocks:
            x = block(x, keep)
        return x


@pytest.mark.compile
def test_fa3_runs_masked_attention_in_compiled_regions(fa3_stub, monkeypatch, fresh_dynamo, no_inductor_cache):
    """The pass routes a key-padding-masked SDPA call to FA3's seqused op on a (described) H200: the compiled block
    calls it with the kept keys first; the output matches eager (the stub computes in float64, on the CPU)."""
    import omni_compile
    from omni_compile import compiler

    monkeypatch.setattr(compiler, "current_platform", lambda device: H200)
    calls = []
    monkeypatch.setattr(fa3_stub, "_flash_attn_forward", lambda *a, **kw: calls.append(kw["seqused_k"].tolist())
                        or _fa3_stub_forward(*a, **kw))  # fmt: skip
    torch.manual_seed(0)
    model = _MaskedModel().to(torch.bfloat16).eval()
    x = torch.randn(2, 12, 32, dtype=torch.bfloat16)
    keep = torch.rand(2, 12) < 0.7
    keep[:, 0] = True
    with torch.no_grad():
        ref = model(x, keep)
    config = {"passes": ["none", "+attention"], "attention": {"default": {"backend": "FA3_ATTN"}, "measure": False}}
    omni_compile.compile(model, config)
    with torch.no_grad():
        out = model(x, keep)
    (rec,) = omni_compile.compile_state(model).records
    assert rec.passes["attention"] == 1 and rec.attention["generic.attn"]["implementation"] == "FA3_ATTN", rec.attention
    assert calls == [keep.sum(1).tolist()] * 2  # one call per block, the kept count per row
    assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-2


class _GatheredBlock(torch.nn.Module):
    """Attention over the image tokens and only the text tokens a mask keeps, gathered with nonzero (as
    diffusers' MochiAttnProcessor2_0 does): the sequence length is known only when the graph runs."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x, text, keep):
        kept = text[:, torch.nonzero(keep.flatten(), as_tuple=False).flatten()]
        seq = torch.cat([x, kept], dim=1)
        b, s, d = seq.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(seq).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, s, d))[:, : x.shape[1]] + x


class _GatheredModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_GatheredBlock(), _GatheredBlock()])

    def forward(self, x, text, keep):
        for block in self.blocks:
            x = block(x, text, keep)
        return x


@pytest.mark.compile
def test_attention_over_a_data_dependent_length_is_left_to_torch(fresh_dynamo, no_inductor_cache):
    """An SDPA call whose sequence length comes from nonzero has no length to choose a backend for: the pass leaves
    it to torch with that reason (it raised "size u0 + 32 has no example value" on MochiTransformer3DModel), and the
    compiled model matches eager for another count of kept tokens too."""
    import omni_compile

    torch.manual_seed(0)
    model = _GatheredModel().eval()
    x, text = torch.randn(1, 16, 32), torch.randn(1, 8, 32)
    keep = torch.tensor([[True, True, False, True, False, False, True, False]])
    fewer = keep.clone()
    fewer[0, 0] = False
    with torch.no_grad():
        refs = [model(x, text, keep), model(x, text, fewer)]
    omni_compile.compile(model, {"passes": ["none", "+attention"]})
    with torch.no_grad():
        outs = [model(x, text, keep), model(x, text, fewer)]
    (rec,) = omni_compile.compile_state(model).records
    assert rec.passes["attention"] == 0
    assert rec.attention["generic.attn"]["implementation"] == "TORCH_SDPA", rec.attention
    assert "depends on the data" in json.dumps(rec.attention), rec.attention
    assert [rel_l2(o, r) < 1e-5 for o, r in zip(outs, refs, strict=True)] == [True, True]


def _mask_graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*args)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return gm, out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]


def test_key_padding_masks_are_found_in_the_forms_torch_leaves_them():
    """A key-padding mask reaches the attention node as a bool, as `where(keep, 0, -inf)` (the CPU decomposition),
    as `where(~keep, -inf, 0)` padded on the right and sliced back and broadcast (the efficient kernel's path), or
    with -65504 for -inf (the cuDNN path);
    anything that is not per key (a finite bias, a per-query mask, a shifted slice) is not one."""
    from omni_compile.passes.attention import _key_padding

    B, S = 2, 12
    q, k = torch.empty(B, 2, 5, 8), torch.empty(B, 2, S, 8)
    keep = torch.ones(B, S, dtype=torch.bool)
    neg = float("-inf")

    def found(fn, *args):
        gm, mask = _mask_graph(fn, *args)
        hit = _key_padding(mask, q, k)
        return None if hit is None else (hit[0].name, hit[1])

    assert found(lambda m: m[:, None, None, :], keep) == ("unsqueeze_1", False)
    assert found(lambda m: torch.where(m[:, None, None, :], 0.0, neg), keep) == ("unsqueeze_1", False)

    def efficient_path(m):
        bias = torch.where(m[:, None, None, :].logical_not(), neg, 0.0)  # as torch converts a bool mask
        return torch.nn.functional.pad(bias, (0, 4))[..., :S].expand(B, 2, 5, S)

    assert found(efficient_path, keep) == ("unsqueeze_1", False)  # through logical_not: kept where it is True
    assert found(lambda m: torch.where(m[:, None, None, :], neg, 0.0), keep) == ("unsqueeze_1", True)
    assert found(lambda m: torch.where(m[:, None, None, :], 0.0, -1e4), keep) is None  # finite: a bias
    # torch's cuDNN path (CUDA, torch 2.11): -65504 for False, the scalar 0 on the CPU; finfo.min as models write it
    cudnn_path = lambda m: torch.where(m[:, None, None, :].logical_not(), -65504.0, torch.scalar_tensor(0.0))  # noqa: E731
    assert found(cudnn_path, keep) == ("unsqueeze_1", False)
    min_fill = torch.finfo(torch.bfloat16).min
    assert found(lambda m: torch.where(m[:, None, None, :], 0.0, min_fill), keep) == ("unsqueeze_1", False)
    assert found(lambda m: torch.where(m[:, None, None, :], 0.0, -65000.0), keep) is None  # above: a bias
    per_query = torch.ones(B, 1, 5, S, dtype=torch.bool)
    assert found(lambda m: torch.where(m, 0.0, neg), per_query) is None
    assert found(lambda m: m, per_query) is None
    shifted = torch.ones(B, S + 4, dtype=torch.bool)
    assert found(lambda m: torch.where(m[:, None, None, :], 0.0, neg)[..., 4:], shifted) is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["prefix", "scattered"])
def test_fa3_key_padding_matches_float64_on_cuda(kind):
    """FA3 through seqused_k with the kept keys first, against float64 masked attention (HunyuanVideo-like rows:
    image tokens and a padded text tail; and a mask that keeps no prefix)."""
    from omni_compile.platform import current_platform

    B, Sq, Skv, H, D = 2, 1500, 1756, 8, 128
    call = AttentionCall(torch.bfloat16, D, Sq, Skv, mask="key_padding")
    why = BACKENDS["FA3_ATTN"].check(current_platform("cuda"), call, explicit=True)
    if why:
        pytest.skip(f"FA3_ATTN: {why}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for s in (Sq, Skv, Skv))
    if kind == "prefix":
        keep = torch.arange(Skv, device="cuda")[None, :] < torch.tensor([Skv, 1500 + 17], device="cuda")[:, None]
    else:
        keep = torch.rand(B, Skv, device="cuda", generator=g) < 0.5
    out = BACKENDS["FA3_ATTN"].runner()(q, k, v, D**-0.5, key_mask=keep)
    rows = 384
    ref = _masked_reference(q[:, :rows].cpu(), k.cpu(), v.cpu(), keep.cpu(), D**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype and out.isfinite().all()
    err = float((out[:, :rows].double().cpu() - ref).norm() / ref.norm())
    assert err < 1e-2, f"{kind}: rel L2 {err:.2e}"


@pytest.mark.gpu
def test_fa3_masked_attention_compiled_on_cuda(fresh_dynamo, no_inductor_cache):
    """The masked block on CUDA with FA3 explicit: routed through the seqused op, near eager; and with auto the
    masked call is timed with its mask."""
    import omni_compile
    from omni_compile.platform import current_platform

    call = AttentionCall(torch.bfloat16, 16, 12, 12, mask="key_padding")
    why = BACKENDS["FA3_ATTN"].check(current_platform("cuda"), call, explicit=True)
    if why:
        pytest.skip(f"FA3_ATTN: {why}")
    for attention in ({"default": {"backend": "FA3_ATTN"}}, {}):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _MaskedModel().to("cuda", torch.bfloat16).eval()
        x = torch.randn(2, 300, 32, device="cuda", dtype=torch.bfloat16)
        keep = torch.rand(2, 300, device="cuda") < 0.7
        with torch.no_grad():
            ref = model(x, keep)
        omni_compile.compile(model, {"attention": attention})
        with torch.no_grad():
            out = model(x, keep)
        (rec,) = omni_compile.compile_state(model).records
        entry = rec.attention["generic.attn"]
        if attention:
            assert entry["implementation"] == "FA3_ATTN", entry
        else:
            (times,) = entry["measured"].values()
            assert set(times) >= {"FA3_ATTN", "TORCH_SDPA"} and isinstance(times["FA3_ATTN"], float), entry
        assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 2e-2
        omni_compile.uncompile(model)


@pytest.mark.gpu
def test_key_bias_compiled_on_cuda(fresh_dynamo, no_inductor_cache):
    """Tiny LTX-Video on CUDA with half its text tokens dropped (a key bias in the cross-attention): with
    TRITON_ATTN by name the kernel adds the bias; with auto, TRITON_ATTN and SDPA are timed with a bias and the
    faster runs. Both near eager bf16 (which the unmasked output is not)."""
    import omni_compile
    from generic_model import LTX_TINY

    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = resolve_model("diffusers:LTXVideoTransformer3DModel", example_inputs="generic_model:ltx_inputs",
                         model_config=LTX_TINY)  # fmt: skip
    for attention in ({"per_role": {"generic.attn2": {"backend": "TRITON_ATTN"}}}, {}):
        torch._dynamo.reset()
        model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
        inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("128x128x9"), dtype=torch.bfloat16,
                                             device="cuda", text_len=40, seed=1)  # fmt: skip
        with torch.no_grad():
            unmasked = model(**inputs)[0]
            inputs["encoder_attention_mask"][:, 1::2] = 0
            ref = model(**inputs)[0]
        omni_compile.compile(model, {"attention": attention})
        with torch.no_grad():
            out = model(**inputs)[0]
        (rec,) = omni_compile.compile_state(model).records
        entry = rec.attention["generic.attn2"]
        if attention:
            assert entry["implementation"] == "TRITON_ATTN", entry
        else:
            (times,) = entry["measured"].values()
            assert set(times) == {"TRITON_ATTN", "TORCH_SDPA"} and all(isinstance(t, float) for t in times.values()), entry
            assert "key bias" in next(iter(entry["measured"])), entry
        assert rel_l2(out, ref) < 2e-2 < rel_l2(unmasked, ref), (rel_l2(out, ref), rel_l2(unmasked, ref))
        omni_compile.uncompile(model)



def test_fa3_fp8_attention_against_float64(fa3_stub):
    """FA3's fp8 path with per-head scales: within the fp8 bound of float64 attention; K's smoothing (its mean over
    the sequence taken out, which softmax ignores) keeps that bound when K has a large common offset, where
    quantizing K as it is loses the differences between keys."""
    from omni_compile.attention.backends import fa3_fp8

    g = torch.Generator().manual_seed(0)
    B, Sq, Skv, H, D = 2, 64, 96, 2, 64
    q, k, v = (torch.randn(B, s, H, D, generator=g).to(torch.bfloat16) for s in (Sq, Skv, Skv))
    k_offset = (k.float() + 8 * torch.randn(1, 1, H, D, generator=g)).to(torch.bfloat16)  # a bias shared by keys
    scale = D**-0.5

    def err(kk, smooth):
        out = fa3_fp8.fp8_attention(_fa3_stub_forward, q, kk, v, scale, smooth_k=smooth)
        ref = _masked_reference(q.double(), kk.double(), v.double(), torch.ones(B, Skv, dtype=torch.bool), scale)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        return rel_l2(out.double(), ref)

    plain, smoothed = err(k, True), err(k_offset, True)
    assert 5e-3 < plain < 6e-2 and 5e-3 < smoothed < 6e-2, (plain, smoothed)  # e4m3 keeps 3 mantissa bits
    assert err(k_offset, False) > 3 * smoothed  # without the smoothing the offset eats K's fp8 precision
    out = BACKENDS["FA3_FP8_ATTN"].runner()(q, k, v, scale)  # the op, as the compiled graph calls it
    assert torch.equal(out, fa3_fp8.fp8_attention(_fa3_stub_forward, q, k, v, scale))


@pytest.mark.compile
def test_fa3_fp8_in_compiled_regions(fa3_stub, monkeypatch, fresh_dynamo, no_inductor_cache):
    """FA3_FP8_ATTN by name on a (described) H200: the quantization is part of the region (FA3's kernel gets e4m3
    operands and [B, H] descales), and the compiled blocks compute what the eager fp8 attention does."""
    import omni_compile
    from omni_compile import compiler
    from omni_compile.attention.backends import fa3_fp8

    monkeypatch.setattr(compiler, "current_platform", lambda device: H200)
    seen = []
    monkeypatch.setattr(fa3_stub, "_flash_attn_forward", lambda *a, **kw: seen.append((a[0].dtype, tuple(
        kw["k_descale"].shape))) or _fa3_stub_forward(*a, **kw))  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SelfAttentionBlock(), _SelfAttentionBlock()).to(torch.bfloat16).eval()
    x = torch.randn(2, 40, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        exact = model(x)
        expected = x
        for block in model:  # eager, the same blocks with fp8 attention
            b, s, d = expected.shape
            q, k, v = (p(expected).view(b, s, 2, -1) for p in (block.q, block.k, block.v))
            a = fa3_fp8.fp8_attention(_fa3_stub_forward, q, k, v, 64**-0.5)
            expected = block.o(a.reshape(b, s, d)) + expected
    seen.clear()
    config = {"passes": ["none", "+attention"], "attention": {"default": {"backend": "FA3_FP8_ATTN"}}}
    omni_compile.compile(model, config, regions=["_SelfAttentionBlock"])
    with torch.no_grad():
        out = model(x)
    (rec,) = omni_compile.compile_state(model).records
    (entry,) = rec.attention.values()
    assert rec.passes["attention"] == 1 and entry["implementation"] == "FA3_FP8_ATTN", rec.attention
    assert seen == [(torch.float8_e4m3fn, (2, 2))] * 2  # one kernel call per block, quantized in the region
    assert rel_l2(out.double(), expected.double()) < 2e-2  # Inductor's fused quantization rounds a little apart
    assert 1e-3 < rel_l2(out.double(), exact.double()) < 6e-2  # and the fp8 cost stays in its bound


def test_fa3_fp8_is_by_name_only(fa3_stub):
    assert resolve(AttentionConfig(measure=False), "flux.joint", H200, BF16_128).backend == "FA3_ATTN"
    assert resolve(*explicit("FA3_FP8_ATTN"), H200, BF16_128).backend == "FA3_FP8_ATTN"
    assert "FA3_FP8_ATTN" not in preference(H200)
    for call, why in ((AttentionCall(torch.bfloat16, 80, 64, 64), "head_size=80 is unsupported (FA3's fp8 kernels "
                                                                  "take 64, 96, 128, 192, 256)"),
                      (AttentionCall(torch.float16, 128, 64, 64), "dtype float16 is unsupported"),
                      (AttentionCall(torch.bfloat16, 128, 64, 64, mask="key_padding"), "takes no attention mask")):  # fmt: skip
        assert why in reason_of("FA3_FP8_ATTN", H200, call)
    assert "it runs on cuda, not on cpu" in reason_of("FA3_FP8_ATTN", CPU, BF16_128)
