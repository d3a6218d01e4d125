"""What every model adapter provides: its regions, attention roles, and example inputs per bucket."""

from __future__ import annotations

import contextlib

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from omni_compile.config import ShapeBucket
from omni_compile.errors import ConfigError


class ModelAdapter:
    """Family-specific knowledge about one diffusers transformer class."""

    family: str = "generic"
    # Attention roles this family declares (used by per-role attention config).
    attention_roles: dict[str, str] = {}
    # Default text sequence length of the encoder hidden states fed to the transformer.
    default_text_len: int = 512

    def model_class(self) -> type[nn.Module]:
        raise NotImplementedError

    def attention_role(self, module_path: str) -> str:
        """The role of the attention module at `module_path` inside a block (e.g. 'attn1').

        Families with declared roles map their modules to them; otherwise the role is
        '<family>.<attribute name>', e.g. 'generic.attn1'.
        """
        return f"{self.family}.{module_path.rsplit('.', 1)[-1] or 'attn'}"

    def block_names(self, model: nn.Module) -> list[str]:
        return list(getattr(model, "_repeated_blocks", None) or [])

    def check_bucket(self, bucket: ShapeBucket) -> None:
        """Raise ConfigError if this family cannot take `bucket`."""

    def example_inputs(
        self,
        model: nn.Module,
        bucket: ShapeBucket,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        text_len: int | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def create(self, config: dict[str, Any], *, dtype: torch.dtype, device: torch.device | str, seed: int) -> nn.Module:
        """Build the model from `config` with seeded random weights."""
        torch.manual_seed(seed)
        cls = self.model_class()
        with torch.device(device):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(**config)
        with _quiet_diffusers():
            # Random-weight presets cast every module, as WORKLOADS.md's measurements did; diffusers
            # warns about its keep-in-fp32 list on `.to()`, which only matters for real checkpoints.
            model = model.to(dtype)
        return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    description: str
    config: dict[str, Any]
    default_shapes: str
    text_len: int
    default_dtype: str = "bf16"
    default_device: str = "cuda"


@dataclass
class ModelSpec:
    """A resolved MODEL argument: how to build it, and how to feed it."""

    source: str  # "preset:NAME", a directory, or "module:Class"
    adapter: ModelAdapter
    config: dict[str, Any] = field(default_factory=dict)
    text_len: int | None = None
    default_shapes: str | None = None
    default_dtype: str | None = None  # None: bf16 on an accelerator, fp32 on the CPU (build.session.BuildSession.resolve)
    default_device: str | None = None
    # Builds the module; takes (dtype, device, seed).
    loader: Callable[..., nn.Module] | None = None
    weights: str = "random"
    regions: list[str] | None = None  # block classes named by the user (--regions); None: the adapter's

    def block_names(self, model: nn.Module) -> list[str] | None:
        """The region classes to compile: --regions, else the adapter's (None: `find_regions` discovers them)."""
        return self.regions or self.adapter.block_names(model) or None

    def load(self, *, dtype: torch.dtype, device: str, seed: int = 0) -> nn.Module:
        if self.loader is not None:
            return self.loader(dtype=dtype, device=device, seed=seed)
        return self.adapter.create(self.config, dtype=dtype, device=device, seed=seed)


@contextlib.contextmanager
def _quiet_diffusers():
    from diffusers.utils import logging as dlogging

    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        yield
    finally:
        dlogging.set_verbosity(level)


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Random normal values drawn on the CPU (reproducible on every device), then moved."""
    return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)
