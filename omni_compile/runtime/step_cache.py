"""Step caching: on denoising steps whose input changed little, skip most of the transformer and reuse what
the skipped blocks added on the last step that ran them. Lossy, off by default, opt-in per model (and per
request in the server).

Both methods are diffusers' First Block Cache (`diffusers.hooks.first_block_cache`), with its hooks: every
step runs the first transformer block; when the rest is skipped, the residual the other blocks added on the
last computed step (hidden states, and the text stream's where the block returns one) is added to the first
block's output. They differ in who decides:

- `first_block`: diffusers' rule. The rest runs when the first block's residual moved by more than
  `threshold` (mean absolute change over mean absolute value) since the last computed step.
- `schedule`: a fixed schedule: a `fraction` of the steps after the warm-up, spread evenly.
- `taylor`: the same schedule, and a skipped step forecasts the residual rather than reusing it (TaylorSeer's
  idea, to first order): from the residuals r0, r1 of the last two computed steps s0 < s1, step s adds
  r1 + (r1 - r0) (s - s1) / (s1 - s0). Before two steps are computed it reuses r1, as `schedule` does.

With either, the first `warmup` steps of each inference run every block. It fixes the share of computed steps, which a threshold does not (and with
  random weights a threshold's skip rate says little about real ones).

The decision is taken in Python between compiled regions (the blocks keep their compiled forwards; diffusers'
hooks wrap them): no graph break inside a region and no recompile, since every region sees the inputs it
was compiled for. A whole-step CUDA graph replays one path and cannot skip: it is refused. Every call of the
transformer is one counted step (`StepCacheStats`), so a pipeline with classifier-free guidance counts its
conditional and unconditional calls apart, each with its own cached state (diffusers' cache contexts).

The pipeline must call the transformer inside `transformer.cache_context(name)` (diffusers' pipelines do),
and the step state resets when a pipeline call ends (`maybe_free_model_hooks`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from omni_compile.errors import ConfigError

METHODS = ("first_block", "schedule", "taylor")
_HEAD_HOOK = "omni_step_cache_head"
_BLOCK_HOOK = "omni_step_cache_block"
MAX_WARMUP = 1000


@dataclass(frozen=True)
class StepCacheConfig:
    """`method`: "first_block" (skip when the first block's residual changed by at most `threshold`, in
    (0, 1]), "schedule" (compute `fraction`, in (0, 1], of the steps after the warm-up) or "taylor" (the
    schedule, skipped steps forecast to first order); with each, the first `warmup` steps of an inference are
    computed."""

    method: str = "first_block"
    threshold: float = 0.05
    fraction: float = 0.5
    warmup: int = 2

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"step cache method {self.method!r} is unknown; the methods are {', '.join(METHODS)}")
        for name in ("threshold", "fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"step cache {name} must be a number in (0, 1], not {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or not 1 <= self.warmup <= MAX_WARMUP:
            raise ConfigError(f"step cache warmup must be an integer from 1 to {MAX_WARMUP} (the first step is always "
                              f"computed: nothing is cached before it), not {self.warmup!r}")  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> StepCacheConfig:
        """`first_block`, `first_block:0.1`, `first_block:0.1:3` (threshold, warmup), `schedule:0.5` or
        `schedule:0.5:3` (fraction, warmup), and `taylor` as `schedule`."""
        method, *values = text.strip().split(":")
        if method not in METHODS:
            cls(method)  # the unknown-method error
        usage = (f"step cache {text!r}: expected first_block[:THRESHOLD[:WARMUP]], schedule[:FRACTION[:WARMUP]] or "
                 "taylor[:FRACTION[:WARMUP]]")
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            raise ConfigError(usage) from None
        if len(numbers) > 2:
            raise ConfigError(usage)
        if len(numbers) == 2 and not numbers[1].is_integer():
            raise ConfigError(f"step cache {text!r}: warmup must be an integer")
        fields = {"threshold" if method == "first_block" else "fraction": numbers[0]} if numbers else {}
        if len(numbers) == 2:
            fields["warmup"] = int(numbers[1])
        return cls(method, **fields)

    def text(self) -> str:
        """The setting as `parse` reads it, every field written."""
        value = self.threshold if self.method == "first_block" else self.fraction
        return f"{self.method}:{value:g}:{self.warmup}"

    def computes(self, step: int) -> bool:
        """The schedule: step `step` (0-based) of an inference is computed."""
        if step < self.warmup:
            return True
        i = step - self.warmup  # spread `fraction` of the rest evenly: compute where floor((i + 1) f) grows
        return math.floor((i + 1) * self.fraction + 1e-9) > math.floor(i * self.fraction + 1e-9)

    def describe(self) -> str:
        if self.method == "first_block":
            return f"first_block (threshold {self.threshold:g}, after {self.warmup} computed steps)"
        forecast = ", skipped steps forecast to first order" if self.method == "taylor" else ""
        return f"{self.method} ({self.fraction:.0%} of the steps after {self.warmup} computed{forecast})"


# Every step computed: what a request that asks for no step caching runs with on a server that has it.
EVERY_STEP = StepCacheConfig("schedule", fraction=1.0, warmup=1)


@dataclass
class StepCacheStats:
    """Transformer calls seen since the cache was enabled, and how many ran every block."""

    steps: int = 0
    computed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, computed: bool) -> None:
        with self._lock:
            self.steps += 1
            self.computed += int(computed)

    @property
    def fraction(self) -> float:
        """The share of calls that ran every block (1.0 before any call)."""
        return self.computed / self.steps if self.steps else 1.0

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.steps, self.computed

    def to_json(self) -> dict:
        return {"steps": self.steps, "computed": self.computed, "fraction_computed": round(self.fraction, 4)}


@dataclass
class StepCache:
    """What `enable_step_cache` installed on a transformer (`model._omni_step_cache`)."""

    config: StepCacheConfig
    stats: StepCacheStats
    head: nn.Module
    blocks: list[nn.Module]

    def set_config(self, config: StepCacheConfig) -> None:
        """Another method or setting for the next calls (the server's per-request choice); same hooks."""
        self.config = config
        self.head._diffusers_hook.get_hook(_HEAD_HOOK).config = config



def _transformer(target) -> nn.Module:
    """The denoiser of `target`: a pipeline's `transformer`, or the model itself."""
    model = getattr(target, "transformer", None)
    if isinstance(model, nn.Module):
        return model
    if isinstance(target, nn.Module):
        return target
    raise ConfigError(f"enable_step_cache takes a diffusers pipeline with a transformer, or the transformer; "
                      f"got {type(target).__name__}")  # fmt: skip


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    found = []
    for name, child in model.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList):
            found += [(f"{name}.{i}", block) for i, block in enumerate(child)]
    return found


def _check_model(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    from omni_compile.runtime.cuda_graphs import CudaGraphForward

    cls = type(model).__name__
    if len(blocks) < 2:
        raise ConfigError(f"step caching needs at least two transformer blocks in lists named "
                          f"{sorted(_ALL_TRANSFORMER_BLOCK_IDENTIFIERS)}; {cls} has {len(blocks)}")  # fmt: skip
    unknown = sorted({type(b).__name__ for _, b in blocks if not _registered(TransformerBlockRegistry, type(b))})
    if unknown:
        raise ConfigError(f"step caching cannot run on {cls}: diffusers has no block metadata (which output is the "
                          f"hidden states) for {', '.join(unknown)}; its First Block Cache supports the block classes "
                          "registered in diffusers.hooks._helpers.TransformerBlockRegistry")  # fmt: skip
    state = getattr(model, "_omni_compile", None)
    artifact = getattr(model, "_omni_artifact", None)
    if isinstance(model.__dict__.get("forward"), CudaGraphForward) or (state is not None and state.cuda_graphs) or (
        artifact is not None and artifact.cuda_graphs is not None
    ):
        raise ConfigError("step caching cannot run under whole-step CUDA graphs: a replay repeats one path and "
                          "cannot skip blocks. Load with omni_compile.load(..., cuda_graphs=False) or compile "
                          "without cuda_graphs=True (serve turns them off with --step-cache)")  # fmt: skip
    if getattr(model, "_omni_step_cache", None) is not None:
        raise ConfigError("step caching is already enabled on this model; call disable_step_cache(model) first")
    other = [n for n, b in blocks if getattr(b, "_diffusers_hook", None) is not None and b._diffusers_hook.hooks]
    if other:
        raise ConfigError(f"block {other[0]} already has diffusers hooks (another cache method?); disable them first")


def _registered(registry, cls) -> bool:
    try:
        registry.get(cls)
    except (KeyError, ValueError):
        return False
    return True


def enable_step_cache(target, config: StepCacheConfig | str | None = None, **kwargs) -> StepCache:
    """Turn step caching on for a pipeline's transformer (or a transformer): `config` a `StepCacheConfig`, its
    text form (`"schedule:0.5"`), or its fields as keyword arguments. Call after `omni_compile.compile` or
    `omni_compile.load` (whose whole-step CUDA graphs must be off). Returns the handle, also
    `model._omni_step_cache`, whose `stats` count the calls and the computed ones."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.first_block_cache import FBCBlockHook, FBCSharedBlockState
    from diffusers.hooks.hooks import StateManager

    if isinstance(config, str):
        config = StepCacheConfig.parse(config)
    elif config is None:
        config = StepCacheConfig(**kwargs)
    elif kwargs:
        raise ConfigError("pass either a StepCacheConfig or its fields, not both")
    model = _transformer(target)
    blocks = _blocks(model)
    _check_model(model, blocks)
    stats = StepCacheStats()
    manager = StateManager(FBCSharedBlockState, (), {})
    (_, head), *rest = blocks
    registry = HookRegistry.check_if_exists_or_initialize(head)
    registry.register_hook(_head_hook(manager, config, stats), _HEAD_HOOK)
    for i, (_, block) in enumerate(rest):
        hook = FBCBlockHook(manager, is_tail=i == len(rest) - 1)
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, _BLOCK_HOOK)
    cache = StepCache(config, stats, head, [b for _, b in rest])
    model._omni_step_cache = cache
    _hooks_changed(model)
    return cache


def _hooks_changed(model: nn.Module) -> None:
    """diffusers caches the registries under a model (to set the cache context fast): rebuild that list."""
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(model)
    if hasattr(registry, "invalidate_child_registries_cache"):
        registry.invalidate_child_registries_cache()


def _head_hook(manager, config: StepCacheConfig, stats: StepCacheStats):
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    class StepCacheHead(FBCHeadBlockHook):
        """diffusers' head-block hook; the decision by `config.method`, counted in `stats`."""

        def __init__(self):
            super().__init__(manager, config.threshold)
            self.config = config

        @torch.compiler.disable
        def _should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
            state = self.state_manager.get_state()
            step = getattr(state, "omni_step", 0)
            state.omni_step = step + 1
            if getattr(state, "omni_fresh", False):  # the tail stored the residuals of the step computed last
                state.omni_history = (*getattr(state, "omni_history", ())[-1:], (state.omni_computed_at,
                                                                                 state.tail_block_residuals))  # fmt: skip
            if step < self.config.warmup or state.head_block_residual is None or state.tail_block_residuals is None:
                compute = True  # the warm-up, or nothing cached yet in this inference
            elif self.config.method in ("schedule", "taylor"):
                compute = self.config.computes(step)
            else:
                self.threshold = self.config.threshold
                compute = super()._should_compute_remaining_blocks(hidden_states_residual)
            state.omni_fresh = compute
            if compute:
                state.omni_computed_at = step
            elif self.config.method == "taylor":  # what the head adds next: the forecast (the history stays)
                state.tail_block_residuals = forecast(state.omni_history, step)
            stats.record(compute)
            return compute

    return StepCacheHead()


def forecast(history, step: int):
    """The tail residuals at `step` from the last computed ones, `history` ((step, residuals), ...) oldest first:
    linear through the last two (a first-order Taylor step on their finite difference), else the last as is.
    `residuals` is (hidden states', text stream's or None)."""
    (s1, r1) = history[-1]
    if len(history) < 2:
        return r1
    (s0, r0) = history[-2]
    k = (step - s1) / (s1 - s0)
    return tuple(None if a is None else a + (a - b) * k for a, b in zip(r1, r0))


def disable_step_cache(target) -> None:
    """Remove what `enable_step_cache` installed; the blocks run every step again."""
    model = _transformer(target)
    cache = getattr(model, "_omni_step_cache", None)
    if cache is None:
        return
    cache.head._diffusers_hook.remove_hook(_HEAD_HOOK, recurse=False)
    for block in cache.blocks:
        block._diffusers_hook.remove_hook(_BLOCK_HOOK, recurse=False)
    del model._omni_step_cache
    _hooks_changed(model)


def step_cache(target) -> StepCache | None:
    """The step cache enabled on a pipeline's transformer or a transformer, or None."""
    return getattr(_transformer(target), "_omni_step_cache", None)
