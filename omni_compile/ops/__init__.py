"""Fused operators: torch custom ops with a fake implementation, a pure-torch native implementation,
and (from the kernels issue on) per-platform kernels.

Importing this package registers every op under the `omni_compile` torch library namespace.
"""

from omni_compile.ops.registry import FUSED_OPS, FusedOp, Resolution
from omni_compile.ops import rms_norm  # noqa: F401  (registers the op)

__all__ = ["FUSED_OPS", "FusedOp", "Resolution"]
