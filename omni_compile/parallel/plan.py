"""Which tensors of a model are split over the sequence-parallel ranks, and where its output is gathered: the
model's context-parallel plan (diffusers' `_cp_plan`, or one the caller passes), applied with diffusers' own
hooks (`diffusers.hooks.context_parallel`). The hooks sit on the model and on modules outside the compiled
regions' code (the model's inputs, its rotary embedding, the first block's input, its output projection), so the
regions see a rank's share of the tokens and never a collective."""

from __future__ import annotations

import functools

import torch
from torch import nn

from omni_compile.errors import ConfigError
from omni_compile.parallel import ParallelState


def model_plan(model: nn.Module, plan: dict | None = None) -> dict:
    """`plan`, else the model's `_cp_plan`; a ConfigError naming the class when it has none."""
    plan = plan if plan is not None else getattr(type(model), "_cp_plan", None)
    if not plan:
        raise ConfigError(f"{type(model).__name__} declares no context-parallel plan (diffusers' _cp_plan: which "
                          "inputs are split along the sequence and where the output is gathered), so sequence "
                          "parallelism cannot split it; pass one as omni_compile.compile(..., parallel_plan=PLAN) "
                          "(diffusers' ContextParallelInput/ContextParallelOutput), or run it in one process")  # fmt: skip
    return plan


def attention_heads(model: nn.Module) -> dict[str, int]:
    """{module path: head count} of the model's attention modules (diffusers' `Attention` and its kin: modules
    with a `heads` count and a processor)."""
    found = {}
    for path, module in model.named_modules():
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and hasattr(module, "processor"):
            found[path] = heads
    return found


def check_splittable(model: nn.Module, n: int, plan: dict | None = None) -> dict:
    """The plan, after checking that `n` ranks can split this model: it has a plan and `n` divides the head count
    of every attention module (each rank attends with H/n heads)."""
    plan = model_plan(model, plan)
    heads = set(attention_heads(model).values())
    bad = sorted(h for h in heads if h % n)
    if bad:
        ok = [d for d in range(1, max(bad) + 1) if all(h % d == 0 for h in heads)]
        raise ConfigError(f"ulysses={n} splits the heads of each attention over {n} ranks, but "
                          f"{type(model).__name__} has attention modules of {', '.join(map(str, bad))} heads; "
                          f"choose a degree that divides every head count ({', '.join(map(str, ok))})")  # fmt: skip
    return plan


def shard_model(model: nn.Module, state: ParallelState, plan: dict) -> None:
    """Install the plan's split and gather hooks for `state`'s sequence-parallel group, and a check that turns a
    sequence the ranks cannot split evenly into a clear error."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel

    # the hooks only split and gather; the attention of the regions is ours (`parallel.ulysses`), so the model's
    # own attention processors are not told about the config
    hook_config = ContextParallelConfig(ulysses_degree=state.config.ulysses)
    hook_config.setup(state.rank, state.world_size, torch.device(state.device_type), state.mesh)
    apply_context_parallel(model, hook_config, plan)
    inner = model.forward
    n = state.config.ulysses

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except AssertionError as e:  # diffusers' EquipartitionSharder
            if "divisible by mesh size" not in str(e):
                raise
            sizes = {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            raise ConfigError(f"ulysses={n}: a sequence of this call does not divide into {n} equal shares "
                              f"(inputs {sizes}); choose a size whose token count (and text length) {n} divides, "
                              "or another degree") from None  # fmt: skip

    model.forward = forward
    model._omni_parallel = (state, plan, inner)


def unshard_model(model: nn.Module) -> None:
    """Remove what `shard_model` installed (the model runs on one process's whole sequence again)."""
    installed = getattr(model, "_omni_parallel", None)
    if installed is None:
        return
    from diffusers.hooks.context_parallel import remove_context_parallel

    model.forward = installed[2]  # the hooks' forward, which removing them undoes
    remove_context_parallel(model, installed[1])
    model._omni_parallel = None
