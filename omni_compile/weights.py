"""Load-time weight transforms: changes to a model's weights that run once, when the weights are bound,
never per step.

`CompileConfig.weight_transforms` names them. `omni_compile.compile` runs them on the model before its
regions are traced, an artifact build before it records the calls (the manifest keeps the list in its
compile config), and `omni_compile.load(ART, weights=...)` / `verify` run the same list on the weights
they are given before the weights check, so what is checked is what the compiled files are bound to.

`fuse_projections`: every diffusers attention module that supports it (`AttentionModuleMixin` with
`_supports_qkv_fusion`: FLUX, Wan, Qwen-Image, ...) gets its q/k/v projections (k/v for cross-attention,
and the added q/k/v of joint attention) as one Linear each, through diffusers' own `fuse_projections`;
its attention processor then runs one GEMM where it ran three and splits the output with views. The
separate Linears stay (LoRA loaders and state dicts name them), their weights and biases turned into
views of the fused ones, so the model holds one copy of those weights, not two. Exact: each output
element is the same dot product.

`fp8` (lossy, docs/fast-mode.md): every Linear inside the model's repeated blocks becomes an
`omni_compile.ops.fp8.Fp8Linear` (e4m3 weight, one scale per output channel; the input quantized per row
at run time), except the modulation Linears (a Linear whose parent is a norm module, such as
AdaLayerNormZero's) and those whose sizes the fp8 GEMM cannot take. Embedders, the final projection and
the rest of the glue stay as they are. It runs on CUDA GPUs of compute capability 8.9 or more with a bf16
model (`OMNI_COMPILE_FP8_ANY_DEVICE=1` lets it run elsewhere, slowly, for tests). It needs the repeated
blocks, which `compile`, a build and `load` pass (the regions' instances, found before the transforms run).
A build checks its compiled regions against the eager model after the same transform (lossless bound) and
reports the cost against the model as given (`parity.buckets[*].rel_l2_vs_lossless` in the build report).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from omni_compile.counters import counters
from omni_compile.errors import ConfigError

logger = logging.getLogger("omni_compile.weights")

# fused Linear (as diffusers names it) -> the Linears whose rows it stacks, in order
FUSED_FROM = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "to_added_kv": ("add_k_proj", "add_v_proj"),
}


@torch.no_grad()
def _share(module: nn.Module, fused_name: str) -> None:
    """Make the separate Linears' weights and biases views of the fused Linear's (one copy in memory)."""
    fused = getattr(module, fused_name)
    parts = [getattr(module, n, None) for n in FUSED_FROM[fused_name]]
    if not all(isinstance(p, nn.Linear) for p in parts):
        return
    for attr in ("weight", "bias"):
        whole = getattr(fused, attr)
        pieces = [getattr(p, attr) for p in parts]
        if whole is None or any(t is None for t in pieces):
            continue
        start = 0
        for part, piece in zip(parts, pieces):
            rows = piece.shape[0]
            view = whole[start : start + rows]
            if view.shape != piece.shape or not torch.equal(view, piece):
                raise ConfigError(
                    f"fuse_projections: {type(module).__name__}.{fused_name}.{attr} is not the rows of "
                    f"{'/'.join(FUSED_FROM[fused_name])} stacked in order; leave the weight transform off for this model"
                )
            setattr(part, attr, nn.Parameter(view, requires_grad=piece.requires_grad))
            start += rows


def fuse_projections(model: nn.Module, blocks: list[nn.Module] | None = None) -> int:
    """Fuse the projections of every attention module of `model` that supports it (see the module
    docstring); returns how many modules it fused (0 when there is none, or all are fused already)."""
    from diffusers.models.attention import AttentionModuleMixin

    fused = 0
    for module in model.modules():
        if not isinstance(module, AttentionModuleMixin) or not getattr(module, "_supports_qkv_fusion", True):
            continue
        if getattr(module, "fused_projections", False):
            continue
        before = {n for n, _ in module.named_children()}
        module.fuse_projections()
        if not getattr(module, "fused_projections", False):
            continue
        for name, _ in module.named_children():
            if name not in before and name in FUSED_FROM:
                _share(module, name)
        fused += 1
    return fused


def fp8_device_error(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """Why fp8 GEMMs cannot run for a model of `dtype` on `device`, or None (OMNI_COMPILE_FP8_ANY_DEVICE=1 lifts
    the check: the CPU tests)."""
    from omni_compile import envs

    if envs.fp8_any_device():
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return (f"weight transform fp8 needs a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, "
                f"Blackwell); the model is on {device}. Leave fp8 off here")  # fmt: skip
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return (f"weight transform fp8 needs compute capability 8.9 or more; {device} "
                f"({torch.cuda.get_device_name(device)}) is {cap[0]}.{cap[1]}. Leave fp8 off here")  # fmt: skip
    if dtype != torch.bfloat16:
        return (f"weight transform fp8 takes a bf16 model (the fp8 GEMM writes bf16); this one is "
                f"{str(dtype).removeprefix('torch.')}")  # fmt: skip
    return None


def _check_fp8_device(model: nn.Module) -> None:
    param = next(model.parameters(), None)
    why = None if param is None else fp8_device_error(param.device, param.dtype)
    if why:
        raise ConfigError(why)


def fp8_targets(blocks: list[nn.Module]) -> tuple[list[tuple[nn.Module, str, nn.Linear]], list[str]]:
    """The Linears the fp8 transform replaces in the model's repeated `blocks`, as (parent, attribute, Linear),
    and why others in them stay: every `nn.Linear` but the modulation Linears and those `ops.fp8.eligible`
    refuses."""
    from omni_compile.ops.fp8 import eligible

    targets, kept = [], []
    for block in blocks:
        for parent in block.modules():
            if "Norm" in type(parent).__name__:  # modulation Linears (AdaLayerNorm*.linear) stay
                continue
            for name, child in parent.named_children():
                if type(child) is not nn.Linear:
                    continue
                why = eligible(child)
                if why:
                    kept.append(f"{type(parent).__name__}.{name}: {why}")
                else:
                    targets.append((parent, name, child))
    return targets, kept


def quantize_fp8(model: nn.Module, blocks: list[nn.Module] | None = None, keep: list[str] | tuple = ()) -> int:
    """Replace the Linears of `fp8_targets(blocks)` by `Fp8Linear`s (see the module docstring), but those whose
    module path matches a `keep` pattern (fnmatch); returns how many it replaced (0 when it already ran).
    `blocks`: the model's repeated blocks (the compiler's regions' instances)."""
    from fnmatch import fnmatchcase

    from omni_compile.ops.fp8 import Fp8Linear, has_fp8

    if blocks is None:
        raise ConfigError("weight transform fp8 needs the model's blocks (it runs in omni_compile.compile)")
    _check_fp8_device(model)
    targets, kept = fp8_targets(blocks)
    if keep:
        paths = {id(m): n for n, m in model.named_modules()}
        named = [(paths.get(id(linear), ""), t) for t in targets for linear in [t[2]]]
        unmatched = [k for k in keep if not any(fnmatchcase(path, k) for path, _ in named)]
        done = has_fp8(model)
        if unmatched and not done:  # a typo would silently quantize what the user meant to keep
            example = ", ".join(path for path, _ in named[:3])
            raise ConfigError(f"fp8_keep pattern(s) {unmatched} match none of the {len(named)} Linears fp8 takes "
                              f"(module paths such as {example})")  # fmt: skip
        targets = [t for path, t in named if not any(fnmatchcase(path, k) for k in keep)]
        kept += [f"{path}: fp8_keep" for path, t in named if t not in targets]
    for parent, name, linear in targets:
        setattr(parent, name, Fp8Linear.from_linear(linear))
    if kept:
        logger.info("fp8: %d Linear(s) kept: %s", len(kept), "; ".join(sorted(set(kept))[:5]))
    if targets:
        logger.warning("fp8: %d Linear(s) now run fp8 GEMMs (lossy: compare against the bf16 model, "
                       "docs/fast-mode.md)", len(targets))  # fmt: skip
    return len(targets)


# name -> fn(model, blocks) -> modules changed; `blocks` (the repeated blocks, None where the caller has none) for
# the transforms that change only the blocks
TRANSFORMS: dict[str, Callable[..., int]] = {"fuse_projections": fuse_projections, "fp8": quantize_fp8}
LOSSY = {"fp8"}  # transforms that change values: a build reports their cost against the model as given


def check_transforms(names: list[str], fp8_keep: list[str] | tuple = ()) -> None:
    if fp8_keep and "fp8" not in names:
        raise ConfigError("fp8_keep names Linears to keep out of fp8, but the weight transform fp8 is not asked for "
                          "(--precision fp8)")  # fmt: skip
    unknown = [n for n in names if n not in TRANSFORMS]
    if unknown:
        raise ConfigError(f"unknown weight transform(s) {unknown}; known: {', '.join(TRANSFORMS)}")
    if "fp8" in names and "fuse_projections" in names:
        raise ConfigError("weight transforms fp8 and fuse_projections do not go together yet; choose one")


def apply_transforms(model: nn.Module, names: list[str], blocks: list[nn.Module] | None = None,
                     fp8_keep: list[str] | tuple = ()) -> dict[str, int]:  # fmt: skip
    """Run the named transforms on `model`, in order; returns how many modules each changed. A transform
    finds what it already did and does nothing twice (calling this again returns zeros). `blocks`: the model's
    repeated blocks, for the transforms that need them (fp8); `fp8_keep`: `CompileConfig.fp8_keep`."""
    check_transforms(names, fp8_keep)
    done = {}
    for name in names:
        done[name] = quantize_fp8(model, blocks, fp8_keep) if name == "fp8" else TRANSFORMS[name](model, blocks)
        counters.weight_transforms += done[name]
        logger.info("weight transform %s: %d module(s)", name, done[name])
    return done


__all__ = ["FUSED_FROM", "LOSSY", "TRANSFORMS", "apply_transforms", "check_transforms", "fp8_device_error",
           "fp8_targets", "fuse_projections", "quantize_fp8"]
