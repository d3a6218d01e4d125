"""Complex products of real pairs in real arithmetic: the complex form of RoPE, without complex tensors.

Matches `view_as_real(view_as_complex(xr) * f)`, in either operand order: a real tensor `xr` whose last
dimension holds (real, imaginary) pairs, viewed as complex, multiplied by a complex tensor `f` that
broadcasts against it, and viewed back as real. This is the complex form of the rotary embedding (the
original RoFormer/LLaMA `freqs_cis` spelling): Qwen-Image's `apply_rotary_emb_qwen(..., use_real=False)`,
Lumina2's, and any model that rotates q/k with `torch.view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`.
Inductor generates no code for complex operators: it runs the product as an eager fallback (a warning
says so), outside the kernels around it. The rewrite computes the same product on the real pairs,

    (a + ib)(c + is) = (ac - bs) + i(as + bc)      with c, s read from `view_as_real(f)` (a view)

so the rotation fuses with the norm before it and the layout change after it. The values are those of
the complex multiply (the same four products and two sums in the same precision). Rewritten only when
the product feeds nothing but the `view_as_real` and `xr` is a real floating tensor with pairs last.
"""

from __future__ import annotations

import torch

from omni_compile.passes.base import OmniPass, _source
from omni_compile.passes.lower_fused_ops import splice_body

aten = torch.ops.aten


def real_product(xr: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """`view_as_real(view_as_complex(xr) * f)` computed on the real pairs."""
    return real_product_of_pairs(xr, torch.view_as_real(f))


def real_product_of_pairs(xr: torch.Tensor, fr: torch.Tensor) -> torch.Tensor:
    """The complex product of the (real, imaginary) pairs in the last dimension of `xr` and `fr`."""
    a, b = xr[..., 0], xr[..., 1]
    c, s = fr[..., 0], fr[..., 1]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1)


class ComplexMulPass(OmniPass):
    """Rewrites `view_as_real(view_as_complex(xr) * f)` (complex RoPE) into real arithmetic."""

    name = "complex_mul"

    def __init__(self, options=None):
        super().__init__(options)
        self._extra_sources.extend([_source(real_product), _source(real_product_of_pairs)])

    def apply(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.view_as_real.default]:
            count += self._rewrite(node)
        return count

    def _rewrite(self, node: torch.fx.Node) -> int:
        prod = node.args[0]
        if not isinstance(prod, torch.fx.Node) or prod.target is not aten.mul.Tensor or len(prod.users) != 1:
            return 0
        for cplx, f in (prod.args, prod.args[::-1]):
            if not (isinstance(cplx, torch.fx.Node) and cplx.target is aten.view_as_complex.default):
                continue
            if not isinstance(f, torch.fx.Node) or not f.meta["val"].is_complex():
                continue
            xr = cplx.args[0]
            xv = xr.meta["val"]
            if not xv.is_floating_point() or xv.dim() == 0 or xv.shape[-1] != 2:
                continue
            splice_body(node, {"xr": xr, "f": f}, real_product)
            return 1
        return 0
