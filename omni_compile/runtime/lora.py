"""LoRA adapters on a compiled or loaded transformer, with zero compiles.

The compiled regions take the weights as inputs (the artifact's files and `omni_compile.compile`'s regions
alike), so a LoRA is applied by changing the bound weights in place, W ← W + s·(α/r)·B·A, never by changing
the modules: no region sees a new graph, no guard fails, and whole-step CUDA graphs keep reading the same
memory. (diffusers' own `load_lora_weights` wraps each Linear in a PEFT layer: a new module structure, so a
compiled model recompiles; diffusers' "hotswap" mode exists for that reason.)

    loras = omni_compile.lora_adapters(model)          # the model's adapter set (created on first use)
    loras.load("style", "style.safetensors")           # read and checked against the model; nothing applied
    loras.activate("style", scale=0.8)                  # merged into the weights in place
    loras.activate(None)                                # the base weights back, bit for bit
    loras.unload("style")

Files: safetensors in the diffusers/PEFT layout (`<prefix>.<module path>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r], prefix `transformer.`, `base_model.model.` or none) or the kohya layout
(`lora_down`/`lora_up`, with an optional `.alpha` per module: scale α/r, else 1). A file whose keys name
modules the model lacks, or whose shapes do not fit them, is refused with the keys named.

The weights a LoRA touches are copied once to host memory before the first merge; switching adapters or
scales restores them from that copy and merges again, so the base weights never drift (checksums equal).

On an fp8 model (`--precision fp8`) the targets may be `Fp8Linear`s: the merge dequantizes the e4m3 weight with
its per-channel scales, adds the delta in fp32 and quantizes again with new scales, both written in place (the
same shapes and dtypes: zero compiles); unloading copies the e4m3 weight and its scales back. The merged
weight is quantized once more, so it differs from an fp8 model built from bf16 weights with the LoRA merged
first by about one e4m3 rounding.
"""

from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from omni_compile.counters import counters
from omni_compile.errors import ConfigError

_PREFIXES = ("transformer.", "base_model.model.", "diffusion_model.", "model.")
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_down|lora_up)(?:\.[^.]+)?\.weight$")
_ALPHA = re.compile(r"^(?P<module>.+)\.alpha$")


@dataclass
class LoraAdapter:
    """One LoRA read from a file: per target module path, (A [r, in], B [out, r], α/r), on the host."""

    name: str
    path: str
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.deltas.values())


def read_lora(path: str | Path, model: nn.Module, name: str) -> LoraAdapter:
    """The LoRA in `path`, checked against `model`'s Linears (module names and shapes); ConfigError naming the
    keys that do not fit."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"LoRA {name!r}: no file {p}")
    try:
        tensors = load_file(str(p), device="cpu")
    except Exception as e:  # noqa: BLE001 - a broken file: the loader's message, one line
        raise ConfigError(f"LoRA {name!r}: {p} is not a safetensors file ({str(e).splitlines()[0]})") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, float] = {}
    unknown = []
    for key, t in tensors.items():
        stripped = next((key[len(x):] for x in _PREFIXES if key.startswith(x)), key)
        if m := _KEY.match(stripped):
            part = {"lora_down": "lora_A", "lora_up": "lora_B"}.get(m["part"], m["part"])
            parts.setdefault(m["module"], {})[part] = t
        elif m := _ALPHA.match(stripped):
            alphas[m["module"]] = float(t.item())
        else:
            unknown.append(key)
    modules = dict(model.named_modules())
    problems = [f"{k}: not a LoRA weight (expected ...lora_A.weight / lora_B.weight)" for k in unknown[:5]]
    deltas = {}
    for module, ab in sorted(parts.items()):
        target = modules.get(module)
        if "lora_A" not in ab or "lora_B" not in ab:
            problems.append(f"{module}: has {'lora_A' if 'lora_A' in ab else 'lora_B'} but not its pair")
            continue
        a, b = ab["lora_A"], ab["lora_B"]
        if not _is_linear(target):
            what = "no such module" if target is None else f"a {type(target).__name__}, not a Linear"
            problems.append(f"{module}: {what} in {type(model).__name__}")
            continue
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[1] != target.in_features \
                or b.shape[0] != target.out_features:
            problems.append(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit a Linear "
                            f"{target.in_features} -> {target.out_features}")  # fmt: skip
            continue
        rank = a.shape[0]
        deltas[module] = (a.float(), b.float(), alphas.get(module, rank) / rank)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ConfigError(f"LoRA {name!r} ({p.name}) does not fit {type(model).__name__}: " + "; ".join(problems[:5])
                          + more)  # fmt: skip
    if not deltas:
        raise ConfigError(f"LoRA {name!r}: {p} holds no LoRA weights")
    return LoraAdapter(name, str(p), deltas)


@dataclass
class LoraSet:
    """The adapters loaded on one model and the one merged into its weights now (`active`: (name, scale))."""

    model: nn.Module
    adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    active: tuple[str, float] | None = None
    # module path -> its original weight (and an fp8 Linear's weight scales), on the host
    _base: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _busy: threading.Lock = field(default_factory=threading.Lock, repr=False)  # held while the model runs with them

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read `path` as adapter `name` (checked against the model); nothing is applied yet."""
        if not name or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"LoRA name {name!r}: use letters, digits, '.', '_' and '-'")
        with self._lock:
            if name in self.adapters:
                raise ConfigError(f"a LoRA named {name!r} is already loaded; unload it first")
        adapter = read_lora(path, self.model, name)
        with self._lock:
            self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter `name`; the base weights come back first when it is the one applied (after the model
        call running under `applied`, if one is)."""
        with self._busy, self._lock:
            if name not in self.adapters:
                raise ConfigError(f"no LoRA named {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})")
            if self.active is not None and self.active[0] == name:
                self._restore()
            del self.adapters[name]

    def activate(self, name: str | None, scale: float = 1.0) -> None:
        """Merge adapter `name` at `scale` into the weights (the base weights when `name` is None); a no-op when
        that is what is merged already."""
        if name is not None and name not in self.adapters:
            raise ConfigError(f"no LoRA named {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -10 <= scale <= 10:
            raise ConfigError(f"LoRA scale must be a number from -10 to 10, not {scale!r}")
        want = None if name is None else (name, float(scale))
        with self._lock, torch.no_grad():
            if want == self.active:
                return
            self._restore()
            if want is not None:
                self._merge(self.adapters[name], float(scale))
                self.active = want

    @contextlib.contextmanager
    def applied(self, name: str | None, scale: float = 1.0):
        """`activate(name, scale)` for the model calls inside the block; `unload` waits for the block to end."""
        with self._busy:
            self.activate(name, scale)
            yield

    def _restore(self) -> None:
        modules = dict(self.model.named_modules())
        for path, base in self._base.items():
            for param, saved in zip(_params(modules[path]), base):
                param.copy_(saved)  # bit for bit: the copy taken before the first merge
        self.active = None

    def _merge(self, adapter: LoraAdapter, scale: float) -> None:
        modules = dict(self.model.named_modules())
        from omni_compile.ops.fp8 import Fp8Linear, quantize_rows

        for path, (a, b, alpha_over_rank) in adapter.deltas.items():
            module = modules[path]
            w = module.weight
            if path not in self._base:
                self._base[path] = tuple(t.detach().to("cpu", copy=True) for t in _params(module))
            delta = (b.to(w.device) @ a.to(w.device)) * (scale * alpha_over_rank)
            if isinstance(module, Fp8Linear):  # dequantize, merge, quantize again with new per-channel scales
                q, s = quantize_rows(w.float() * module.weight_scale[:, None] + delta)
                w.copy_(q)
                module.weight_scale.copy_(s.reshape(-1))
            else:
                w.copy_((w.float() + delta).to(w.dtype))
            counters.lora_merges += 1

    def describe(self) -> dict:
        return {"loaded": {n: {"path": a.path, "modules": len(a.deltas), "rank": a.rank} for n, a in
                           self.adapters.items()},
                "active": None if self.active is None else {"name": self.active[0], "scale": self.active[1]}}  # fmt: skip


def _is_linear(module) -> bool:
    from omni_compile.ops.fp8 import Fp8Linear

    return type(module) in (nn.Linear, Fp8Linear)


def _params(module) -> tuple[torch.Tensor, ...]:
    """What a merge changes in `module`: the weight, and an fp8 Linear's per-channel scales."""
    scales = getattr(module, "weight_scale", None)
    return (module.weight,) if scales is None else (module.weight, scales)


def lora_adapters(target) -> LoraSet:
    """The LoRA set of a pipeline's transformer or of a transformer (created on first use)."""
    model = getattr(target, "transformer", target)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"lora_adapters takes a diffusers pipeline with a transformer, or the transformer; got "
                          f"{type(target).__name__}")  # fmt: skip
    found = getattr(model, "_omni_lora", None)
    if found is None:
        found = model._omni_lora = LoraSet(model)
    return found


__all__ = ["LoraAdapter", "LoraSet", "lora_adapters", "read_lora"]
