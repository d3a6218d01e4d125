"""Unit tests: shape buckets, typed config, pass switches. No compilation."""

import pytest
import torch

from omni_compile.config import CompileConfig, ShapeBucket, parse_dtype
from omni_compile.errors import ConfigError
from omni_compile.passes import resolve_enabled


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1024x1024", ShapeBucket(1024, 1024, None, 1)),
        ("480x832x81", ShapeBucket(480, 832, 81, 1)),
        ("512x512@2", ShapeBucket(512, 512, None, 2)),
        (" 64X96x9@3 ", ShapeBucket(64, 96, 9, 3)),
    ],
)
def test_bucket_parse(text, expected):
    assert ShapeBucket.parse(text) == expected
    assert ShapeBucket.parse(str(expected)) == expected


@pytest.mark.parametrize("text", ["1024", "12x", "x12", "1024x1024x", "axb", "64x64@", "0x64", "64x64@0", "64x64x0"])
def test_bucket_parse_rejects_malformed(text):
    with pytest.raises(ConfigError, match="shape"):
        ShapeBucket.parse(text)


def test_bucket_list_dedupes_and_keeps_order():
    assert [str(b) for b in ShapeBucket.parse_list("128x128,64x64,128x128")] == ["128x128", "64x64"]
    with pytest.raises(ConfigError, match="no shapes"):
        ShapeBucket.parse_list(" , ")


def test_dtype_names():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("fp32") is torch.float32
    with pytest.raises(ConfigError, match="unknown dtype 'int8'"):
        parse_dtype("int8")


def test_compile_config_rejects_unknown_keys():
    with pytest.raises(ConfigError, match=r"unknown CompileConfig key\(s\) \['pases'\]"):
        CompileConfig.from_dict({"pases": ["-rms_norm"]})


def test_compile_config_hash_covers_codegen_fields_only():
    base = CompileConfig()
    assert base.compute_hash() == CompileConfig().compute_hash()
    assert CompileConfig(dump_dir="/tmp/x").compute_hash() == base.compute_hash()
    assert CompileConfig(passes=["-rms_norm"]).compute_hash() != base.compute_hash()
    assert CompileConfig(canonicalize_strides=False).compute_hash() != base.compute_hash()
    assert CompileConfig(pass_options={"rms_norm": {"semantics": ["torch"]}}).compute_hash() != base.compute_hash()
    assert CompileConfig(sequence_parallel=True).compute_hash() != base.compute_hash()
    assert all(CompileConfig.field_docs().values()), "every config field has a docstring"


def test_pass_switches():
    everything = ["complex_mul", "rms_norm", "qk_norm_rope", "adaln", "gated_residual", "fp8_act", "gemm_gelu",
                  "cat_gemm", "attention", "lower_fused_ops"]  # fmt: skip
    default = [p for p in everything if p != "gated_residual"]
    assert resolve_enabled([]) == default
    assert resolve_enabled(["-rms_norm"]) == [p for p in default if p != "rms_norm"]
    assert resolve_enabled(["+gated_residual"]) == everything
    assert resolve_enabled(["none", "+rms_norm"]) == ["rms_norm"]
    assert resolve_enabled(["none,rms_norm"]) == ["rms_norm"]
    assert resolve_enabled(["-rms_norm", "all"]) == everything
    assert resolve_enabled(["all", "-qk_norm_rope"]) == [p for p in everything if p != "qk_norm_rope"]
    passes = ", ".join(everything)
    with pytest.raises(ConfigError, match=f"unknown pass 'rms' in switch '-rms'; passes are {passes}"):
        resolve_enabled(["-rms"])


def test_env_switch_applies_on_top(monkeypatch):
    from omni_compile.passes import PassManager
    from omni_compile.platform import current_platform

    monkeypatch.setenv("OMNI_COMPILE_PASSES", "-rms_norm")
    pm = PassManager(CompileConfig(), current_platform("cpu"))
    # what runs on the CPU: the GPU-only passes (gemm_gelu, cat_gemm) are switched on but do not apply
    assert pm.enabled == [p.name for p in pm.passes] == ["complex_mul", "qk_norm_rope", "adaln", "attention",
                                                         "lower_fused_ops"]  # fmt: skip


def test_kernel_choices(monkeypatch):
    from omni_compile.ops.registry import FUSED_OPS, parse_kernel_choices

    ops = set(FUSED_OPS)
    assert ops == {"rms_norm", "adaln", "gated_residual", "rms_norm_rope", "layer_norm_rope", "quant_rows", "adaln_quant"}
    assert parse_kernel_choices({}) == {op: "auto" for op in ops}
    assert parse_kernel_choices({"*": "native"}) == {op: "native" for op in ops}
    assert parse_kernel_choices({"*": "triton", "adaln": "native"}) == {
        **{op: "triton" for op in ops},
        "adaln": "native",
    }
    # The override (OMNI_COMPILE_KERNELS / --kernels syntax) applies on top of the config.
    assert parse_kernel_choices({"adaln": "triton"}, "adaln=auto, rms_norm=native")["adaln"] == "auto"
    with pytest.raises(ConfigError, match="kernel choice for unknown fused op 'rope'; fused ops are"):
        parse_kernel_choices({"rope": "triton"})
    with pytest.raises(
        ConfigError, match="kernel choice adaln='cuda' is not valid; choose one of auto, native, triton"
    ):
        parse_kernel_choices({"adaln": "cuda"})
    with pytest.raises(ConfigError, match="must look like OP=IMPL"):
        parse_kernel_choices({}, "adaln")


def test_kernels_config_changes_hash_and_env_applies(monkeypatch):
    from omni_compile.passes import PassManager
    from omni_compile.platform import current_platform

    base = CompileConfig().compute_hash()
    assert CompileConfig(kernels={"adaln": "native"}).compute_hash() != base
    assert CompileConfig(dump_dir="/x").compute_hash() == base
    cpu = current_platform("cpu")
    monkeypatch.setenv("OMNI_COMPILE_KERNELS", "*=native")
    lowering = PassManager(CompileConfig(passes=["all"]), cpu).passes[-1]
    assert set(lowering.choices.values()) == {"native"}
    monkeypatch.setenv("OMNI_COMPILE_KERNELS", "adaln=bogus")
    with pytest.raises(ConfigError, match="kernel choice adaln='bogus' is not valid"):
        PassManager(CompileConfig(), cpu)


def test_auto_selection_picks_only_kernels_verified_on_the_platform():
    """auto picks a kernel only on the platforms where it was verified faster end to end (CUDA, for all but
    gated_residual); elsewhere it is opt-in, and asked for by name it is used."""
    from omni_compile.ops.registry import FUSED_OPS
    from omni_compile.platform import Platform

    cuda = Platform("cuda", "NVIDIA H200", (9, 0), "2.11.0", "3.6.0", "13.0", None)
    rocm = Platform("rocm", "AMD Instinct MI300X", (9, 4), "2.11.0", "3.6.0", None, "6.4")
    auto_on_cuda = {"rms_norm", "adaln", "rms_norm_rope", "quant_rows", "adaln_quant"}
    assert auto_on_cuda < set(FUSED_OPS)
    for op in FUSED_OPS.values():
        res = op.resolve(cuda, None, "auto")
        if op.name in auto_on_cuda:
            assert (res.implementation, res.reason) == ("triton", "triton kernel for cuda"), res
        else:
            assert res.implementation == "native", res
            why = {"gated_residual": "it ties Inductor's code", "layer_norm_rope": "its LayerNorm form is not yet checked"}
            assert f"opt-in on cuda ({why[op.name]}" in res.reason
            assert f"use kernels {op.name}=triton)" in res.reason
        res = op.resolve(rocm, None, "auto")
        assert res.implementation == "native", res
        assert "opt-in on rocm (" in res.reason and f"use kernels {op.name}=triton)" in res.reason
        assert op.resolve(cuda, None, "triton").implementation == "triton"
        assert op.resolve(rocm, None, "triton").implementation == "triton"


def test_user_errors_are_found_behind_torch_wrappers():
    """A pass raising inside Inductor surfaces wrapped (InductorError, BackendCompilerFailed); the CLI
    finds our error behind the wrapper and prints it as one line."""
    from omni_compile.errors import find_user_error
    from omni_compile.ops import KernelUnavailableError

    ours = KernelUnavailableError("the triton kernel for adaln was requested but cannot be used: x")
    try:
        try:
            raise ours
        except KernelUnavailableError as e:
            raise RuntimeError("backend compiler failed") from e
    except RuntimeError as wrapped:
        assert find_user_error(wrapped) is ours
    assert find_user_error(RuntimeError("a bug")) is None
