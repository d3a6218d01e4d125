"""The fusion passes on the real block graphs of the tiny presets, lowered to the Triton kernels and
run on the CPU under the Triton interpreter (the kernels' CPU path; the GPU tests do the same on CUDA
through Inductor). Checks the kernel choice contract and that every fused op still equals eager.
"""

import pytest
import torch

from omni_compile.config import CompileConfig, ShapeBucket
from omni_compile.models import resolve_model
from omni_compile.ops import FUSED_OPS, KernelUnavailableError
from omni_compile.platform import current_platform

from conftest import rel_l2
from test_passes import AtenGraph, run_passes, targets

pytestmark = pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (CPU runs)"
)
CPU = current_platform("cpu")


def _block_graph(preset: str, block_attr: str, dtype: torch.dtype, shape: str, fp8: bool = False):
    """An ATen graph of the first block of `block_attr`, with the inputs the model feeds it (`fp8`: its Linears
    made fp8 GEMMs by the fp8 weight transform)."""
    spec = resolve_model(preset)
    model = spec.load(dtype=dtype, device="cpu", seed=0)
    if fp8:
        from omni_compile.weights import quantize_fp8

        quantize_fp8(model, list(getattr(model, block_attr)))
    inputs = spec.adapter.example_inputs(
        model, ShapeBucket.parse(shape), dtype=dtype, device="cpu", text_len=spec.text_len, seed=1
    )
    block = getattr(model, block_attr)[0]
    seen = {}

    def hook(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    args, kwargs = seen["call"]
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    others = {k: v for k, v in kwargs.items() if k not in names}
    flat = list(args) + [kwargs[k] for k in names]

    def fn(*values):
        out = block(*values[: len(args)], **dict(zip(names, values[len(args) :])), **others)
        return out if isinstance(out, tuple) else (out,)

    with torch.no_grad():
        eager = fn(*flat)
    return AtenGraph(fn, *flat), flat, eager


CASES = [
    ("flux-tiny", "transformer_blocks", "64x64", {"rms_norm_rope": 2, "adaln": 4, "gated_residual": 4}),
    ("flux-tiny", "single_transformer_blocks", "64x64", {"rms_norm_rope": 2, "adaln": 1, "gated_residual": 1}),
    ("wan-tiny", "blocks", "64x64x5", {"rms_norm": 2, "rms_norm_rope": 2, "adaln": 2, "gated_residual": 2}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset,blocks,shape,ops", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_blocks_with_triton_kernels_match_eager(preset, blocks, shape, ops, dtype):
    gm, inputs, eager = _block_graph(preset, blocks, dtype, shape)
    log = run_passes(gm, CompileConfig(passes=["all"], kernels={"*": "triton"}))
    # Every fused op resolved to its Triton kernel (called as its triton_op on CPU) and none is left generic.
    assert {op: r["count"] for op, r in log.resolutions.items()} == ops
    assert all(r["implementation"] == "triton (external call)" for r in log.resolutions.values())
    assert {t for t in targets(gm) if t.startswith("omni_compile.")} == {
        f"omni_compile.{op}_triton.default" for op in ops
    }
    with torch.no_grad():
        fused = gm(*inputs)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(fused, eager):
        assert rel_l2(a, b) < tol


def test_unsupported_input_for_a_required_kernel_is_an_error_and_auto_falls_back():
    op = FUSED_OPS["rms_norm_rope"]
    x = torch.empty(1, 4, 2, 7)  # odd head_dim: no interleaved pairs
    args = dict(
        x=x, weight=None, x_tail=None, weight_tail=None, cos=torch.empty(4, 7), sin=torch.empty(4, 7), eps=1e-6,
        cast_before_weight=False, across_heads=False, tables="per_element",
    )  # fmt: skip
    with pytest.raises(KernelUnavailableError, match="the triton kernel for rms_norm_rope was requested but cannot"):
        op.resolve(CPU, args, "triton")
    res = op.resolve(CPU, args, "auto")
    assert res.implementation == "native" and "not on cpu" in res.reason


def test_required_kernel_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(KernelUnavailableError, match=r"runs on cuda/rocm, not on cpu \(or set TRITON_INTERPRET=1"):
        FUSED_OPS["adaln"].resolve(CPU, None, "triton")
    assert FUSED_OPS["adaln"].resolve(CPU, None, "auto").implementation == "native"
