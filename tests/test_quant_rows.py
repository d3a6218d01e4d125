"""fp8 row quantization (`omni_compile::quant_rows`): its Triton kernel against the native implementation and
float64, and the `fp8_act` pass that folds a GELU into it.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py), on small shapes; the GPU tests
run it at W2's FFN shape and inside a compiled fp8 model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_l2, require_triton_interpreter
from omni_compile.passes import PassLog, PassManager
from test_passes import AtenGraph, fired, targets

from omni_compile.config import CompileConfig
from omni_compile.ops import FUSED_OPS, KernelUnavailableError
from omni_compile.ops.fp8 import Fp8Linear
from omni_compile.ops.kernels import quant_rows as quant_k
from omni_compile.ops.quant_rows import ACTS, FP8, FP8_MAX, quant_rows_native
from omni_compile.platform import current_platform

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUANT = "omni_compile.quant_rows.default"


def _x(*shape, dtype, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=device) * torch.logspace(-1, 1, shape[-1], device=device)
    return x.to(dtype)


def check_against_native(x: torch.Tensor, act: str) -> None:
    """The kernel's rows and scales against the native op on the same input, and against float64."""
    q, s = quant_k._quant_rows_impl(x, act)
    qn, sn = quant_rows_native(x, act)
    assert q.dtype == FP8 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (*x.shape[:-1], 1)
    if act == "none" or x.dtype != torch.float32:
        assert torch.equal(s, sn)  # the row maxima of the same rounded values
    else:  # an fp32 activation is not rounded to a coarser grid: its tanh/erf may differ by an ulp
        torch.testing.assert_close(s, sn, rtol=1e-6, atol=0)
    differ = q.float() != qn.float()
    if act == "none" and x.device.type == "cpu":
        assert not differ.any()  # the interpreter divides as torch does: the same quotient, the same e4m3 value
    else:
        # On a GPU Triton's fp32 division is the fast one (2 ulps), and an activation's rounding tie may fall the
        # other way: where the quotient sits on an e4m3 rounding boundary the value differs, by one step at most
        assert differ.float().mean() < (5e-5 if act == "none" else 5e-3)
        step = qn.float().abs().clamp(min=2**-6) / 8
        assert ((q.float() - qn.float()).abs() <= step + 2**-9)[differ].all()
    assert q.float().abs().amax() <= FP8_MAX
    exact = F.gelu(x.double(), approximate="tanh" if act == "gelu_tanh" else "none") if act != "none" else x.double()
    assert rel_l2(q.double() * s.double(), exact) < 3e-2  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_against_native_and_float64(act, dtype):
    if DEV == "cpu":
        require_triton_interpreter()
    x = _x(3, 7, 72, dtype=dtype)
    x[0, 0] = 0  # a row of zeros: zeros out, not NaN
    check_against_native(x, act)
    q, s = quant_k._quant_rows_impl(x, act)
    assert not q[0, 0].float().any() and s[0, 0].item() == pytest.approx(1e-12 / 448)
    check_against_native(_x(5, 100, dtype=dtype, seed=1) * 30, act)  # a row that is not a power of two, large values
    # the triton_op (eager and compiled from a graph's start) is the same launch
    qo, so = torch.ops.omni_compile.quant_rows_triton(x, act)
    assert torch.equal(qo.view(torch.uint8), q.view(torch.uint8)) and torch.equal(so, s)


def test_kernel_reads_strided_rows():
    if DEV == "cpu":
        require_triton_interpreter()
    x = _x(8, 4, 64, dtype=torch.bfloat16).transpose(0, 1)  # rows of stride 64 * 4 in the outer dim
    assert not x.is_contiguous() and quant_k.supports(x, "none") is None
    check_against_native(x, "none")


def test_kernel_refuses_what_it_cannot_take():
    x = torch.empty(4, 64, dtype=torch.bfloat16)
    assert "act 'relu' is not one of" in quant_k.supports(x, "relu")
    assert "dtype torch.int32" in quant_k.supports(torch.empty(4, 64, dtype=torch.int32), "none")
    assert "not contiguous" in quant_k.supports(torch.empty(64, 4).t(), "none")
    assert "more than the 65536 elements" in quant_k.supports(torch.empty(1, 70000), "none")
    op = FUSED_OPS["quant_rows"]
    with pytest.raises(KernelUnavailableError, match="the triton kernel for quant_rows was requested but cannot"):
        op.resolve(current_platform(DEV), {"x": torch.empty(64, 4).t(), "act": "none"}, "triton")


def test_automatic_choice_is_native_on_the_cpu():
    resolution = FUSED_OPS["quant_rows"].resolve(current_platform("cpu"), {"x": torch.empty(4, 64), "act": "none"})
    assert resolution.implementation == "native"


# ---------------------------------------------------------------- the fp8_act pass

FP8_CONFIG = CompileConfig(passes=["-lower_fused_ops"], weight_transforms=["fp8"])


def _run_passes(gm, config=FP8_CONFIG):
    pm = PassManager(config, current_platform("cpu"))
    log = PassLog("test")
    with pm.recording(log):
        pm(gm.graph)
    gm.gm.recompile()
    return log


def _acts(gm) -> list[str]:
    return sorted(n.args[1] for n in gm.graph.nodes if str(n.target) == QUANT)


def _mlp(dtype, seed=0):
    torch.manual_seed(seed)
    up = torch.nn.Linear(32, 64).to(dtype)
    down, side = (Fp8Linear.from_linear(torch.nn.Linear(64, n).to(dtype)) for n in (32, 16))
    return up, down, side


@pytest.mark.parametrize("approximate,act", [("tanh", "gelu_tanh"), ("none", "gelu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_act_folds_the_gelu_into_the_quantization(approximate, act, dtype):
    """linear -> GELU -> two fp8 Linears: the GELU is computed inside one quantization of the linear's output
    (the fold, then the merge of the two quantizations of one tensor: 2 rewrites)."""
    up, down, side = _mlp(dtype)
    x = torch.randn(2, 5, 32).to(dtype)

    def fn(t):
        h = F.gelu(up(t), approximate=approximate)
        return down(h), side(h)

    with torch.no_grad():
        gm = AtenGraph(fn, x)
        assert _acts(gm) == ["none", "none"]
        log = _run_passes(gm)
        assert fired(log) == {"fp8_act": 2}
        assert _acts(gm) == [act] and not {"aten.tanh.default", "aten.erf.default"} & targets(gm)
        expected, out = fn(x), gm(x)
    for e, o in zip(expected, out):
        assert torch.equal(o, e)  # the op's contract rounds the GELU as the module did: the same e4m3 rows


def test_fp8_act_keeps_a_gelu_used_elsewhere():
    up, down, _ = _mlp(torch.bfloat16)
    x = torch.randn(2, 5, 32).to(torch.bfloat16)

    def fn(t):
        h = F.gelu(up(t), approximate="tanh")
        return down(h) + h[..., :32]  # the bf16 GELU output is needed: nothing to fold

    with torch.no_grad():
        gm = AtenGraph(fn, x)
        log = _run_passes(gm)
    assert log.matches()["fp8_act"] == 0 and _acts(gm) == ["none"] and "aten.tanh.default" in targets(gm)


def test_fp8_act_runs_for_fp8_builds_only():
    up = torch.nn.Linear(32, 64)
    with torch.no_grad():
        gm = AtenGraph(lambda t: F.gelu(up(t), approximate="tanh"), torch.randn(4, 32))
        assert _run_passes(gm).matches()["fp8_act"] == 0  # no quantization to fold into
        assert "fp8_act" not in _run_passes(gm, CompileConfig(passes=["-lower_fused_ops"])).matches()


def _adaln_args(dtype, device=DEV):
    x = _x(2, 6, 64, dtype=dtype, device=device)
    mod = _x(2, 1, 128, dtype=dtype, seed=3, device=device) * 0.3
    return x, mod[..., :64], mod[..., 64:]  # scale and shift: per-sample views of one chunked tensor


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_adaln_kernel_writes_the_quantized_rows(norm, dtype):
    """adaln_quant's kernel (the adaln kernel writing e4m3 rows) against quantizing the native adaln's output."""
    if DEV == "cpu":
        require_triton_interpreter()
    from omni_compile.ops.adaln import adaln_native, adaln_quant_native
    from omni_compile.ops.kernels.adaln import _adaln_quant_impl

    x, scale, shift = _adaln_args(dtype)
    args = (x, scale, shift, 1e-6, norm, True)
    q, s = _adaln_quant_impl(*args)
    qn, sn = adaln_quant_native(*args)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (2, 6, 1)
    y = adaln_native(*args)
    # the kernel's adaln rows equal the native op's up to its usual last-bit differences; quantized, they are
    # the same e4m3 rows but where such a difference crosses a rounding boundary
    torch.testing.assert_close(s, sn, rtol=2 ** -7, atol=0)
    assert (q.float() != qn.float()).float().mean() < 2e-2
    assert rel_l2(q.double() * s.double(), y.double()) < 3e-2


def _norm_then_fp8(dtype, shared: bool):
    from omni_compile.ops.adaln import adaln  # noqa: F401  (the op)

    _, down, _ = _mlp(dtype)
    linear = Fp8Linear.from_linear(torch.nn.Linear(64, 64).to(dtype))

    def fn(x, scale, shift):
        n = torch.ops.omni_compile.adaln(x, scale, shift, 1e-6, "layer", True)
        out = (down(n), linear(n))
        return (*out, n * 2) if shared else out

    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_act_folds_a_norm_read_only_by_its_quantization(dtype):
    """adaln -> two fp8 Linears: one quantization (merged), then the norm writes the e4m3 rows (adaln_quant)."""
    fn = _norm_then_fp8(dtype, shared=False)
    args = tuple(t.cpu() for t in _adaln_args(dtype, device="cpu"))
    with torch.no_grad():
        gm = AtenGraph(fn, *args)
        log = _run_passes(gm)
        assert fired(log) == {"fp8_act": 2}  # one merge, one norm fold
        assert "omni_compile.adaln_quant.default" in targets(gm) and QUANT not in targets(gm)
        assert "omni_compile.adaln.default" not in targets(gm)
        expected, out = fn(*args), gm(*args)
    for e, o in zip(expected, out):
        assert torch.equal(o, e)


def test_fp8_act_keeps_a_norm_read_elsewhere():
    fn = _norm_then_fp8(torch.bfloat16, shared=True)
    args = tuple(t.cpu() for t in _adaln_args(torch.bfloat16, device="cpu"))
    with torch.no_grad():
        gm = AtenGraph(fn, *args)
        log = _run_passes(gm)
    assert log.matches()["fp8_act"] == 1  # the merge only: the bf16 rows are needed
    assert "omni_compile.adaln.default" in targets(gm) and "omni_compile.adaln_quant.default" not in targets(gm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", ACTS)
def test_kernel_on_cuda_at_the_ffn_shape(act):
    """W2's FFN activation, 32760 x 8960 bf16 (a row held whole in one program), and a FLUX hidden row."""
    check_against_native(_x(32760, 8960, dtype=torch.bfloat16, device="cuda"), act)
    check_against_native(_x(2, 4096, 3072, dtype=torch.bfloat16, device="cuda", seed=2), act)
