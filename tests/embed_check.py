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
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
