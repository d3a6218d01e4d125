"""`omni_compile::linear_parts`: a linear over the concatenation of its input's parts, with no concatenation.

    linear_parts([x_0, ..., x_n], wt, bias) = cat([x_0, ..., x_n], -1) @ wt (+ bias)

`x_i` is [M, K_i] and `wt` the transposed weight, [sum K_i, N]. One GEMM per part reads its rows of `wt`
in place (a view; cuBLAS takes the full row as leading dimension). The first GEMM writes a fresh output
(with the bias, through cuBLASLt's bias epilogue where torch takes that path); every later part is
accumulated into it in place (`addmm_`, beta = 1). Written in ATen ops, the accumulation would be
`addmm(acc, x, w)`, which copies `acc` into a new output before the GEMM (FLUX-dev 1024²: 4608 x 3072 bf16
per single block, 0.63 ms per W1 step); inside this op nothing is copied.

Numerical contract: the sum of the parts' products, the partial sum rounded to the output dtype between
GEMMs (one rounding more than the single GEMM over the concatenation; lossless at bf16's bound).

Opaque to Inductor (a fallback kernel, like a GEMM): the pass `cat_gemm` makes it; the CPU, where that
pass does not run, can still run it (tests, and artifacts built for a GPU and inspected here).
"""

from __future__ import annotations

import torch


def linear_parts_native(xs: list[torch.Tensor], wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    acc, start = None, 0
    for x in xs:
        w = wt[start : start + x.shape[-1]]
        start += x.shape[-1]
        if acc is None:
            acc = torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
        else:
            acc.addmm_(x, w)
    return acc


def _check(xs: list[torch.Tensor], wt: torch.Tensor, bias: torch.Tensor | None) -> None:
    torch._check(len(xs) >= 1, lambda: "linear_parts needs at least one part")
    torch._check(wt.dim() == 2 and all(x.dim() == 2 for x in xs), lambda: "linear_parts takes 2-D parts and weight")
    torch._check(sum(x.shape[1] for x in xs) == wt.shape[0], lambda: "the parts' widths must add up to wt's rows")


@torch.library.custom_op("omni_compile::linear_parts", mutates_args=())
def linear_parts(xs: list[torch.Tensor], wt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`cat(xs, -1) @ wt (+ bias)`, one GEMM per part accumulating in place into the first one's output."""
    _check(xs, wt, bias)
    return linear_parts_native(xs, wt, bias)


@linear_parts.register_fake
def _linear_parts_fake(xs, wt, bias):
    _check(xs, wt, bias)
    return xs[0].new_empty((xs[0].shape[0], wt.shape[1]))
