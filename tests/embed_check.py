"""Run as a script (without TRITON_INTERPRET): lower the real block graphs of the tiny presets for a
CUDA platform with every pass and every Triton kernel, without running anything, and print what the
lowering produced as JSON. `test_embedding.py` checks it: this is the GPU lowering path, traced on CPU.
"""

import json
import sys
from collections import Counter

import torch

from omni_compile.config import CompileConfig
from omni_compile.passes import PassLog, PassManager
from omni_compile.platform import Platform

from test_fusion import CASES, _block_graph


def main() -> None:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

    from omni_compile.ops import FUSED_OPS

    fused = {op.overload for op in FUSED_OPS.values()}
    gpu = Platform("cuda", "traced only", (9, 0), torch.__version__, "3.6.0", "13.0", None)
    out = {}
    # every case, and Wan's block with fp8 GEMMs (its activations quantized by quant_rows, the FFN's GELU folded in)
    for preset, blocks, shape, fp8 in [(*case[:3], False) for case in CASES] + [("wan-tiny", "blocks", "64x64x5", True)]:
        gm, _, _ = _block_graph(preset, blocks, torch.bfloat16, shape, fp8=fp8)
        config = CompileConfig(passes=["all"], kernels={"*": "triton"}, weight_transforms=["fp8"] if fp8 else [])
        pm = PassManager(config, gpu)
        log = PassLog(f"{preset}/{blocks}")
        with pm.recording(log):
            pm(gm.graph)
        launches = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
        out[f"{preset}-{blocks}" + ("-fp8" if fp8 else "")] = {
            "resolutions": log.resolutions,
            "kernels": Counter(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in launches),
            "clones": sorted({c for n in launches for c in n.kwargs["tensors_to_clone"]}),
            # fused ops left as calls (none should be), and our other ops (GEMM compositions: extern calls)
            "omni_ops": sorted({str(n.target) for n in gm.graph.nodes if n.target in fused}),
            "extern_ops": sorted({str(n.target) for n in gm.graph.nodes
                                  if str(n.target).startswith("omni_compile") and n.target not in fused}),  # fmt: skip
        }
    out["pairing"] = pairing(gpu)
    json.dump(out, sys.stdout)


def pairing(gpu) -> dict:
    """Launches of small graphs of two `rms_norm_rope` calls, lowered for the GPU: (launches, paired calls)."""
    from omni_compile.passes.lower_fused_ops import LowerFusedOpsPass
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional
    from torch.fx.experimental.proxy_tensor import make_fx

    def rope(x, w, cos, sin):
        return torch.ops.omni_compile.rms_norm_rope(x, w, None, None, cos, sin, 1e-6, False, False, "per_element")

    def qk(q, k, wq, wk, cos, sin, cos2):
        return rope(q, wq, cos, sin), rope(k, wk, cos, sin)

    def qk_views(q, k, wq, wk, cos, sin, cos2):  # the tables through equal views, taken apart for q and k
        return rope(q, wq, cos.view(6, 8), sin.view(6, 8)), rope(k, wk, cos.view(6, 8), sin.view(6, 8))

    def k_needs_q(q, k, wq, wk, cos, sin, cos2):  # k's input reads q's output: no single launch can do both
        a = rope(q, wq, cos, sin)
        return a, rope(k + a, wk, cos, sin)

    def q_used_between(q, k, wq, wk, cos, sin, cos2):  # q's output is used (not only viewed) before k's call
        a = rope(q, wq, cos, sin)
        k = k * a.sum()
        return a, rope(k, wk, cos, sin)

    def q_viewed_between(q, k, wq, wk, cos, sin, cos2):  # views of q's output before k's call, views of k's input
        a = rope(q, wq, cos, sin).flatten(2).permute(0, 2, 1)  # after it: the pair stands where q's call was
        return a, rope(k.view(1, 6, 16).view(1, 6, 2, 8), wk, cos, sin) + 1

    def q_viewed_k_computed(q, k, wq, wk, cos, sin, cos2):  # k's input computed after views of q's output:
        a = rope(q, wq, cos, sin).flatten(2).permute(0, 2, 1)  # the views move down after k's call
        return a, rope(k * 2, wk, cos, sin)

    def q_used_k_computed(q, k, wq, wk, cos, sin, cos2):  # work on both sides: k's moves up before q's call
        a = rope(q, wq, cos, sin) * 3
        return a, rope(k * 2, wk, cos, sin)

    def k_random(q, k, wq, wk, cos, sin, cos2):  # random numbers on both sides: nothing moves
        a = torch.nn.functional.dropout(rope(q, wq, cos, sin), 0.5)
        return a, rope(torch.nn.functional.dropout(k, 0.5), wk, cos, sin)

    def other_tables(q, k, wq, wk, cos, sin, cos2):
        return rope(q, wq, cos, sin), rope(k, wk, cos2, sin)

    def three(q, k, wq, wk, cos, sin, cos2):  # two pair, the third stays alone
        return rope(q, wq, cos, sin), rope(k, wk, cos, sin), rope(q * 2, wk, cos, sin)

    g = torch.Generator().manual_seed(0)
    bf = {"dtype": torch.bfloat16}
    args = (torch.randn(1, 6, 2, 8, generator=g).to(**bf), torch.randn(1, 6, 2, 8, generator=g).to(**bf),
            torch.randn(8, generator=g).to(**bf), torch.randn(8, generator=g).to(**bf),
            torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))  # fmt: skip
    result = {}
    for fn in (qk, qk_views, k_needs_q, q_used_between, q_viewed_between, q_viewed_k_computed, q_used_k_computed,
               k_random, other_tables, three):  # fmt: skip
        for options in ({}, {"pair": False}):
            gm = make_fx(fn, tracing_mode="fake")(*args)
            lower = LowerFusedOpsPass(options, platform=gpu)
            lower.run(gm.graph)
            gm.graph.lint()
            launches = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
            entry = lower.resolutions["rms_norm_rope"]
            result[fn.__name__ + ("-nopair" if options else "")] = [len(launches), entry.get("paired", 0)]
    return result


if __name__ == "__main__":
    main()
