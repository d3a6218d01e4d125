"""The qk_norm_rope pass on the interleaved rotary embedding over all heads (LTX-Video's: RMSNorm over H * D of
the [B, S, H * D] projection, then `x * cos + stack([-x_odd, x_even]).flatten() * sin` with [1, S, H * D]
tables, before the unflatten to heads): one `omni_compile::rms_norm_rope`, values against eager and float64,
through the Triton kernel (interpreter) too; near misses stay untouched."""


import pytest
import torch

from omni_compile.config import CompileConfig

from conftest import rel_l2
from test_passes import AtenGraph, fired, run_passes, targets

ROPE = "omni_compile.rms_norm_rope.default"


def interleaved_rope(x, cos, sin):
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
    rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def tables(b, s, c, seed=0):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(b, s, c // 2, generator=g) * 6.28
    return angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)


def reference(x, w, cos, sin, eps):
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.detach().double()
    return interleaved_rope(n, cos.double(), sin.double())


@pytest.mark.parametrize("kernel", ["native", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_over_all_heads_becomes_one_op(dtype, kernel, monkeypatch):
    if kernel == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    c = 64  # 4 heads of 16
    norm = torch.nn.RMSNorm(c, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(c) * 0.5 + 1)
    x = torch.randn(2, 9, c, dtype=dtype) * 3
    cos, sin = tables(1, 9, c)

    def fn(x, cos, sin):
        return interleaved_rope(norm(x), cos, sin).unflatten(2, (4, -1))

    with torch.no_grad():
        gm = AtenGraph(fn, x, cos, sin)
        eager = fn(x, cos, sin)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert fired(log) == {"rms_norm": 1, "qk_norm_rope": 1}, fired(log)
        assert ROPE in targets(gm) and "aten.rsqrt.default" not in targets(gm)
        if kernel == "triton":  # lower it to the kernel, run under the interpreter
            log = run_passes(gm, CompileConfig(passes=["none", "+lower_fused_ops"], kernels={"rms_norm_rope": "triton"}))
            assert log.resolutions["rms_norm_rope"]["implementation"].startswith("triton")
        fused = gm(x, cos, sin)
    assert fused.dtype == dtype and fused.shape == eager.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ref = reference(x, norm.weight, cos, sin, 1e-6).unflatten(2, (4, -1))
    assert rel_l2(fused, eager) < tol and rel_l2(fused, ref) < tol


@pytest.mark.parametrize("case", ["per-sample-tables", "norm-used-elsewhere"])
def test_near_misses_are_left_alone(case):
    c = 32
    norm = torch.nn.RMSNorm(c, eps=1e-6)
    x = torch.randn(2, 5, c)
    if case == "per-sample-tables":  # a table per batch row: the op takes one table for the batch
        cos, sin = tables(2, 5, c)
        fn = lambda x, cos, sin: interleaved_rope(norm(x), cos, sin)  # noqa: E731
    else:  # the normalised q is also read elsewhere: fusing would compute the norm twice
        cos, sin = tables(1, 5, c)

        def fn(x, cos, sin):
            n = norm(x)
            return interleaved_rope(n, cos, sin) + n

    with torch.no_grad():
        gm = AtenGraph(fn, x, cos, sin)
        before = fn(x, cos, sin)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert "qk_norm_rope" not in fired(log) and ROPE not in targets(gm)
        assert rel_l2(gm(x, cos, sin), before) < 1e-6
