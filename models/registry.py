"""Model registry: presets, adapters by diffusers class, and resolution of a MODEL argument."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from omni_compile.errors import ConfigError
from omni_compile.models import flux, wan
from omni_compile.models.base import ModelAdapter, ModelSpec, Preset
from omni_compile.models.generic import GenericAdapter

ADAPTERS: dict[str, ModelAdapter] = {"flux": flux.FluxAdapter(), "wan": wan.WanAdapter()}
ADAPTER_BY_CLASS = {"FluxTransformer2DModel": "flux", "WanTransformer3DModel": "wan"}
PRESETS: dict[str, Preset] = {p.name: p for p in [*flux.PRESETS, *wan.PRESETS]}
DEFAULT_MODEL = "flux-tiny"


def import_object(ref: str, what: str) -> Any:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {ref!r} is not of the form module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {module_name!r} for {what} {ref!r}: {e}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r} ({what} {ref!r})") from None
    return obj


def check_config_keys(cls: type, config: dict[str, Any], what: str) -> None:
    """Refuse keys of `config` that `cls.__init__` does not take (diffusers would warn and drop them, and
    the build would run for minutes on a config the user did not mean)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = sorted(k for k in params if k != "self")
    unknown = sorted(k for k in config if k not in params or k == "self")
    if unknown:
        raise ConfigError(
            f"{what}: {cls.__name__} takes no config key(s) {', '.join(map(repr, unknown))}; "
            f"its keys are {', '.join(known)}"
        )


def resolve_model(
    model: str | None,
    *,
    example_inputs: str | None = None,
    model_config: dict[str, Any] | None = None,
    regions: list[str] | None = None,
) -> ModelSpec:
    """Resolve a preset name, a local diffusers directory, or `module:Class` into a ModelSpec. `regions`: the
    block classes to compile (default: the model's `_repeated_blocks`, else its lists of identical blocks)."""
    spec = _resolve(model, example_inputs, model_config)
    if regions:
        spec.regions = list(regions)
    return spec


def _resolve(model: str | None, example_inputs: str | None, model_config: dict[str, Any] | None) -> ModelSpec:
    model = model or DEFAULT_MODEL
    inputs_fn = import_object(example_inputs, "--example-inputs") if example_inputs else None
    if model in PRESETS:
        p = PRESETS[model]
        check_config_keys(ADAPTERS[p.family].model_class(), model_config or {}, "--model-config")
        config = {**p.config, **(model_config or {})}
        return ModelSpec(
            source=f"preset:{p.name}",
            adapter=ADAPTERS[p.family],
            config=config,
            text_len=p.text_len,
            default_shapes=p.default_shapes,
            default_dtype=p.default_dtype,
            default_device=p.default_device,
            weights="random",
        )
    path = Path(model)
    if path.exists():
        if model_config:
            raise ConfigError(
                f"--model-config applies to presets and module:Class; the directory {path} has its own config.json "
                "(edit that, or build module:Class with --model-config)"
            )
        return _local_directory(path, inputs_fn)
    if ":" in model:
        return _model_class(model, inputs_fn, model_config or {})
    raise ConfigError(
        f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}), not an existing directory, "
        "and not module:Class; run `omni-compile models` to list presets"
    )


def _model_class(ref: str, inputs_fn, config: dict[str, Any]) -> ModelSpec:
    cls = import_object(ref, "model class")
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ConfigError(f"{ref!r} is not a torch nn.Module class (MODEL may be module:Class of a diffusers transformer)")
    check_config_keys(cls, config, "--model-config")
    family = ADAPTER_BY_CLASS.get(cls.__name__)
    adapter = ADAPTERS[family] if family else GenericAdapter(cls, inputs_fn)
    return ModelSpec(source=ref, adapter=adapter, config=config, weights="random")


def _local_directory(path: Path, inputs_fn) -> ModelSpec:
    if not path.is_dir():
        raise ConfigError(f"{path} is a file; MODEL must be a diffusers model directory (config.json + *.safetensors)")
    if not (path / "config.json").exists() and (path / "transformer" / "config.json").exists():
        path = path / "transformer"
    config_file = path / "config.json"
    if not config_file.exists():
        raise ConfigError(
            f"{path} has no config.json: expected a diffusers model directory (config.json + *.safetensors), "
            "such as the transformer/ folder of a hub snapshot"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file} is not valid JSON: {e}") from None
    cls_name = config.get("_class_name")
    if not cls_name:
        raise ConfigError(f"{config_file} has no _class_name; it does not look like a diffusers model config")
    import diffusers

    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ConfigError(f"{config_file} names class {cls_name!r}, which diffusers {diffusers.__version__} lacks")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"{path} holds no *.safetensors weights; omni-compile loads safetensors only")
    family = ADAPTER_BY_CLASS.get(cls_name)
    adapter = ADAPTERS[family] if family else GenericAdapter(cls, inputs_fn)

    def load(*, dtype, device, seed):
        model = cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
        return model.to(device).eval().requires_grad_(False)

    params = {k: v for k, v in config.items() if not k.startswith("_")}
    return ModelSpec(
        source=str(path), adapter=adapter, config=params, loader=load, weights=",".join(w.name for w in weights)
    )


def adapter_for_model(model) -> ModelAdapter:
    """The adapter of a model instance: its family's, else a generic one for its class."""
    family = ADAPTER_BY_CLASS.get(type(model).__name__)
    return ADAPTERS[family] if family else GenericAdapter(type(model), None)
