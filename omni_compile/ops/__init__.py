"""Fused operators: torch custom ops with a fake implementation, a pure-torch native implementation,
and per-platform kernels (`omni_compile.ops.kernels`, Triton for CUDA and ROCm).

Importing this package registers every op under the `omni_compile` torch library namespace, and
every kernel that can be imported here.
"""

from omni_compile.ops.registry import (
    AUTO,
    FUSED_OPS,
    NATIVE,
    FusedOp,
    Implementation,
    Kernel,
    KernelUnavailableError,
    PairedLaunch,
    Resolution,
    implementations,
    register,
    select,
)
from omni_compile.ops import (  # noqa: F401  (register the ops)
    adaln,
    gated_residual,
    linear_parts,
    quant_rows,
    rms_norm,
    rms_norm_rope,
)
from omni_compile.ops import kernels  # noqa: F401,E402  (register the kernels)

__all__ = ["AUTO", "FUSED_OPS", "NATIVE", "FusedOp", "Implementation", "Kernel", "KernelUnavailableError", "PairedLaunch",
           "Resolution",
           "implementations", "register", "select"]
