"""The cat_gemm pass: a linear over `cat([a, b, ...], -1)` becomes one accumulating GEMM per part.

Pure linear algebra, so the values are checked on the CPU (the pass itself is on by default on GPUs
only) against eager and a float64 reference, on ATen graphs as Inductor's post-grad passes see them.
"""

import pytest
import torch
import torch.nn.functional as F

from omni_compile.passes.cat_gemm import CatGemmPass

from conftest import rel_l2
from test_passes import AtenGraph, targets


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
    assert len(gemms) == len(parts)
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
