"""`omni_compile::quant_rows`: an optional activation, then e4m3 quantization with one scale per row.

    y = act(x)   (rounded to x.dtype, as the activation module returns it)
    s = max|y_row| / 448,   q = clamp(y / s, ±448) -> float8_e4m3fn

It is what an fp8 GEMM needs of its input (`omni_compile.ops.fp8.Fp8Linear` calls it on every input row),
as one op, so that one kernel reads the activation once and writes the e4m3 row and its scale. Left to
Inductor, the same computation is a looped reduction that reads the row twice (a max pass, then a
quantize pass), fused with the producer where it can be: on Wan's FFN (32760 x 8960 per block) that
GELU-and-quantize kernel alone took 1.19 ms a block on the H100 (run 17b).

`act`: "none", "gelu" (exact, erf) or "gelu_tanh". The `fp8_act` pass folds a GELU that feeds only
quantizations into the op (`act`), so the GELU's output is never written in bf16.

Numerical contract: the activation in fp32 from x, rounded to x.dtype; the row maximum of that rounded
value, in fp32, at least 1e-12 (a row of zeros quantizes to zeros); one fp32 division per element;
saturation at ±448; rounding to nearest even into e4m3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_compile.ops.registry import FusedOp, register_fused_op

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12  # a row of zeros gets a scale that maps it to zeros, not NaN
ACTS = ("none", "gelu", "gelu_tanh")


def quantize(t: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, fp32 scales) with one scale per slice over `dims` (kept as size 1 in the scales), the
    slice's largest magnitude mapped to 448: t ≈ q * scale."""
    amax = t.abs().amax(dim=dims, keepdim=True).float().clamp(min=TINY)
    scale = amax / FP8_MAX
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, fp32 [..., 1] scales), one scale per row (the last dimension)."""
    return quantize(t, -1)


def activate(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "none":
        return x
    if act not in ACTS:
        raise ValueError(f"quant_rows: act {act!r} is not one of {ACTS}")
    return F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none")


def quant_rows_native(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(activate(x, act))


@torch.library.custom_op("omni_compile::quant_rows", mutates_args=())
def quant_rows(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 act(x), fp32 [..., 1] row scales); see the module docstring."""
    return quant_rows_native(x, act)


@quant_rows.register_fake
def _quant_rows_fake(x, act):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


QUANT_ROWS = register_fused_op(
    FusedOp(
        name="quant_rows",
        overload=torch.ops.omni_compile.quant_rows.default,
        arg_names=("x", "act"),
        native=quant_rows_native,
    )
)
