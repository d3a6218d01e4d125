"""The implementation registry: every op omni-compile lowers (the fused ops and attention) and the
implementations of each, with one selection path that the passes, build reports, `inspect` and the CLI
listings all read.

An `Implementation` is one way to run an op: the platforms it runs on, what it needs there (compute
capability, an installed package: `available`), what it needs of a call (dtype, head size, mask, layout:
`requirements`), its rank for automatic selection per platform kind (`priority`; absent: never automatic
there, only by name), whether it is lossy (never automatic) and, for an attention backend on a GPU, its
measured time per shape (`attention.measure`). Each implementation lives in a file of its own and joins
with one `register(...)` call: a fused-op kernel in `omni_compile/ops/kernels/`, an attention backend in
`omni_compile/attention/backends/`.

`select(op, platform, call)` is automatic selection for every op: walk the op's ranked implementations,
skip each whose checks fail with the reason, and take the first that runs (or, given a `measure`
function and several candidates, the fastest). A choice by name goes through `Implementation.check(...,
explicit=True)` and fails closed: the op's front end (`FusedOp.resolve`, `attention.select`) raises with
the reason, never falling back silently.

Fused ops follow CustomOp semantics: a native implementation (plain torch, which Inductor compiles and
fuses with its neighbours) runs everywhere and is ranked last; a platform kernel (a
`torch.library.triton_op` with the op's exact schema, which Inductor embeds in its generated code) ranks
above it on the platforms it has been verified on (`auto_on`). The choice per fused op is `auto`,
`native` or a kernel name such as `triton`; a named kernel that is missing or cannot take the inputs
raises `KernelUnavailableError` naming the reason.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_compile.errors import OmniCompileError
from omni_compile.platform import Platform

AUTO = "auto"
NATIVE = "native"
ALL_PLATFORMS = ("cuda", "rocm", "xpu", "cpu")


class KernelUnavailableError(OmniCompileError):
    """An explicitly requested kernel cannot serve this platform or these inputs."""


@dataclass(frozen=True)
class Resolution:
    """The implementation one call (or, with no call, one platform) of `op` resolved to, and why."""

    op: str
    implementation: str
    reason: str
    # (name, why) for every ranked implementation automatic selection passed over
    skipped: tuple[tuple[str, str], ...] = ()
    # a choice by measurement: the call's shape and each candidate's median ms (or why it was dropped)
    measured: tuple[str, dict[str, float | str]] | None = None


@dataclass(frozen=True, kw_only=True)
class Implementation:
    """One implementation of an op (module docstring)."""

    op: str
    name: str
    platforms: tuple[str, ...]  # platform kinds it runs on
    description: str = ""
    # platform kind -> rank in automatic selection (higher is tried first); absent: only when asked for by name
    priority: Mapping[str, int] = field(default_factory=dict)
    # Platform kinds on which automatic selection may take it once it is ranked there (None: wherever it is
    # ranked). A kernel joins `auto_on` for a platform once it has been verified end to end there (parity
    # in the compiled model and a measured gain over Inductor's own code); elsewhere it runs by name only.
    auto_on: tuple[str, ...] | None = None
    manual_reason: str = "not yet measured faster than Inductor's code on this platform"
    lossy: bool = False  # never chosen automatically
    interpretable: bool = False  # a Triton kernel that runs on CPU under TRITON_INTERPRET=1, when asked for by name
    min_capability: tuple[int, int] | None = None  # CUDA only
    # Platform-level requirements besides the kind and capability (a package that imports, cuDNN, Triton).
    available: Callable[[Platform], str | None] = lambda platform: None

    # ---------------------------------------------------------------- checks
    def requirements(self, platform: Platform, call: Any) -> str | None:
        """Why this implementation cannot take `call` (None when it can); per op kind."""
        return None

    def unavailable(self, platform: Platform, explicit: bool = False) -> str | None:
        """Why it cannot run on `platform` at all (None when it can). On the CPU a Triton kernel runs only
        under the interpreter and only when asked for by name: the interpreter is a correctness tool."""
        kind = platform.kind
        on_interpreter = kind == "cpu" and self.interpretable and explicit and os.environ.get("TRITON_INTERPRET") == "1"
        if kind not in self.platforms and not on_interpreter:
            hint = " (or set TRITON_INTERPRET=1 to run it on CPU for testing)" if kind == "cpu" and self.interpretable else ""
            return f"{self._runs_on()} on {'/'.join(self.platforms)}, not on {kind}{hint}"
        if not self._capable(platform):
            need = ".".join(map(str, self.min_capability))
            have = ".".join(map(str, platform.capability))
            return f"it needs compute capability {need} or newer; {platform.device_name} has {have}"
        return self.available(platform)

    def _runs_on(self) -> str:
        return "it runs"

    def _capable(self, platform: Platform) -> bool:
        return not (self.min_capability and platform.kind == "cuda" and platform.capability
                    and platform.capability < self.min_capability)  # fmt: skip

    def not_automatic(self, platform: Platform) -> str | None:
        """Why automatic selection may not take it on `platform`, though ranked there (None: it may)."""
        if self.lossy:
            return "lossy: used only when asked for by name"
        if self.auto_on is not None and platform.kind not in self.auto_on:
            return f"opt-in on {platform.kind} ({self.manual_reason}; {self.opt_in_hint()})"
        return None

    def opt_in_hint(self) -> str:
        return f"choose {self.name} by name"

    def selected_reason(self, platform: Platform, skipped: list[tuple[str, str]]) -> str:
        """Why automatic selection took this implementation (the build report's reason)."""
        return f"first of {platform.arch}'s preference list that runs this call"

    def check(self, platform: Platform, call: Any = None, explicit: bool = False) -> str | None:
        """None when this implementation can run `call` on `platform`, else the first failed requirement.
        `call` None checks the platform only; `explicit` is a choice by name (no automatic gate)."""
        why = self.unavailable(platform, explicit) or (None if explicit else self.not_automatic(platform))
        if why or call is None:
            return why
        return self.requirements(platform, call)


# ------------------------------------------------------------------ the registry

IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {}


def register(impl: Implementation) -> Implementation:
    """Add one implementation of `impl.op` (the one registration line of an implementation's file)."""
    impls = IMPLEMENTATIONS.setdefault(impl.op, {})
    assert impl.name not in impls, f"{impl.op} already has an implementation {impl.name!r}"
    assert impl.name != AUTO, f"implementation name {impl.name!r} is reserved"
    impls[impl.name] = impl
    return impl


def implementations(op: str) -> dict[str, Implementation]:
    """Name -> implementation of `op`, in registration order."""
    return IMPLEMENTATIONS.get(op, {})


def ranked(op: str, platform: Platform) -> list[Implementation]:
    """The implementations automatic selection tries for `op` on `platform`, best first: those ranked on its
    kind, not lossy, and within the GPU's compute capability."""
    impls = [i for i in implementations(op).values() if platform.kind in i.priority and not i.lossy and i._capable(platform)]
    return sorted(impls, key=lambda i: -i.priority[platform.kind])


def select(
    op: str,
    platform: Platform,
    call: Any = None,
    measure: Callable[[list[Implementation]], tuple[str, dict[str, float | str], str | None] | None] | None = None,
) -> Resolution:
    """Automatic selection (module docstring). `measure(capable)` -> (shape, times, fastest or None), or None
    when it cannot time this call; with a winner, the fastest capable implementation is taken."""
    skipped, capable = [], []
    for impl in ranked(op, platform):
        why = impl.check(platform, call)
        if why is None:
            capable.append(impl)
        else:
            skipped.append((impl.name, why))
    assert capable, f"no implementation of {op} can run on {platform.kind}: {skipped}"
    if measure is not None and len(capable) > 1:
        result = measure(capable)
        if result is not None and result[2] is not None:
            shape, times, best = result
            return Resolution(op, best, "fastest measured", tuple(skipped), (shape, times))
    first = capable[0]
    return Resolution(op, first.name, first.selected_reason(platform, skipped), tuple(skipped))


def needs_triton(platform: Platform) -> str | None:
    return None if platform.triton_version else "Triton is not installed (pip install triton)"


@dataclass(frozen=True)
class PairedLaunch:
    """A kernel's form that serves two calls of its op in one launch. The calls pass the same values for every
    argument but `own` (the same graph nodes, equal constants), as the q and k of one attention do with their
    rotary tables, which the launch then reads once. `launcher` and `supports` take the first call's arguments
    by name, and the second call's `own` arguments under the names in `second`; `launcher` returns both
    outputs, `supports` None when one launch serves both calls, else the reason."""

    own: tuple[str, ...]
    second: tuple[str, ...]
    launcher: Callable
    supports: Callable[..., str | None]


@dataclass(frozen=True, kw_only=True)
class Kernel(Implementation):
    """A platform kernel of a fused op: a Triton kernel behind a `triton_op` with the op's exact schema."""

    # The op overload Inductor calls, with the same schema as the fused op (a triton_op for Triton kernels).
    overload: object = None
    # supports(**op_args) -> None when the kernel handles these inputs (real or fake tensors), else the reason.
    supports: Callable[..., str | None] = lambda **_: None
    interpretable: bool = True
    # The plain launcher behind `overload` (allocates outputs, launches through wrap_triton); the lowering
    # traces it under functionalization so Inductor embeds the Triton kernels. None: call `overload`.
    launcher: Callable | None = None
    # Two calls in one launch, where the lowering finds calls that share all but `pair.own` (None: none).
    pair: PairedLaunch | None = None
    priority: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(ALL_PLATFORMS, 10))
    auto_on: tuple[str, ...] | None = ()
    available: Callable[[Platform], str | None] = needs_triton

    def requirements(self, platform: Platform, call: Any) -> str | None:
        return self.supports(**call)

    def _runs_on(self) -> str:
        return f"the {self.name} kernel runs"

    def opt_in_hint(self) -> str:
        return f"use kernels {self.op}={self.name}"

    def selected_reason(self, platform: Platform, skipped: list[tuple[str, str]]) -> str:
        return f"{self.name} kernel for {platform.kind}"


@dataclass(frozen=True, kw_only=True)
class Native(Implementation):
    """A fused op's pure-torch implementation: runs everywhere, ranked last; Inductor compiles it."""

    platforms: tuple[str, ...] = ALL_PLATFORMS
    priority: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(ALL_PLATFORMS, 0))

    def selected_reason(self, platform: Platform, skipped: list[tuple[str, str]]) -> str:
        reason = "; ".join(f"{n}: {why}" for n, why in skipped) if skipped else f"no {self.op} kernel is registered"
        return f"{reason}; Inductor compiles the native implementation"


@dataclass
class FusedOp:
    name: str
    # The torch custom op overload the passes emit, e.g. torch.ops.omni_compile.rms_norm.default.
    overload: object
    # Names of the op's arguments in schema order (tensors and constants alike).
    arg_names: tuple[str, ...]
    # Pure-torch implementation with the op's exact numerics; traceable by make_fx.
    native: Callable

    @property
    def kernels(self) -> dict[str, Kernel]:
        """Name -> the platform kernels registered for this op."""
        return {n: i for n, i in implementations(self.name).items() if isinstance(i, Kernel)}

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
            why = kernel.check(platform, args, explicit=True)
            if why:
                raise KernelUnavailableError(
                    f"the {choice} kernel for {self.name} was requested but cannot be used: {why}. "
                    f"Use kernels {self.name}=auto (falls back to native) or {self.name}=native."
                )
            return Resolution(self.name, kernel.name, f"{kernel.name} kernel requested")
        return select(self.name, platform, args)


FUSED_OPS: dict[str, FusedOp] = {}


def register_fused_op(op: FusedOp) -> FusedOp:
    """Register a fused op and its native implementation."""
    assert op.name not in FUSED_OPS, f"fused op {op.name} registered twice"
    FUSED_OPS[op.name] = op
    register(Native(op=op.name, name=NATIVE, description="plain torch, compiled and fused by Inductor"))
    return op


def register_kernel(op_name: str, kernel: Kernel) -> Kernel:
    """Register a platform kernel of the fused op `op_name` (`kernel.op` is set to it)."""
    assert op_name in FUSED_OPS, f"register the fused op {op_name} before its kernels"
    assert kernel.name != NATIVE, f"kernel name {kernel.name!r} is reserved"
    if kernel.op != op_name:
        kernel = dataclasses.replace(kernel, op=op_name)
    register(kernel)
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
