"""Model adapters: one file per family, a generic adapter, presets and a registry."""

from omni_compile.models.base import ModelAdapter, ModelSpec, Preset
from omni_compile.models.registry import ADAPTERS, DEFAULT_MODEL, PRESETS, resolve_model

__all__ = ["ADAPTERS", "DEFAULT_MODEL", "PRESETS", "ModelAdapter", "ModelSpec", "Preset", "resolve_model"]
