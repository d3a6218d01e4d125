"""The implementation registry: fused-op kernels and attention backends are implementations of an op,
selected by one path (`ops.registry.select`): rank per platform, capability checks, lossy never automatic,
the `auto_on` gate, a measured choice, and a new backend joining with one registration."""

import dataclasses

import pytest
import torch

from omni_compile.attention.backends import BACKENDS, AttentionBackend, AttentionCall, preference
from omni_compile.attention.config import AttentionConfig
from omni_compile.attention.select import AttentionBackendError, resolve
from omni_compile.ops import FUSED_OPS, Implementation, implementations, register, select
from omni_compile.ops.registry import IMPLEMENTATIONS
from omni_compile.platform import Platform


def plat(kind, cap=None, triton="3.6.0"):
    return Platform(kind, f"a {kind} device", cap, "2.11.0", triton, None, None)


H100, A100, CPU, XPU = plat("cuda", (9, 0)), plat("cuda", (8, 0)), plat("cpu"), plat("xpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demo(Implementation):
    max_n: int = 1 << 30

    def requirements(self, platform, call):
        n = call.get("n", 0)
        return None if n <= self.max_n else f"n={n} is above {self.max_n}"


@pytest.fixture
def demo_op(monkeypatch):
    """A test-only op 'demo' with four implementations, removed afterwards."""
    monkeypatch.setitem(IMPLEMENTATIONS, "demo", {})
    register(Demo(op="demo", name="slow", platforms=("cuda", "cpu"), priority={"cuda": 0, "cpu": 0}))
    register(Demo(op="demo", name="fast", platforms=("cuda",), priority={"cuda": 20}, min_capability=(9, 0),
                  max_n=64))  # fmt: skip
    register(Demo(op="demo", name="new", platforms=("cuda",), priority={"cuda": 10}, auto_on=(),
                  manual_reason="not measured yet"))  # fmt: skip
    register(Demo(op="demo", name="lossy", platforms=("cuda",), priority={"cuda": 99}, lossy=True))
    return implementations("demo")


def test_rank_capability_and_requirements(demo_op):
    assert [i.name for i in demo_op.values()] == ["slow", "fast", "new", "lossy"]
    opt_in = ("new", "opt-in on cuda (not measured yet; choose new by name)")
    res = select("demo", H100, {"n": 8})  # every ranked implementation that cannot run is listed, wherever it ranks
    assert (res.implementation, res.skipped) == ("fast", (opt_in,))
    # too large a call for `fast`; `new` is ranked but opt-in on cuda; `lossy` never appears
    res = select("demo", H100, {"n": 100})
    assert res.implementation == "slow"
    assert res.skipped == (("fast", "n=100 is above 64"), opt_in)
    # below fast's compute capability it is not even ranked
    assert [n for n, _ in select("demo", A100, {"n": 8}).skipped] == ["new"]
    assert select("demo", CPU, {"n": 8}).implementation == "slow"
    # by name: the automatic gate does not apply, the platform and the call's requirements do
    assert demo_op["new"].check(H100, {"n": 8}, explicit=True) is None
    assert demo_op["lossy"].check(H100, {"n": 8}, explicit=True) is None
    assert demo_op["lossy"].check(H100, {"n": 8}) == "lossy: used only when asked for by name"
    assert demo_op["fast"].check(A100, explicit=True) == (
        "it needs compute capability 9.0 or newer; a cuda device has 8.0")
    assert demo_op["fast"].check(CPU, explicit=True) == "it runs on cuda, not on cpu"


def test_measured_choice_takes_the_fastest_capable(demo_op):
    seen = []

    def measure(capable):
        seen.append([i.name for i in capable])
        return "8 rows", {"fast": 2.0, "slow": 1.0}, "slow"

    res = select("demo", H100, {"n": 8}, measure)
    assert seen == [["fast", "slow"]]
    assert (res.implementation, res.reason, res.measured) == ("slow", "fastest measured",
                                                              ("8 rows", {"fast": 2.0, "slow": 1.0}))  # fmt: skip
    # one capable implementation: nothing to time
    assert select("demo", H100, {"n": 100}, lambda c: pytest.fail("timed")).implementation == "slow"
    # a measurement with no winner falls back to the rank
    assert select("demo", H100, {"n": 8}, lambda c: ("8 rows", {"fast": "raised"}, None)).implementation == "fast"


def test_fused_ops_and_attention_share_the_registry():
    for name in FUSED_OPS:
        impls = implementations(name)
        assert impls["native"].priority and set(impls) >= {"native", "triton"}, name
    assert implementations("attention") is BACKENDS
    assert preference(H100)[-1] == "TORCH_SDPA"
    cpu = FUSED_OPS["rms_norm"].resolve(CPU)
    assert cpu.implementation == "native" and cpu.reason.startswith("triton: the triton kernel runs on cuda/rocm")


def test_a_new_attention_backend_is_one_registration(monkeypatch):
    """A backend registered at run time is accepted by name, ranked where it says, and its checks apply."""
    backend = AttentionBackend(name="TOY_ATTN", description="a toy", platforms=("xpu",), priority={"xpu": 50},
                               dtypes=(torch.bfloat16,), form="sdpa")  # fmt: skip
    monkeypatch.setitem(BACKENDS, backend.name, backend)
    assert preference(XPU)[0] == "TOY_ATTN"
    assert resolve(AttentionConfig(), "default", XPU, AttentionCall(torch.bfloat16, 64)).backend == "TOY_ATTN"
    res = resolve(AttentionConfig(), "default", XPU, AttentionCall(torch.float16, 64))
    assert res.skipped[0] == ("TOY_ATTN", "dtype float16 is unsupported (TOY_ATTN takes bfloat16)")
    config = AttentionConfig.from_json({"default": {"backend": "toy_attn"}})
    assert resolve(config, "default", XPU, AttentionCall(torch.bfloat16, 64)).backend == "TOY_ATTN"
    with pytest.raises(AttentionBackendError, match="TOY_ATTN was explicitly selected .* it runs on xpu, not on cuda"):
        resolve(config, "default", H100, AttentionCall(torch.bfloat16, 64))
