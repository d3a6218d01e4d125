"""Kernel categories: one classification of kernel names for `inspect`'s kernel lists, its profile and
`bench/e2e.py --profile` (the table docs/benchmarks.md shows).

| key | what |
|---|---|
| `gemm` | cuBLAS/cuBLASLt/CUTLASS GEMMs, Inductor's GEMM templates, `aten::mm`/`addmm`/`bmm` on CPU |
| `attention` | cuDNN/flash/efficient/math SDPA kernels, our Triton and SAGE attention kernels |
| `fused_ops` | our fused-op kernels (rms_norm, rms_norm_rope and layer_norm_rope, adaln, adaln_quant, gated_residual, quant_rows) |
| `triton` | code Inductor generated: Triton kernels on GPUs, C++ kernels (`cpp_fused_*`) on the CPU |
| `copy` | memcpy / memset / copy kernels |
| `other` | everything else (elementwise ATen kernels, reductions outside Inductor, ...) |
"""

from __future__ import annotations

CATEGORIES = ("gemm", "attention", "fused_ops", "triton", "copy", "other")
LABELS = {
    "gemm": "GEMM",
    "attention": "attention",
    "fused_ops": "fused ops",
    "triton": "generated (Triton / C++)",
    "copy": "copies",
    "other": "other",
}

# The Triton kernels of our fused ops (omni_compile/ops/kernels/*.py).
FUSED_KERNEL_NAMES = ("_rms_norm_kernel", "_adaln_kernel", "_gated_residual_kernel", "_rms_norm_rope_kernel",
                      "_quant_rows_kernel")  # fmt: skip
# Our attention kernels (omni_compile/attention/triton_attn.py, sage.py).
ATTENTION_KERNEL_NAMES = ("_attention_kernel", "_sage_kernel", "_mean_kernel", "_quantize_kernel")

_GEMM = ("gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "cublas", "triton_tem_fused_mm", "triton_tem_fused_addmm",
         "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "extern_kernels.mm",
         "extern_kernels.addmm", "extern_kernels.bmm", "extern_kernels.baddbmm",
         "_mm_out", "_addmm_out", "_bmm_out")  # fmt: skip
_ATTENTION = ("attention", "flash", "fmha", "sdpa", "attn") + ATTENTION_KERNEL_NAMES
_COPY = ("memcpy", "memset", "aten::copy_", "aten::clone", "copy_kernel")


def kernel_category(name: str) -> str:
    """The category (a key of CATEGORIES) of a kernel or op called `name`."""
    low = name.lower()
    if any(k in low for k in _COPY):
        return "copy"
    if any(k in low for k in _ATTENTION):  # before GEMM: CUTLASS attention kernels are named fmha_cutlass*
        return "attention"
    if any(k in low for k in _GEMM):
        return "gemm"
    if "cudnn" in low:  # cuDNN's other kernels in a DiT step are its attention's
        return "attention"
    if any(k in low for k in FUSED_KERNEL_NAMES):
        return "fused_ops"
    if low.startswith(("triton", "cpp_fused", "cpp_", "graph_")) or "triton_" in low:
        return "triton"
    return "other"
