"""`inspect.profile`: the GEMM table (shapes, calls, TFLOP/s) and the device timeline (busy time, gaps)."""

from types import SimpleNamespace

import pytest
import torch

import omni_compile.ops  # noqa: F401  (omni_compile::linear_parts)
from omni_compile.inspect.profile import profile_step, timeline


def test_gemm_table_groups_by_shape_and_counts_nested_ops_once():
    a, b, bias = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16)
    lin = torch.nn.Linear(32, 48)

    def step():
        for _ in range(3):
            torch.mm(a, b)
        torch.addmm(bias, a, b)
        lin(a)  # aten::linear -> aten::addmm: one row, once
        torch.bmm(a[None].expand(2, 64, 32), b[None].expand(2, 32, 16))
        torch.mm(a, b, out=torch.empty(64, 16))  # the out= form Inductor's extern kernels call
        torch.ops.omni_compile.linear_parts([a, a[:, :8]], torch.randn(40, 16), bias)  # addmm, then addmm_ in place

    rows = {(r["op"], r["shape"]): r for r in profile_step(step, "cpu")["gemms"]}
    assert {k: r["calls"] for k, r in rows.items()} == {
        ("mm", "64x32x16"): 4,
        ("addmm", "64x32x16"): 2,
        ("addmm_", "64x8x16"): 1,
        ("addmm", "64x32x48"): 1,
        ("bmm", "2x64x32x16"): 1,
    }
    mm = rows[("mm", "64x32x16")]
    assert mm["tflops"] == pytest.approx(2 * 64 * 32 * 16 * 4 / mm["ms"] / 1e9, rel=0.05, abs=0.1)


def _kernel(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_timeline_busy_time_and_gaps():
    kernels = [
        _kernel("nvjet_gemm", 0.0, 100.0),
        _kernel("triton_poi_fused_add", 50.0, 120.0),  # overlaps: no gap
        _kernel("flash_fwd_kernel", 150.0, 250.0),  # a 30 us gap before attention
        _kernel("triton_red_fused_mean", 252.0, 260.0),  # 2 us: launch latency, not a gap
        _kernel("nvjet_gemm", 1260.0, 1300.0),  # a 1 ms gap before a GEMM
    ]
    t = timeline(kernels)
    assert t["span_ms"] == pytest.approx(1.3)
    assert t["busy_ms"] == pytest.approx((120 + 100 + 8 + 40) / 1e3)
    assert t["idle_ms"] == pytest.approx(t["span_ms"] - t["busy_ms"])
    assert t["gaps"] == 2 and t["gap_ms"] == pytest.approx(1.03)
    assert t["gap_ms_before"] == {"gemm": pytest.approx(1.0), "attention": pytest.approx(0.03)}
    assert [(g["us"], g["after"], g["before"]) for g in t["largest_gaps"]] == [
        (1000.0, "triton_red_fused_mean", "nvjet_gemm"),
        (30.0, "triton_poi_fused_add", "flash_fwd_kernel"),
    ]
    assert timeline([])["busy_ms"] == 0.0


def test_cpu_profile_has_no_timeline():
    assert profile_step(lambda: torch.ones(4) + 1, "cpu")["timeline"] is None
