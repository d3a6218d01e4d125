"""The cat_gemm pass: a linear over `cat([a, b, ...], -1)` becomes one accumulating GEMM per part.

Pure linear algebra, so the values are checked on the CPU (the pass itself is on by default on GPUs
only) against eager and a float64 reference, on ATen graphs as Inductor's post-grad passes see them.
"""

import pytest
import torch
import torch.nn.functional as F

from omni_compile.passes.cat_gemm import CatGemmPass

from conftest import rel_l2
from test_passes import AtenGraph, targets, with_and_without


def apply(fn, *args):
    with torch.no_grad():
        gm = AtenGraph(fn, *args)
        n = CatGemmPass().apply(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [(24, 40), (8, 16, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_over_a_concatenation_has_no_cat(dtype, parts, bias):
    proj = torch.nn.Linear(sum(parts), 32, bias=bias).to(dtype)
    xs = [torch.randn(2, 7, k, dtype=dtype) for k in parts]
    gm, n = apply(lambda *ts: proj(torch.cat(ts, dim=2)) * 2, *xs)
    assert n == 1 and "aten.cat.default" not in targets(gm)
    gemms = [x for x in gm.graph.nodes if x.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    (op,) = [x for x in gm.graph.nodes if x.target is torch.ops.omni_compile.linear_parts.default]
    assert gemms == [] and len(op.args[0]) == len(parts) and (op.args[2] is not None) == bias
    with torch.no_grad():
        out, eager = gm(*xs), proj(torch.cat(xs, dim=2)) * 2
    ref = torch.cat(xs, 2).double() @ proj.weight.double().t() * 2
    if bias:
        ref = ref + proj.bias.double() * 2
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and rel_l2(out, eager) < tol and rel_l2(out, ref) < tol


def test_flux_single_block_form():
    """As FLUX's single block: proj_out(cat([attn, gelu(mlp)], dim=2)), the gate multiplying the result."""
    attn, mlp = torch.randn(1, 9, 16), torch.randn(1, 9, 64)
    proj = torch.nn.Linear(80, 16)
    gate = torch.randn(1, 1, 16)
    fn = lambda a, m: gate * proj(torch.cat([a, F.gelu(m, approximate="tanh")], dim=2))  # noqa: E731
    gm, n = apply(fn, attn, mlp)
    assert n == 1
    with torch.no_grad():
        assert rel_l2(gm(attn, mlp), fn(attn, mlp)) < 1e-6


@pytest.mark.parametrize("bias", [True, False])
def test_linear_parts_accumulates_in_place(bias):
    """One GEMM per part over views of the weight, the later ones accumulating into the first's output:
    no copy, no concatenation (ATen's `addmm(acc, x, w)` would copy `acc` first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from omni_compile.ops.linear_parts import linear_parts_native

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    xs = [torch.randn(5, k, dtype=torch.float64) for k in (3, 4, 6)]
    wt, b = torch.randn(13, 7, dtype=torch.float64), torch.randn(7, dtype=torch.float64) if bias else None
    with Calls() as calls:
        out = linear_parts_native(xs, wt, b)
    gemms = [op for op in calls.ops if op in ("mm", "addmm", "addmm_")]
    assert gemms == ["addmm" if bias else "mm", "addmm_", "addmm_"]
    assert not {"copy_", "cat", "clone", "contiguous"} & set(calls.ops)
    ref = torch.cat(xs, 1) @ wt + (b if bias else 0)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    out_op = torch.ops.omni_compile.linear_parts(xs, wt, b)
    assert torch.equal(out_op, out)


def test_linear_parts_rejects_widths_that_do_not_add_up():
    with pytest.raises(RuntimeError, match="add up"):
        torch.ops.omni_compile.linear_parts([torch.randn(2, 3), torch.randn(2, 4)], torch.randn(8, 5), None)


@pytest.mark.parametrize("case", ["cat-on-rows", "cat-used-twice", "no-cat"])
def test_near_misses_are_left_alone(case):
    proj = torch.nn.Linear(16, 16)
    fns = {
        "cat-on-rows": lambda a, b: proj(torch.cat([a, b], dim=1)),
        "cat-used-twice": lambda a, b: (lambda c: proj(c) + c.sum())(torch.cat([a, b], dim=2)),
        "no-cat": lambda a, b: proj(a + b[..., :16]),
    }
    shapes = {"cat-on-rows": ((1, 3, 16), (1, 2, 16)), "cat-used-twice": ((1, 3, 8), (1, 3, 8)),
              "no-cat": ((1, 3, 16), (1, 3, 16))}  # fmt: skip
    a, b = (torch.randn(*s) for s in shapes[case])
    gm, n = apply(fns[case], a, b)
    assert n == 0
    with torch.no_grad():
        assert rel_l2(gm(a, b), fns[case](a, b)) < 1e-6


def test_on_by_default_on_gpus_only():
    from omni_compile.config import CompileConfig
    from omni_compile.passes import PassManager
    from omni_compile.platform import Platform, current_platform

    h200 = Platform("cuda", "NVIDIA H200", (9, 0), "2.11.0", "3.6.0", "13.0", None)
    assert "cat_gemm" in [p.name for p in PassManager(CompileConfig(), h200).passes]
    assert "cat_gemm" not in [p.name for p in PassManager(CompileConfig(), current_platform("cpu")).passes]


@pytest.mark.compile
def test_linear_parts_inside_a_compiled_graph():
    """Inductor keeps the op as a fallback call (a list of parts, an optional bias) with the eager values."""
    torch._dynamo.reset()
    a, b = torch.randn(6, 8), torch.randn(6, 24)
    wt, bias = torch.randn(32, 16), torch.randn(16)

    def fn(a, b, wt, bias):
        return torch.ops.omni_compile.linear_parts([a.relu(), b * 2], wt, bias).sigmoid()

    compiled = torch.compile(fn, fullgraph=True)
    ref = (torch.cat([a.relu(), b * 2], 1).double() @ wt.double() + bias.double()).sigmoid()
    assert rel_l2(compiled(a, b, wt, bias), ref) < 1e-6


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.gpu
def test_linear_parts_on_cuda_against_float64():
    """FLUX single block's proj_out at a small token count: bf16 parts, the in-place accumulation on cuBLAS."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a, m = (torch.randn(300, k, device="cuda", generator=g, dtype=torch.bfloat16) for k in (256, 1024))
    wt = torch.randn(1280, 256, device="cuda", generator=g, dtype=torch.bfloat16) / 36
    bias = torch.randn(256, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.ops.omni_compile.linear_parts([a, m], wt, bias)
    ref = torch.cat([a, m], 1).double() @ wt.double() + bias.double()
    single = torch.addmm(bias, torch.cat([a, m], 1), wt)
    assert out.dtype == torch.bfloat16 and rel_l2(out, ref) < max(2 * rel_l2(single, ref), 1e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.compile
def test_through_inductor_on_flux_tiny(fresh_dynamo, no_inductor_cache):
    """The single block's proj_out becomes one linear_parts call; values as close to eager as without."""
    ref, without, out, records = with_and_without("flux-tiny", "64x64", "cat_gemm")
    assert {r.region: r.passes["cat_gemm"] for r in records} == {"FluxTransformerBlock": 0, "FluxSingleTransformerBlock": 1}
    assert rel_l2(out, ref) < max(2 * rel_l2(without, ref), 1e-2)
