"""The adaln pass on the modulation forms DiTs write: LayerNorm or RMSNorm without affine parameters, then
`* (1 + scale)` with or without `+ shift`, scale/shift per sample or per token, or [B, D] broadcast after the
`1 +` (AdaLayerNormContinuous). ATen graphs as Inductor's post-grad passes see them (test_passes.AtenGraph);
values against eager and a float64 reference. Near misses stay untouched."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.normalization import RMSNorm

from omni_compile.config import CompileConfig

from conftest import rel_l2
from test_passes import AtenGraph, fired, run_passes, targets

ADALN = "omni_compile.adaln.default"
CONFIG = CompileConfig(passes=["-lower_fused_ops"])


def ln64(x, eps):
    xd = x.double()
    return (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)


def rms64(x, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def _forms():
    ln = lambda x: F.layer_norm(x, (x.shape[-1],), eps=1e-6)  # noqa: E731
    rms = RMSNorm(32, eps=1e-6, elementwise_affine=False)
    return {
        # name: (fn(x, scale, shift), reference(x64 fn), conditioning shape)
        "layer": (lambda x, a, b: ln(x) * (1 + a) + b, lambda x, a, b: ln64(x, 1e-6) * (1 + a.double()) + b.double(), "3d"),
        "layer-scale-only": (lambda x, a, b: ln(x) * (1 + a), lambda x, a, b: ln64(x, 1e-6) * (1 + a.double()), "3d"),
        "layer-continuous": (lambda x, a, b: ln(x) * (1 + a)[:, None, :] + b[:, None, :],
                             lambda x, a, b: ln64(x, 1e-6) * (1 + a.double())[:, None] + b.double()[:, None], "2d"),
        "rms": (lambda x, a, b: rms(x) * (1 + a) + b, lambda x, a, b: rms64(x, 1e-6) * (1 + a.double()) + b.double(), "3d"),
        "rms-scale-only": (lambda x, a, b: rms(x) * (1 + a), lambda x, a, b: rms64(x, 1e-6) * (1 + a.double()), "3d"),
        "rms-per-token": (lambda x, a, b: rms(x) * (1 + a) + b,
                          lambda x, a, b: rms64(x, 1e-6) * (1 + a.double()) + b.double(), "per-token"),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(_forms()))
def test_modulation_forms_become_one_adaln(form, dtype):
    fn, ref, cond = _forms()[form]
    x = torch.randn(2, 7, 32, dtype=dtype)
    shape = {"3d": (2, 1, 32), "2d": (2, 32), "per-token": (2, 7, 32)}[cond]
    a, b = torch.randn(*shape, dtype=dtype) * 0.5, torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        gm = AtenGraph(fn, x, a, b)
        eager = fn(x, a, b)
        log = run_passes(gm, CONFIG)
        assert fired(log).get("adaln") == 1, fired(log)
        assert ADALN in targets(gm) and "aten.rsqrt.default" not in targets(gm)
        fused = gm(x, a, b)
    assert fused.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_l2(fused, eager) < tol and rel_l2(fused, ref(x, a, b)) < tol


@pytest.mark.parametrize("case", ["rms-with-weight", "promoting-modulation", "scale-on-another-dim"])
def test_near_misses_are_left_alone(case):
    rms_w = RMSNorm(32, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        rms_w.weight.normal_()
    rms = RMSNorm(32, eps=1e-6, elementwise_affine=False)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    fns = {
        "rms-with-weight": (lambda x, a: rms_w(x) * (1 + a), torch.randn(2, 1, 32, dtype=torch.bfloat16)),
        # an fp32 scale on a bf16 norm promotes the result to fp32: not the op's contract
        "promoting-modulation": (lambda x, a: rms(x) * (1 + a), torch.randn(2, 1, 32)),
        "scale-on-another-dim": (lambda x, a: rms(x) * (1 + a), torch.randn(2, 7, 1, dtype=torch.bfloat16)),
    }  # fmt: skip
    fn, a = fns[case]
    with torch.no_grad():
        gm = AtenGraph(fn, x, a)
        before = fn(x, a)
        log = run_passes(gm, CONFIG)
        assert "adaln" not in fired(log) and ADALN not in targets(gm)
        assert rel_l2(gm(x, a), before) < 1e-6
