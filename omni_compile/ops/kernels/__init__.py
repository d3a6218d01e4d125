"""Platform kernels of the fused ops. Each module registers its kernels where a Triton kernel can run: with
Triton installed, on a machine with a CUDA or ROCm GPU, or under Triton's interpreter (TRITON_INTERPRET=1, the
CPU tests). Registering one defines a `triton_op`, which imports Inductor (0.9 s on a 2-core CPU): a CPU-only
machine without the interpreter, where none of them could run, skips that, which keeps loading a CPU artifact
(a server's start) fast; `SKIPPED` says why, and an explicit kernel choice there names it."""

import os

import torch

SKIPPED: str | None = None  # why no kernel was registered here (None: they were)

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - Triton is a dependency on Linux
    SKIPPED = "Triton is not installed (pip install triton)"
else:
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        from omni_compile.ops.kernels import adaln, gated_residual, quant_rows, rms_norm, rms_norm_rope  # noqa: F401
    else:
        SKIPPED = ("the Triton kernels run on a CUDA or ROCm GPU and this machine has none; TRITON_INTERPRET=1 runs "
                   "them on the CPU for testing")  # fmt: skip
