"""Attention configuration: a default backend choice and per-role overrides.

    {"default": {"backend": "CUDNN_ATTN"}, "per_role": {"wan.cross": {"backend": "TORCH_SDPA"}}}

or the same as dotted items, `default.backend=CUDNN_ATTN,per_role.wan.cross.backend=TORCH_SDPA`.
A `per_role` entry replaces the whole default for its role: it inherits nothing from it. The backend
`auto` (the default) walks the platform's preference list. OMNI_COMPILE_ATTENTION_BACKEND, when set,
replaces `default.backend` (the CLI's `--attention-backend` does the same through the config).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from omni_compile import envs
from omni_compile.attention.backends import BACKENDS
from omni_compile.errors import ConfigError

AUTO = "auto"


def backend_name(name: Any, where: str) -> str:
    """Validate a backend name ('auto' or a registered backend, omni_compile/attention/backends/; any case)."""
    names = ", ".join(BACKENDS)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: the attention backend must be a name; choose auto or one of {names}")
    text = name.strip()
    if text.lower() == AUTO:
        return AUTO
    if text.upper() not in BACKENDS:
        raise ConfigError(f"{where}: unknown attention backend {text!r}; choose auto or one of {names}")
    return text.upper()


@dataclass(frozen=True)
class BackendChoice:
    """The attention settings of one role (or of the default)."""

    backend: str = AUTO
    # Where this choice came from, for logs and errors (not part of the hash).
    source: str = field(default="attention_config.default", compare=False)

    @property
    def explicit(self) -> bool:
        return self.backend != AUTO

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "BackendChoice":
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be an object like {{\"backend\": \"CUDNN_ATTN\"}}, not {data!r}")
        unknown = sorted(set(data) - {"backend"})
        if unknown:
            raise ConfigError(f"{where} has unknown key(s) {unknown}; the only key is 'backend'")
        return cls(backend_name(data.get("backend", AUTO), f"{where}.backend"), source=where)


@dataclass(frozen=True)
class AttentionConfig:
    default: BackendChoice = field(default_factory=BackendChoice)
    per_role: dict[str, BackendChoice] = field(default_factory=dict)
    # `auto` on a CUDA GPU times the capable backends on each call's shape and takes the fastest
    # (attention.measure); False: the first capable backend of the platform's preference list.
    measure: bool = True

    def for_role(self, role: str) -> BackendChoice:
        """The choice for `role`: its per_role entry if any (inheriting nothing), else the default."""
        return self.per_role.get(role, self.default)

    def choices(self) -> list[tuple[str | None, BackendChoice]]:
        return [(None, self.default), *self.per_role.items()]

    def to_json(self) -> dict[str, Any]:
        return {
            "default": {"backend": self.default.backend},
            "per_role": {role: {"backend": c.backend} for role, c in sorted(self.per_role.items())},
            "measure": self.measure,
        }

    @classmethod
    def from_json(cls, data: Any) -> "AttentionConfig":
        if data in (None, {}):
            return cls()
        if not isinstance(data, dict):
            raise ConfigError(f"attention config must be an object with 'default' and/or 'per_role', not {data!r}")
        unknown = sorted(set(data) - {"default", "per_role", "measure"})
        if unknown:
            raise ConfigError(
                f"attention config has unknown key(s) {unknown}; valid keys are ['default', 'per_role', 'measure']"
            )
        measure = data.get("measure", True)
        if not isinstance(measure, bool):
            raise ConfigError(f"attention_config.measure must be true or false, not {measure!r}")
        default = BackendChoice.from_dict(data.get("default", {}), "attention_config.default")
        per_role_raw = data.get("per_role", {})
        if not isinstance(per_role_raw, dict):
            raise ConfigError("attention_config.per_role must map role names to {\"backend\": ...}")
        per_role = {
            role: BackendChoice.from_dict(v, f"attention_config.per_role[{role!r}]") for role, v in per_role_raw.items()
        }
        return cls(default, per_role, measure)

    def with_env(self) -> "AttentionConfig":
        """This config with OMNI_COMPILE_ATTENTION_BACKEND applied over the default's backend."""
        name = envs.attention_backend()
        if not name:
            return self
        choice = BackendChoice(backend_name(name, "OMNI_COMPILE_ATTENTION_BACKEND"), "OMNI_COMPILE_ATTENTION_BACKEND")
        return dataclasses.replace(self, default=choice)


def parse_attention_text(text: str) -> dict[str, Any]:
    """JSON (`{"default": ...}`) or dotted items (`default.backend=X,per_role.wan.cross.backend=Y`) -> JSON form."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"attention config is not valid JSON ({e}): {text!r}") from None
        AttentionConfig.from_json(data)  # validate now, with the user's spelling in the error
        return data
    data: dict[str, Any] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if key.strip() == "measure" and eq:
            if value.strip().lower() not in ("true", "false"):
                raise ConfigError(f"attention item {item!r}: measure takes true or false")
            data["measure"] = value.strip().lower() == "true"
            continue
        parts = key.strip().split(".")
        if not eq or len(parts) < 2 or parts[-1] != "backend" or parts[0] not in ("default", "per_role"):
            raise ConfigError(
                f"attention item {item!r} must look like default.backend=NAME, per_role.ROLE.backend=NAME or "
                "measure=true|false "
                "(e.g. per_role.wan.cross.backend=TORCH_SDPA)"
            )
        if parts[0] == "default":
            if len(parts) != 2:
                raise ConfigError(f"attention item {item!r}: the default takes only default.backend=NAME")
            data.setdefault("default", {})["backend"] = value.strip()
        else:
            role = ".".join(parts[1:-1])
            if not role:
                raise ConfigError(f"attention item {item!r} names no role: per_role.ROLE.backend=NAME")
            data.setdefault("per_role", {}).setdefault(role, {})["backend"] = value.strip()
    AttentionConfig.from_json(data)
    return data


def merge_attention(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base` (JSON forms): its default replaces base's default, its roles replace base's roles."""
    out = {k: v for k, v in base.items()}
    if "default" in extra:
        out["default"] = extra["default"]
    if "per_role" in extra:
        out["per_role"] = {**base.get("per_role", {}), **extra["per_role"]}
    if "measure" in extra:
        out["measure"] = extra["measure"]
    return out


def check_roles(config: AttentionConfig, roles: dict[str, str], family: str) -> None:
    """A per_role entry must name a role the model declares (families without declared roles: any)."""
    if not roles:
        return
    unknown = sorted(set(config.per_role) - set(roles))
    if unknown:
        raise ConfigError(
            f"attention_config.per_role names unknown role(s) {unknown} for {family}; its roles are {', '.join(roles)}"
        )
