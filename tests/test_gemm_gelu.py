"""The gemm_gelu pass: tanh-GELU after a linear moves into the GEMM's epilogue (`aten._addmm_activation`).

The op's GELU is the tanh form on CUDA and the exact (erf) form on the CPU, so the pass rewrites CUDA
graphs only: on the CPU the tests check that it stays off and refuses CPU tensors; on a GPU they check
match counts, near misses and values against eager and a float64 reference, on ATen graphs as Inductor's
post-grad passes see them (test_passes.AtenGraph) and through Inductor on the tiny presets.
"""

import pytest
import torch
import torch.nn.functional as F

from omni_compile.config import CompileConfig
from omni_compile.passes import PassLog, PassManager
from omni_compile.platform import current_platform

from conftest import rel_l2
from test_passes import AtenGraph, fired, targets, with_and_without

ACT = "aten._addmm_activation.default"
CONFIG = CompileConfig(passes=["-lower_fused_ops"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_on(gm, device, config=CONFIG):
    pm = PassManager(config, current_platform(device))
    log = PassLog("test")
    with pm.recording(log):
        pm(gm.graph)
    gm.recompile()
    return log


def gelu64(x, w, b):
    return F.gelu(x.double() @ w.double().t() + b.double(), approximate="tanh")


def test_off_on_the_cpu():
    """Not applicable on a CPU platform, and its handler refuses CPU tensors even on a GPU platform."""
    from omni_compile.platform import Platform

    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        gm = AtenGraph(lambda t: F.gelu(lin(t), approximate="tanh"), x)
        log = run_on(gm, "cpu")
        assert "gemm_gelu" not in log.matches() and ACT not in targets(gm)
        h200 = Platform("cuda", "NVIDIA H200", (9, 0), "2.11.0", "3.6.0", "13.0", None)
        pm = PassManager(CONFIG, h200)
        log = PassLog("test")
        with pm.recording(log):
            pm(gm.graph)
    assert log.matches()["gemm_gelu"] == 0 and ACT not in targets(gm)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(6, 32), (2, 5, 32)])
@pytest.mark.parametrize("form", ["addmm", "bias-unfused"])
def test_linear_then_tanh_gelu_is_one_epilogue(dtype, shape, form):
    """`addmm(b, x, wᵀ)`, or `b + mm(x, wᵀ)` as Inductor leaves it on a GPU, then tanh-GELU."""
    lin = torch.nn.Linear(32, 48).to("cuda", dtype)
    x = torch.randn(*shape, dtype=dtype, device="cuda")
    fn = {
        "addmm": lambda t: F.gelu(lin(t), approximate="tanh") * 3,
        "bias-unfused": lambda t: F.gelu((lin.bias + t.reshape(-1, 32) @ lin.weight.t()).reshape(*t.shape[:-1], 48),
                                         approximate="tanh") * 3,  # fmt: skip
    }[form]
    with torch.no_grad():
        gm = AtenGraph(fn, x)
        eager = fn(x)
        log = run_on(gm, "cuda")
        assert fired(log) == {"gemm_gelu": 1}
        assert ACT in targets(gm) and "aten.tanh.default" not in targets(gm)
        fused = gm(x)
    assert fused.shape == eager.shape and fused.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_l2(fused, eager) < tol
    assert rel_l2(fused, gelu64(x, lin.weight, lin.bias) * 3) < tol


@pytest.fixture
def as_if_cuda(monkeypatch):
    """Let the handler rewrite CPU tensors: the matching and wiring are device-independent; the values are
    not (on the CPU the op's GELU is the erf form), so these tests compare with the op itself."""
    from omni_compile.passes import gemm_gelu

    monkeypatch.setattr(gemm_gelu, "_gelu_is_tanh_on", lambda device: True)
    return PassManager(CONFIG, current_platform("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["addmm-3d", "addmm-2d", "bias-unfused"])
def test_matching_and_wiring(form, dtype, as_if_cuda):
    from omni_compile.passes.gemm_gelu import GemmGeluPass

    lin = torch.nn.Linear(32, 48).to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    fn = {
        "addmm-3d": lambda t: F.gelu(lin(t), approximate="tanh"),
        "addmm-2d": lambda t: F.gelu(lin(t.reshape(10, 32)), approximate="tanh"),
        "bias-unfused": lambda t: F.gelu((lin.bias + t.reshape(10, 32) @ lin.weight.t()).reshape(2, 5, 48),
                                         approximate="tanh"),  # fmt: skip
    }[form]
    with torch.no_grad():
        gm = AtenGraph(fn, x)
        p = GemmGeluPass()
        assert p.apply(gm.graph) == 1
        gm.graph.eliminate_dead_code()
        gm.recompile()
        assert ACT in targets(gm) and "aten.tanh.default" not in targets(gm)
        expected = torch._addmm_activation(lin.bias, x.reshape(10, 32), lin.weight.t(), use_gelu=True)
        assert torch.equal(gm(x).reshape(10, 48), expected)


@pytest.mark.parametrize("case", ["exact-gelu", "linear-output-used-twice", "no-bias", "gelu-of-a-sum"])
def test_near_misses_are_left_alone(case, as_if_cuda):
    from omni_compile.passes.gemm_gelu import GemmGeluPass

    lin = torch.nn.Linear(16, 16)
    nobias = torch.nn.Linear(16, 16, bias=False)
    fns = {
        "exact-gelu": lambda t: F.gelu(lin(t)),
        "linear-output-used-twice": lambda t: (lambda y: F.gelu(y, approximate="tanh") + y.sum())(lin(t)),
        "no-bias": lambda t: F.gelu(nobias(t), approximate="tanh"),
        "gelu-of-a-sum": lambda t: F.gelu(t + 1, approximate="tanh"),
    }
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        gm = AtenGraph(fns[case], x)
        before = fns[case](x)
        assert GemmGeluPass().apply(gm.graph) == 0
        gm.recompile()
        assert ACT not in targets(gm)
        assert rel_l2(gm(x), before) < 1e-6


@pytest.mark.gpu
@needs_cuda
@pytest.mark.compile
@pytest.mark.parametrize("preset,shape,expected", [
    ("flux-tiny", "64x64", {"FluxTransformerBlock": 2, "FluxSingleTransformerBlock": 1}),
    ("wan-tiny", "64x96x9", {"WanTransformerBlock": 1}),
])  # fmt: skip
def test_through_inductor_on_the_tiny_presets(preset, shape, expected, fresh_dynamo, no_inductor_cache):
    """Every FFN's tanh-GELU (FLUX: the double block's two FFNs and the single block's MLP; Wan: its FFN)."""
    ref, without, out, records = with_and_without(preset, shape, "gemm_gelu")
    assert {r.region: r.passes["gemm_gelu"] for r in records} == expected
    # no further from eager than the same compile without the pass (bf16 rounding: one rounding fewer)
    assert rel_l2(out, ref) < max(2 * rel_l2(without, ref), 1e-2)
