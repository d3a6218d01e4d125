"""Pass tests on ATen graphs: what the RMSNorm pass matches, what it leaves alone, its numerics, and
the pass manager's uuid contract. Graphs come from make_fx with Inductor's decompositions (what the
post-grad graph holds) so most tests run in milliseconds; one test goes through Inductor itself.
"""

import contextlib
import operator

import pytest
import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from torch._inductor.decomposition import select_decomp_table

from omni_compile.config import CompileConfig
from omni_compile.counters import counters
from omni_compile.passes import PassLog, PassManager
from omni_compile.platform import current_platform

from conftest import rel_l2

CPU = current_platform("cpu")


class AtenGraph:
    """The functional, decomposed ATen forward graph of `fn` (what Inductor's post-grad passes see),
    run as plain FX: calling it executes the graph as the passes left it."""

    def __init__(self, fn, *args):
        from torch._dynamo.backends.common import aot_autograd

        self.gm = None

        def fw_compiler(gm, example_inputs):
            from torch._inductor.fx_passes.post_grad import view_to_reshape

            view_to_reshape(gm)  # as Inductor does before its post-grad passes
            self.gm = gm
            return lambda *a: self.gm(*a)

        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table())
        self.compiled = torch.compile(fn, backend=backend, fullgraph=True)
        with torch.no_grad():
            self.compiled(*args)

    @property
    def graph(self):
        return self.gm.graph

    def recompile(self):
        self.gm.recompile()

    def __call__(self, *args):
        with torch.no_grad():
            return self.compiled(*args)


def run_passes(gm, config=None):
    pm = PassManager(config or CompileConfig(), CPU)
    log = PassLog("test")
    with pm.recording(log):
        pm(gm.graph)
    gm.recompile()
    return log


def fired(log):
    """The passes that matched something, with their counts."""
    return {name: n for name, n in log.matches().items() if n}


def targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def with_and_without(preset: str, shape: str, pass_name: str, device: str = "cuda"):
    """A tiny preset in bf16 on `device`: its eager output, the output compiled without `pass_name`, the
    output compiled with every default pass, and the last compile's records."""
    import omni_compile
    from omni_compile.config import CompileConfig, ShapeBucket
    from omni_compile.models import resolve_model

    spec = resolve_model(preset)
    model = spec.load(dtype=torch.bfloat16, device=device, seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.bfloat16, device=device,
                                         text_len=spec.text_len, seed=1)  # fmt: skip
    with torch.no_grad():
        ref = model(**inputs)[0]
        omni_compile.compile(model, CompileConfig(passes=[f"-{pass_name}"]))
        without = model(**inputs)[0]
        omni_compile.uncompile(model)
        torch._dynamo.reset()
        omni_compile.compile(model)
        out = model(**inputs)[0]
    return ref, without, out, omni_compile.compile_state(model).records


def rms64(x, w, eps):
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


NORMS = {
    "torch": lambda d, dt: torch.nn.RMSNorm(d, eps=1e-6).to(dt),
    "torch-no-weight": lambda d, dt: torch.nn.RMSNorm(d, eps=1e-5, elementwise_affine=False).to(dt),
    "diffusers": lambda d, dt: DiffusersRMSNorm(d, eps=1e-6).to(dt),
    "diffusers-no-weight": lambda d, dt: DiffusersRMSNorm(d, eps=1e-5, elementwise_affine=False).to(dt),
}


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48), (2, 7, 3, 48)])
def test_rms_norm_matches_once_and_keeps_values(kind, dtype, shape):
    norm = NORMS[kind](shape[-1], dtype)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.randn_like(norm.weight))
    x = torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        gm = AtenGraph(lambda t: norm(t), x)
        eager = norm(x)
        assert "omni_compile.rms_norm.default" not in targets(gm)
        log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
        assert fired(log) == {"rms_norm": 1}
        assert "omni_compile.rms_norm.default" in targets(gm)
        assert "aten.rsqrt.default" not in targets(gm)
        fused = gm(x)
    assert fused.dtype == eager.dtype
    # Same rounding as the unfused chain: equal to eager up to fp32 reassociation.
    assert torch.allclose(fused.float(), eager.float(), rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_l2(fused, rms64(x, norm.weight, norm.eps)) < tol


def test_lowering_inlines_native_and_preserves_values():
    norm = torch.nn.RMSNorm(64, eps=1e-6)
    x = torch.randn(3, 9, 64)
    with torch.no_grad():
        gm = AtenGraph(lambda t: norm(t) * 2 + 1, x)
        log = run_passes(gm)
        assert fired(log) == {"rms_norm": 1, "lower_fused_ops": 1}
        assert not any(t.startswith("omni_compile") for t in targets(gm))
        assert log.resolutions["rms_norm"]["implementation"] == "native"
        reason = log.resolutions["rms_norm"]["reason"]
        assert "triton: the triton kernel runs on cuda/rocm, not on cpu" in reason, reason
        assert "Inductor compiles the native implementation" in reason
        assert rel_l2(gm(x), rms64(x, norm.weight, 1e-6) * 2 + 1) < 1e-6


def test_several_norms_in_one_graph_each_match():
    a, b = torch.nn.RMSNorm(32, eps=1e-6), DiffusersRMSNorm(32, eps=1e-6)
    x, y = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    with torch.no_grad():
        gm = AtenGraph(lambda x, y: a(x) + b(y) + a(y * 3), x, y)
        with counters.expect(pass_matches={"rms_norm": 3}):
            run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))


@pytest.mark.parametrize("case", ["non-last-dim", "power-4", "weight-broadcast-other-dim"])
def test_near_misses_are_left_alone(case):
    x = torch.randn(4, 6, 8)

    def fn(x, w):
        xf = x.float()
        if case == "non-last-dim":
            r = torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-6)
        elif case == "power-4":
            r = torch.rsqrt(xf.pow(4).mean(-1, keepdim=True) + 1e-6)
        else:
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return xf * r * w

    w = torch.randn(6, 1) if case == "weight-broadcast-other-dim" else torch.randn(8)
    gm = AtenGraph(fn, x, w)
    log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
    if case == "weight-broadcast-other-dim":
        # The normalisation itself is an RMSNorm; the odd weight multiply must stay outside the op.
        assert fired(log) == {"rms_norm": 1}
        (op,) = [n for n in gm.graph.nodes if n.target == torch.ops.omni_compile.rms_norm.default]
        assert op.args[1] is None
    else:
        assert "rms_norm" in log.matches() and fired(log) == {}
    assert torch.allclose(gm(x, w), fn(x, w), rtol=1e-5, atol=1e-5)


def test_disabled_pass_matches_nothing():
    norm = torch.nn.RMSNorm(16)
    gm = AtenGraph(lambda t: norm(t), torch.randn(2, 16))
    log = run_passes(gm, CompileConfig(passes=["-rms_norm"]))
    assert "rms_norm" not in log.matches() and fired(log) == {}


def test_semantics_option_restricts_patterns():
    norm = DiffusersRMSNorm(16, eps=1e-6).to(torch.bfloat16)
    gm = AtenGraph(lambda t: norm(t), torch.randn(2, 16, dtype=torch.bfloat16))
    log = run_passes(
        gm, CompileConfig(passes=["-lower_fused_ops"], pass_options={"rms_norm": {"semantics": ["torch"]}})
    )
    assert "rms_norm" in log.matches() and fired(log) == {}


def test_fused_aten_rms_norm_is_matched():
    # CPU builds decompose `_fused_rms_norm` while tracing, so build the graph a backend that keeps it has.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    g = torch.fx.Graph()
    x_node, w_node = g.placeholder("x"), g.placeholder("w")
    fused = g.call_function(torch.ops.aten._fused_rms_norm.default, (x_node, [16], w_node, 1e-6))
    out = g.call_function(torch.ops.aten.add.Tensor, (g.call_function(operator.getitem, (fused, 0)), 1))
    g.output((out,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x, w = torch.randn(3, 16), torch.randn(16)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x, w)
    log = run_passes(gm, CompileConfig(passes=["-lower_fused_ops"]))
    assert fired(log) == {"rms_norm": 1}
    assert "aten._fused_rms_norm.default" not in targets(gm)
    assert rel_l2(gm(x, w)[0], rms64(x, w, 1e-6) + 1) < 1e-6


def test_uuid_changes_with_toggles_and_options_only():
    def uuid(**kw):
        return PassManager(CompileConfig(**kw), CPU).uuid()

    base = uuid()
    assert uuid() == base
    assert uuid(dump_dir="/tmp/somewhere") == base
    assert uuid(passes=["+rms_norm"]) == base  # already on: no change
    off = uuid(passes=["-rms_norm"])
    assert off != base
    assert uuid(passes=["-lower_fused_ops"]) not in (base, off)
    assert uuid(pass_options={"rms_norm": {"semantics": ["torch"]}}) != base
    assert uuid(pass_options={"rms_norm": {"semantics": ["torch", "diffusers"]}}) == base  # the default, spelled out


def test_unknown_pass_option_is_an_error():
    from omni_compile.errors import ConfigError

    with pytest.raises(ConfigError, match=r"pass 'rms_norm' has no option\(s\) \['eps'\]"):
        PassManager(CompileConfig(pass_options={"rms_norm": {"eps": 1}}), CPU)
    with pytest.raises(ConfigError, match="pass_options names unknown pass"):
        PassManager(CompileConfig(pass_options={"nope": {}}), CPU)


@pytest.mark.compile
def test_through_inductor(fresh_dynamo, no_inductor_cache, tmp_path):
    """The manager installed as Inductor's post-grad pass: matches, dumps, compiled values."""
    import omni_compile
    from omni_compile.compiler import RegionBackend, CompileState
    from omni_compile.graphs.regions import Region

    norm = torch.nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    config = CompileConfig(dump_dir=str(tmp_path))
    state = CompileState(config, CPU, PassManager(config, CPU), regions=[])
    backend = RegionBackend(Region("norm", torch.nn.RMSNorm, "h"), state)
    fn = torch.compile(lambda t: norm(t) + 1, backend=backend, fullgraph=True)
    x = torch.randn(4, 32)
    with torch.no_grad():
        out = fn(x)
    assert rel_l2(out, rms64(x, norm.weight, 1e-6) + 1) < 1e-6
    (rec,) = state.records
    # the default passes
    assert rec.passes == {"complex_mul": 0, "rms_norm": 1, "qk_norm_rope": 0, "adaln": 0, "attention": 0,
                          "lower_fused_ops": 1}  # fmt: skip
    assert not rec.cache_hit
    dumps = sorted(p.name for p in tmp_path.rglob("*.py"))
    stages = ["0.complex_mul", "1.rms_norm", "2.qk_norm_rope", "3.adaln", "4.attention", "5.lower_fused_ops"]
    assert dumps == sorted([f"{s}.{w}.py" for s in stages for w in ("after", "before")] + ["dynamo_graph.py"])
    after = next(tmp_path.rglob("1.rms_norm.after.py")).read_text()
    assert "omni_compile.rms_norm" not in next(tmp_path.rglob("5.lower_fused_ops.after.py")).read_text()
    assert "omni_compile.rms_norm" in after
    assert "omni_compile.rms_norm" not in next(tmp_path.rglob("1.rms_norm.before.py")).read_text()
    assert omni_compile.counters.regions_compiled >= 1


def test_cache_hit_reports_what_the_passes_did(fresh_dynamo, monkeypatch, tmp_path, request):
    """An Inductor cache hit skips the post-grad passes; the record still carries the cold compile's
    matches and kernel choices (from the pass-log file beside Inductor's cache), or says they are unknown."""
    from torch._inductor import config as inductor_config

    from omni_compile.compiler import CompileState, RegionBackend, pass_log_cache
    from omni_compile.graphs.regions import Region

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=True))  # monkeypatch would delete it on undo
    request.addfinalizer(stack.close)
    monkeypatch.setattr(pass_log_cache, "entries", {})
    norm = torch.nn.RMSNorm(32, eps=1e-6)
    x = torch.randn(4, 32)

    def compile_once():
        torch._dynamo.reset()
        config = CompileConfig()
        state = CompileState(config, CPU, PassManager(config, CPU), regions=[])
        fn = torch.compile(lambda t: norm(t) * 2, backend=RegionBackend(Region("norm", torch.nn.RMSNorm, "h"), state))
        with torch.no_grad():
            fn(x)
        (rec,) = state.records
        return rec

    cold = compile_once()
    assert not cold.cache_hit and cold.passes["rms_norm"] == 1 and cold.resolutions["rms_norm"]["count"] == 1
    assert len(list((tmp_path / "inductor" / "omni_compile" / "pass_logs").glob("*.json"))) == 1
    pass_log_cache.entries.clear()  # a new process: only the file is left
    warm = compile_once()
    assert warm.cache_hit and warm.passes == cold.passes and warm.resolutions == cold.resolutions
    assert warm.to_json()["passes"] == cold.passes
    for f in (tmp_path / "inductor" / "omni_compile" / "pass_logs").glob("*.json"):
        f.unlink()
    pass_log_cache.entries.clear()
    lost = compile_once()
    assert lost.cache_hit and not lost.passes_known and lost.to_json()["passes"] is None


def test_checks_reject_matches_whose_arguments_are_literals():
    """Inductor re-checks a match with literal arguments folded in (e.g. `x + gate * 0.5`), so a
    check can see its keyword arguments missing or not nodes: it must say no, not raise (a KeyError
    there fails the whole compile)."""
    from types import SimpleNamespace

    from omni_compile.passes import adaln, gated_residual, qk_norm_rope, rms_norm

    checks = [
        adaln._check(torch.bfloat16, False),
        adaln._check(torch.bfloat16, True),
        gated_residual._check({(torch.float32,) * 3}),
        qk_norm_rope._flux_check(torch.bfloat16, False),
        qk_norm_rope._flux_check(torch.bfloat16, True),
        qk_norm_rope._wan_check,
        rms_norm._dtype_check(torch.bfloat16, rms_norm._torch_weight),
        rms_norm._dtype_check(torch.float32),
    ]
    for kwargs in ({}, {"x": 1.0, "y": 0.5, "gate": 2.0, "scale": 1.0, "shift": 0.0, "weight": 1.0, "eps": 1e-6}):
        for check in checks:
            assert check(SimpleNamespace(kwargs=kwargs, nodes=[])) is False


@pytest.mark.parametrize("form", ["x + gate * y", "x + y * gate", "gate * y + x", "y * gate + x"])
def test_gated_residual_in_every_operand_order(form):
    """ATen keeps the order a model wrote (HiDream writes `gate * y + x`); each is one gated_residual, exact in fp32."""
    fn = {"x + gate * y": lambda x, g, y: x + g * y, "x + y * gate": lambda x, g, y: x + y * g,
          "gate * y + x": lambda x, g, y: g * y + x, "y * gate + x": lambda x, g, y: y * g + x}[form]  # fmt: skip
    x, gate, y = torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 5, 16)
    with torch.no_grad():
        gm = AtenGraph(fn, x, gate, y)
        log = run_passes(gm, CompileConfig(passes=["+gated_residual", "-lower_fused_ops"]))
        assert fired(log).get("gated_residual") == 1, fired(log)
        assert "omni_compile.gated_residual.default" in targets(gm)
        assert torch.allclose(gm(x, gate, y), x + gate * y, rtol=1e-6, atol=1e-6)
