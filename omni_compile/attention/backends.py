"""Attention backends: what each needs, and the order automatic selection tries them in.

Each backend declares its requirements (platform, compute capability, installed package, dtypes,
head_dim, masks, KV length); `AttentionBackend.check` returns None when it can run a call, else the
first failed requirement as a sentence. `preference(platform)` is the list automatic selection walks.

| backend | runs on | takes | layout |
|---|---|---|---|
| TORCH_SDPA | every platform | anything SDPA takes | whatever torch's SDPA dispatch picks (the baseline) |
| CUDNN_ATTN | CUDA, sm80+ | bf16/fp16, head_dim <= 256 and a multiple of 8, no mask, KV length > 1 | SDPA's cuDNN kernel, pinned |
| FLASH_ATTN | CUDA: FA2 (sm80/sm86/sm89/sm90), FA3 and FA4 (sm90), FA4 (sm100+) | bf16/fp16, see `_flash_head_dim` | [B, S, H, D] |
| TRITON_ATTN | CUDA, ROCm, XPU (CPU under TRITON_INTERPRET=1, by name) | bf16/fp16, head_dim 16..256, key-padding mask | [B, S, H, D] |
| SAGE_ATTN | CUDA sm80+, ROCm; lossy, never automatic | bf16/fp16, head_dim 16..256, key-padding mask | [B, S, H, D] |
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_compile.platform import Platform

HALF = (torch.bfloat16, torch.float16)
GPU_TRITON = ("cuda", "rocm", "xpu")


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call needs, read from the graph's example values; None means unknown, and
    the check that needs it is skipped (a probe before any graph exists)."""

    dtype: torch.dtype | None = None
    head_dim: int | None = None
    q_len: int | None = None
    kv_len: int | None = None
    # None: no mask; "key_padding": a bool [B or 1, 1, 1, Skv] mask; "other": any other mask.
    mask: str | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------------ FlashAttention packages

FA_PACKAGES = {
    # library: (module to import, what to install)
    "fa4": ("flash_attn.cute", "pip install flash-attn-4 (FlashAttention-4, CuTe DSL)"),
    "fa3": ("flash_attn_interface", "build FlashAttention-3 from flash-attention/hopper"),
    "fa2": ("flash_attn", "pip install flash-attn (FlashAttention-2)"),
}


def flash_libraries(platform: Platform) -> tuple[str, ...]:
    """The FlashAttention builds that can serve this GPU, best first (Blackwell: FA4 only; FA2/FA3 builds
    there are ignored even if they import)."""
    if platform.kind != "cuda" or not platform.capability:
        return ()
    major = platform.capability[0]
    if major >= 10:
        return ("fa4",)
    if major == 9:
        return ("fa3", "fa4", "fa2")
    if major == 8:
        return ("fa2",)
    return ()


def installed_flash_library(platform: Platform) -> str | None:
    for lib in flash_libraries(platform):
        module = FA_PACKAGES[lib][0]
        if _has_module(module) and (lib != "fa2" or _fa2_has_func()):
            return lib
    return None


def _fa2_has_func() -> bool:
    # The FA4 wheel installs flash_attn.cute under a flash_attn namespace with no FA2 in it.
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")


def _flash_available(platform: Platform) -> str | None:
    libs = flash_libraries(platform)
    if not libs:
        arch = platform.arch if platform.kind == "cuda" else platform.kind
        return f"no FlashAttention build serves {arch} (FA2 needs sm80+, FA3 sm90, FA4 sm90 or sm100+)"
    if installed_flash_library(platform) is None:
        hints = "; or ".join(FA_PACKAGES[lib][1] for lib in libs)
        return f"no FlashAttention package for {platform.arch} is installed ({hints})"
    return None


def _flash_head_dim(platform: Platform, call: AttentionCall) -> str | None:
    d = call.head_dim
    if d is None:
        return None
    lib = installed_flash_library(platform)
    if lib == "fa4" and platform.capability and platform.capability[0] >= 10:
        ok, rule = (d % 8 == 0 and (8 <= d <= 128 or d in (192, 256))), "multiples of 8 up to 128, or 192 or 256"
    else:
        ok, rule = (d % 8 == 0 and 8 <= d <= 256), "multiples of 8 from 8 to 256"
    return None if ok else f"head_size={d} is unsupported ({lib or 'FlashAttention'} takes head sizes {rule})"


def _cudnn_available(platform: Platform) -> str | None:
    if not torch.backends.cudnn.is_available():
        return "this torch build has no cuDNN"
    return None


def _cudnn_extra(platform: Platform, call: AttentionCall) -> str | None:
    if call.kv_len == 1:
        return "kv_len=1 is unsupported by cuDNN attention (automatic selection routes it to TORCH_SDPA)"
    return None


def _triton_available(platform: Platform) -> str | None:
    return None if platform.triton_version else "Triton is not installed (pip install triton)"


def _head_dim_range(lo: int, hi: int, what: str) -> Callable[[Platform, AttentionCall], str | None]:
    def check(platform: Platform, call: AttentionCall) -> str | None:
        d = call.head_dim
        if d is None or lo <= d <= hi:
            return None
        return f"head_size={d} is unsupported ({what} takes head sizes {lo}..{hi})"

    return check


def _cudnn_head_dim(platform: Platform, call: AttentionCall) -> str | None:
    d = call.head_dim
    if d is None or (d <= 256 and d % 8 == 0):
        return None
    return f"head_size={d} is unsupported (cuDNN attention takes head sizes <= 256 that are multiples of 8)"


# ------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    description: str
    platforms: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None  # None: any
    layout: str  # "bhsd" (SDPA's [B, H, S, D]) or "bshd" ([B, S, H, D], no transposes around the call)
    min_capability: tuple[int, int] | None = None  # CUDA only
    masks: tuple[str, ...] = ()  # mask kinds it takes ("key_padding", "other")
    lossy: bool = False  # never chosen automatically
    interpretable: bool = False  # runs on CPU under TRITON_INTERPRET=1 when asked for by name
    available: Callable[[Platform], str | None] = lambda platform: None
    head_dim: Callable[[Platform, AttentionCall], str | None] = lambda platform, call: None
    extra: Callable[[Platform, AttentionCall], str | None] = lambda platform, call: None

    def check(self, platform: Platform, call: AttentionCall | None = None, explicit: bool = False) -> str | None:
        """None when this backend can run `call` on `platform`, else the first failed requirement."""
        reason = self._platform_reason(platform, explicit)
        if reason or call is None:
            return reason
        if self.dtypes is not None and call.dtype is not None and call.dtype not in self.dtypes:
            names = " or ".join(_dtype_name(d) for d in self.dtypes)
            return f"dtype {_dtype_name(call.dtype)} is unsupported ({self.name} takes {names})"
        reason = self.head_dim(platform, call)
        if reason:
            return reason
        if call.mask is not None and call.mask not in self.masks:
            takes = "only a key-padding mask (bool, [B, 1, 1, S_kv])" if self.masks else "no attention mask"
            return f"the call has an attention mask ({call.mask.replace('_', '-')}) and {self.name} takes {takes}"
        return self.extra(platform, call)

    def _platform_reason(self, platform: Platform, explicit: bool) -> str | None:
        kind = platform.kind
        on_interpreter = kind == "cpu" and self.interpretable and explicit and os.environ.get("TRITON_INTERPRET") == "1"
        if kind not in self.platforms and not on_interpreter:
            hint = " (or set TRITON_INTERPRET=1 to run it on CPU for testing)" if kind == "cpu" and self.interpretable else ""
            return f"it runs on {'/'.join(self.platforms)}, not on {kind}{hint}"
        if self.min_capability and kind == "cuda" and platform.capability and platform.capability < self.min_capability:
            need = ".".join(map(str, self.min_capability))
            have = ".".join(map(str, platform.capability))
            return f"it needs compute capability {need} or newer; {platform.device_name} has {have}"
        return self.available(platform)


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "TORCH_SDPA",
            "torch's scaled_dot_product_attention as dispatched by torch (the correctness baseline)",
            platforms=("cuda", "rocm", "xpu", "cpu"),
            dtypes=None,
            layout="bhsd",
            masks=("key_padding", "other"),
        ),
        AttentionBackend(
            "CUDNN_ATTN",
            "SDPA's cuDNN attention kernel, pinned",
            platforms=("cuda",),
            dtypes=HALF,
            layout="bhsd",
            min_capability=(8, 0),
            available=_cudnn_available,
            head_dim=_cudnn_head_dim,
            extra=_cudnn_extra,
        ),
        AttentionBackend(
            "FLASH_ATTN",
            "an installed FlashAttention package: FA2 (Ampere-Hopper), FA3 (Hopper), FA4 (Hopper, Blackwell)",
            platforms=("cuda",),
            dtypes=HALF,
            layout="bshd",
            min_capability=(8, 0),
            available=_flash_available,
            head_dim=_flash_head_dim,
        ),
        AttentionBackend(
            "TRITON_ATTN",
            "omni-compile's Triton flash-attention forward, embedded in Inductor's code",
            platforms=GPU_TRITON,
            dtypes=HALF,
            layout="bshd",
            masks=("key_padding",),
            interpretable=True,
            available=_triton_available,
            head_dim=_head_dim_range(16, 256, "the Triton kernel"),
        ),
        AttentionBackend(
            "SAGE_ATTN",
            "INT8 Q·K (per-block scales, smoothed K) and half-precision P·V in Triton: lossy, opt-in only",
            platforms=("cuda", "rocm"),
            dtypes=HALF,
            layout="bshd",
            min_capability=(8, 0),
            masks=("key_padding",),
            lossy=True,
            interpretable=True,
            available=_triton_available,
            head_dim=_head_dim_range(16, 256, "the SAGE kernel"),
        ),
    )
}


def preference(platform: Platform) -> list[str]:
    """The backends automatic selection tries on `platform`, in order (lossy ones never appear)."""
    if platform.kind == "cuda":
        if platform.capability and platform.capability >= (8, 0):
            return ["FLASH_ATTN", "CUDNN_ATTN", "TORCH_SDPA"]
        return ["TORCH_SDPA"]
    if platform.kind == "xpu":
        return ["TRITON_ATTN", "TORCH_SDPA"]
    # ROCm: SDPA dispatches to its CK / AOTriton flash kernels; TRITON_ATTN on request (not measured there).
    return ["TORCH_SDPA"]
