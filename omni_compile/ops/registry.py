"""Registry of fused ops and how each is implemented on a platform.

Dispatch follows CustomOp semantics: every op has a native implementation (plain torch, so Inductor
can compile it); a platform-specific kernel is used where one exists for that platform. The build
report records which implementation each op resolved to and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omni_compile.platform import Platform


@dataclass(frozen=True)
class Resolution:
    op: str
    implementation: str  # "native" or a kernel name such as "triton"
    reason: str


@dataclass
class FusedOp:
    name: str
    # The torch custom op overload the passes emit, e.g. torch.ops.omni_compile.rms_norm.default.
    overload: object
    # Names of the op's arguments in schema order (tensors and constants alike).
    arg_names: tuple[str, ...]
    # Pure-torch implementation with the op's exact numerics; traceable by make_fx.
    native: Callable
    # Platform kind ("cuda", "rocm", "xpu", "cpu") -> (kernel name, implementation).
    kernels: dict[str, tuple[str, Callable]] = field(default_factory=dict)

    def resolve(self, platform: Platform) -> Resolution:
        kernel = self.kernels.get(platform.kind)
        if kernel is not None:
            return Resolution(self.name, kernel[0], f"{kernel[0]} kernel registered for {platform.kind}")
        return Resolution(
            self.name,
            "native",
            f"no {self.name} kernel for platform '{platform.kind}'; Inductor compiles the native implementation",
        )


FUSED_OPS: dict[str, FusedOp] = {}


def register_fused_op(op: FusedOp) -> FusedOp:
    assert op.name not in FUSED_OPS, f"fused op {op.name} registered twice"
    FUSED_OPS[op.name] = op
    return op
