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
    assert all(CompileConfig.field_docs().values()), "every config field has a docstring"


def test_pass_switches():
    assert resolve_enabled([]) == ["rms_norm", "lower_fused_ops"]
    assert resolve_enabled(["-rms_norm"]) == ["lower_fused_ops"]
    assert resolve_enabled(["none", "+rms_norm"]) == ["rms_norm"]
    assert resolve_enabled(["none,rms_norm"]) == ["rms_norm"]
    assert resolve_enabled(["-rms_norm", "all"]) == ["rms_norm", "lower_fused_ops"]
    with pytest.raises(ConfigError, match="unknown pass 'rms' in switch '-rms'; passes are rms_norm, lower_fused_ops"):
        resolve_enabled(["-rms"])


def test_env_switch_applies_on_top(monkeypatch):
    from omni_compile.passes import PassManager
    from omni_compile.platform import current_platform

    monkeypatch.setenv("OMNI_COMPILE_PASSES", "-rms_norm")
    assert PassManager(CompileConfig(), current_platform("cpu")).enabled == ["lower_fused_ops"]
