"""Choosing the attention backend of a role.

- An explicit choice (config, `--attention-backend`, OMNI_COMPILE_ATTENTION_BACKEND) fails closed:
  if the backend cannot run this platform, shape, dtype or mask, `AttentionBackendError` names the
  backend, the role, where the choice came from, the failed requirement and what to do. It never
  switches silently.
- `auto` is the implementation registry's selection (`omni_compile.ops.registry.select`, the same path as
  the fused ops'): walk `preference(platform)`, skip each backend whose checks fail, take the first that
  runs or, on a CUDA GPU, the fastest measured (`attention.measure`); the chosen backend is logged with
  the reason for every skip.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omni_compile.attention.backends import BACKENDS, AttentionCall, preference
from omni_compile.attention.backends.base import OP
from omni_compile.attention.config import AttentionConfig, BackendChoice
from omni_compile.errors import OmniCompileError
from omni_compile.ops.registry import select
from omni_compile.platform import Platform

logger = logging.getLogger("omni_compile.attention")


class AttentionBackendError(OmniCompileError):
    """An explicitly selected attention backend cannot serve this platform or call."""


@dataclass(frozen=True)
class AttentionResolution:
    role: str
    backend: str
    reason: str
    source: str
    skipped: tuple[tuple[str, str], ...] = ()
    # A measured choice: the call's shape and each candidate's median ms (or why it was dropped).
    measured: tuple[str, dict[str, float | str]] | None = None

    def describe(self) -> str:
        text = f"Resolved attention backend {self.backend!r} for role={self.role!r} via {self.source}"
        if self.measured:
            shape, times = self.measured
            text += f", fastest measured on {shape}: " + ", ".join(
                f"{n} {t:.3f} ms" if isinstance(t, float) else f"{n} dropped ({t})" for n, t in times.items()
            )
        if self.skipped:
            text += " (skipped " + "; ".join(f"{n}: {why}" for n, why in self.skipped) + ")"
        return text


def _working_alternatives(platform: Platform, call: AttentionCall | None, exclude: str) -> list[str]:
    return [
        name
        for name in preference(platform)
        if name != exclude and BACKENDS[name].check(platform, call) is None
    ]


def resolve_choice(
    choice: BackendChoice, role: str, platform: Platform, call: AttentionCall | None = None, measure: bool = False
) -> AttentionResolution:
    """The backend for one call of `role` (call None: only platform-level requirements are checked).
    `measure` (auto on a CUDA GPU, a call of known shape): time the capable backends and take the fastest."""
    if choice.explicit:
        backend = BACKENDS[choice.backend]
        why = backend.check(platform, call, explicit=True)
        if why:
            others = _working_alternatives(platform, call, backend.name)
            fix = f"choose {' or '.join(others)}, or auto" if others else "choose auto"
            raise AttentionBackendError(
                f"attention backend {backend.name} was explicitly selected for role {role!r} via {choice.source} "
                f"but cannot be used: {why}. {fix[0].upper() + fix[1:]}."
            )
        return AttentionResolution(role, backend.name, "explicitly selected", choice.source)
    timer = _timer(call) if measure and platform.kind == "cuda" and call is not None else None
    res = select(OP, platform, call, timer)
    return AttentionResolution(role, res.implementation, res.reason, choice.source, res.skipped, res.measured)


def _timer(call: AttentionCall):
    """measure(capable) for the registry's selection: time the capable backends on the call's shape."""
    from omni_compile.attention import measure as m

    shape = m.Shape.of(call, "cuda")
    if shape is None:
        return None

    def timer(capable):
        times = m.measure(tuple(i.name for i in capable), shape)
        return shape.describe(), times, m.fastest(times)

    return timer


def resolve(
    config: AttentionConfig, role: str, platform: Platform, call: AttentionCall | None = None, measure: bool = False
) -> AttentionResolution:
    resolution = resolve_choice(config.for_role(role), role, platform, call, measure)
    logger.info("%s", resolution.describe())
    return resolution


def check_explicit_choices(config: AttentionConfig, platform: Platform) -> None:
    """Fail before anything loads when an explicit choice cannot run on this platform at all."""
    for role, choice in config.choices():
        if choice.explicit:
            resolve_choice(choice, role or "default", platform, None)
