"""Registry of fused ops and how each is implemented on a platform.

Dispatch follows CustomOp semantics. Every op has a native implementation (plain torch, so Inductor
can compile it and fuse it with its neighbours); a platform kernel (a `torch.library.triton_op`
with the op's exact schema, so Inductor embeds the Triton kernel in its generated code) is used where
one is registered for the platform and supports the call's inputs.

The choice per op is `auto` (the kernel where it can run, else native, with the reason recorded),
`native`, or a kernel name such as `triton`. A kernel asked for by name fails closed: if it is
missing for the platform or does not support the inputs (dtype, head_dim, layout), resolution
raises `KernelUnavailableError` naming the reason; it never falls back silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_compile.errors import OmniCompileError
from omni_compile.platform import Platform

AUTO = "auto"
NATIVE = "native"


class KernelUnavailableError(OmniCompileError):
    """An explicitly requested kernel cannot serve this platform or these inputs."""


@dataclass(frozen=True)
class Resolution:
    op: str
    implementation: str  # "native" or a kernel name such as "triton"
    reason: str


@dataclass(frozen=True)
class Kernel:
    """One platform implementation of a fused op."""

    name: str  # "triton"
    # Platform kinds it runs on ("cuda", "rocm", "xpu"); "cpu" is added at run time under TRITON_INTERPRET=1.
    platforms: tuple[str, ...]
    # The op overload Inductor calls, with the same schema as the fused op (a triton_op for Triton kernels).
    overload: object
    # supports(**op_args) -> None when the kernel handles these inputs (real or fake tensors), else the reason.
    supports: Callable[..., str | None] = lambda **_: None
    interpretable: bool = True  # runs on CPU tensors under TRITON_INTERPRET=1
    # Platform kinds on which automatic selection may pick it. A kernel is auto-selected on a platform
    # once it has been verified end to end there through the pass lowering (parity in the compiled
    # model and a measured gain over Inductor's own code); elsewhere it runs only when asked for by name.
    auto_on: tuple[str, ...] = ()
    # Why it is not auto-selected where `auto_on` leaves it out (shown in the build report).
    manual_reason: str = "not yet measured faster than Inductor's code on this platform"
    # The plain launcher behind `overload` (allocates outputs, launches through wrap_triton); the lowering
    # traces it under functionalization so Inductor embeds the Triton kernels. None: call `overload`.
    launcher: Callable | None = None

    def not_automatic(self, op: str, platform: Platform) -> str | None:
        """Why automatic selection skips this kernel on `platform` (None when it may pick it)."""
        if platform.kind in self.auto_on:
            return None
        return f"opt-in on {platform.kind} ({self.manual_reason}; use kernels {op}={self.name})"

    def unavailable(self, platform: Platform, explicit: bool = False) -> str | None:
        """Why this kernel cannot run on `platform` at all (None when it can).

        On CPU a Triton kernel runs only under the interpreter, and only when asked for by name:
        the interpreter is a correctness tool, so automatic selection never picks it.
        """
        if platform.kind in self.platforms:
            if platform.triton_version is None:
                return "Triton is not installed (pip install triton)"
            return None
        if platform.kind == "cpu" and self.interpretable and explicit and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        hint = (
            " (or set TRITON_INTERPRET=1 to run it on CPU for testing)" if platform.kind == "cpu" and explicit else ""
        )
        return f"the {self.name} kernel runs on {'/'.join(self.platforms)}, not on {platform.kind}{hint}"


@dataclass
class FusedOp:
    name: str
    # The torch custom op overload the passes emit, e.g. torch.ops.omni_compile.rms_norm.default.
    overload: object
    # Names of the op's arguments in schema order (tensors and constants alike).
    arg_names: tuple[str, ...]
    # Pure-torch implementation with the op's exact numerics; traceable by make_fx.
    native: Callable
    kernels: dict[str, Kernel] = field(default_factory=dict)

    def resolve(self, platform: Platform, args: dict | None = None, choice: str = AUTO) -> Resolution:
        """The implementation of this op for `platform` and the call's `args` (name -> value/FakeTensor).

        `choice` is `auto`, `native` or a kernel name; a named kernel that cannot serve raises.
        """
        if choice == NATIVE:
            return Resolution(self.name, NATIVE, "native implementation requested")
        if choice != AUTO:
            kernel = self.kernels.get(choice)
            if kernel is None:
                valid = ", ".join([AUTO, NATIVE, *self.kernels])
                raise KernelUnavailableError(f"fused op {self.name!r} has no {choice!r} kernel; choose one of: {valid}")
            why = kernel.unavailable(platform, explicit=True) or (kernel.supports(**args) if args is not None else None)
            if why:
                raise KernelUnavailableError(
                    f"the {choice} kernel for {self.name} was requested but cannot be used: {why}. "
                    f"Use kernels {self.name}=auto (falls back to native) or {self.name}=native."
                )
            return Resolution(self.name, kernel.name, f"{kernel.name} kernel requested")
        skipped = []
        for kernel in self.kernels.values():
            why = (
                kernel.unavailable(platform)
                or kernel.not_automatic(self.name, platform)
                or (kernel.supports(**args) if args is not None else None)
            )
            if why is None:
                return Resolution(self.name, kernel.name, f"{kernel.name} kernel for {platform.kind}")
            skipped.append(f"{kernel.name}: {why}")
        reason = "; ".join(skipped) if skipped else f"no {self.name} kernel is registered"
        return Resolution(self.name, NATIVE, f"{reason}; Inductor compiles the native implementation")


FUSED_OPS: dict[str, FusedOp] = {}


def register_fused_op(op: FusedOp) -> FusedOp:
    assert op.name not in FUSED_OPS, f"fused op {op.name} registered twice"
    FUSED_OPS[op.name] = op
    return op


def register_kernel(op_name: str, kernel: Kernel) -> Kernel:
    op = FUSED_OPS[op_name]
    assert kernel.name not in (AUTO, NATIVE), f"kernel name {kernel.name!r} is reserved"
    assert kernel.name not in op.kernels, f"{op_name} already has a {kernel.name} kernel"
    op.kernels[kernel.name] = kernel
    return kernel


def parse_kernel_items(text: str) -> dict[str, str]:
    """'rms_norm=triton, *=native' (the OMNI_COMPILE_KERNELS / --kernels syntax) -> {op: impl}."""
    from omni_compile.errors import ConfigError

    items = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ConfigError(f"kernel choice {item!r} must look like OP=IMPL, e.g. rms_norm=triton or *=native")
        op, impl = (t.strip() for t in item.split("=", 1))
        items[op] = impl
    return items


def parse_kernel_choices(choices: dict[str, str] | None, override: str | None = None) -> dict[str, str]:
    """Validate per-op implementation choices ('op' or '*' -> 'auto' | 'native' | kernel name).

    `override` ('rms_norm=triton,*=native', from OMNI_COMPILE_KERNELS or --kernels) applies on top.
    Returns the choice for every registered op.
    """
    from omni_compile.errors import ConfigError

    merged = {**(choices or {}), **parse_kernel_items(override or "")}
    resolved = {name: AUTO for name in FUSED_OPS}
    if "*" in merged:
        impl = merged.pop("*")
        if impl not in (AUTO, NATIVE) and not any(impl in op.kernels for op in FUSED_OPS.values()):
            raise ConfigError(
                f"kernel choice '*={impl}': no fused op has a {impl!r} kernel; use auto, native or triton"
            )
        for name, op in FUSED_OPS.items():
            # '*' asks for a kernel only where the op has one; an op without it keeps auto.
            resolved[name] = impl if impl in (AUTO, NATIVE) or impl in op.kernels else AUTO
    for name, impl in merged.items():
        if name not in FUSED_OPS:
            raise ConfigError(f"kernel choice for unknown fused op {name!r}; fused ops are {', '.join(FUSED_OPS)}")
        valid = [AUTO, NATIVE, *FUSED_OPS[name].kernels]
        if impl not in valid:
            raise ConfigError(f"kernel choice {name}={impl!r} is not valid; choose one of {', '.join(valid)}")
        resolved[name] = impl
    return resolved
