"""Attention backends: what each needs, and the order automatic selection tries them in.

Each backend declares its requirements (platform, compute capability, installed package, dtypes,
head_dim, masks, KV length); `AttentionBackend.check` returns None when it can run a call, else the
first failed requirement as a sentence. `preference(platform)` is the list automatic selection walks.

| backend | runs on | takes | layout |
|---|---|---|---|
| TORCH_SDPA | every platform | anything SDPA takes | whatever torch's SDPA dispatch picks (the baseline) |
| CUDNN_ATTN | CUDA, sm80+ | bf16/fp16, head_dim <= 256 and a multiple of 8, no mask, KV length > 1 | SDPA's cuDNN kernel, pinned |
| FA3_ATTN | CUDA sm90: fa3-fwd (bf16) or FA3's hopper build (bf16/fp16) | head_dim multiple of 8, 8..256, no mask | [B, S, H, D] |
| FA4_ATTN | CUDA sm90, sm100+: flash-attn-4 (CuTe DSL) | bf16/fp16, head_dim multiple of 8 (sm100+: up to 128, or 256), no mask | [B, S, H, D] |
| FLASH_ATTN | CUDA sm80-sm90: FlashAttention-2 (flash-attn) | bf16/fp16, head_dim multiple of 8, 8..256, no mask | [B, S, H, D] |
| TRITON_ATTN | CUDA, ROCm, XPU (CPU under TRITON_INTERPRET=1, by name) | bf16/fp16, head_dim 16..256, key-padding mask | [B, S, H, D] |
| SAGE_ATTN | CUDA sm80+, ROCm; lossy, never automatic | bf16/fp16, head_dim 16..256, key-padding mask | [B, S, H, D] |
"""

from __future__ import annotations

import functools
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
    batch: int | None = None  # what a measured choice needs besides the above (`attention.measure`)
    heads: int | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _has_module(name: str) -> bool:
    """`name` is installed here and imports (a package can be present with a dependency missing: the
    FA4 wheel without the CUTLASS DSL's libraries, say)."""
    return _found(name) and import_error(name) is None


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def import_error(name: str) -> str | None:
    """Why importing `name` fails here ("ModuleNotFoundError: No module named 'cutlass'"), or None when it
    imports. Imported once per process, on the first capability check that finds the package."""
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure of a third-party import makes the backend unusable
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------ FlashAttention builds


@dataclass(frozen=True)
class FlashBuild:
    """A FlashAttention build behind one backend: the modules that provide it (the first importable one
    is used), the GPU generations it serves, and what to install."""

    label: str
    description: str  # the backend's line in `omni-compile attention`
    modules: tuple[str, ...]
    majors: tuple[int, ...]  # compute-capability majors it serves
    install: str
    # module -> dtypes that module's kernels take (a build compiled without fp16, say); default HALF
    dtypes: tuple[tuple[str, tuple[torch.dtype, ...]], ...] = ()

    def module(self) -> str | None:
        """The first of `modules` that can be imported here, or None."""
        for name in self.modules:
            if _has_module(name) and (name != "flash_attn" or _fa2_has_func()):
                return name
        return None

    def module_dtypes(self, module: str | None) -> tuple[torch.dtype, ...]:
        return dict(self.dtypes).get(module, HALF)


FLASH_BUILDS = {
    "FA3_ATTN": FlashBuild(
        "FlashAttention-3", "FlashAttention-3's forward (the fa3-fwd wheel, or FA3's own hopper build)",
        ("fa3_fwd_interface", "flash_attn_interface"), (9,),
        "pip install 'omni-compile[fa3]' (the fa3-fwd wheel: FlashAttention-3's forward)",
        # fa3-fwd is built without its fp16 kernels
        dtypes=(("fa3_fwd_interface", (torch.bfloat16,)),),
    ),
    "FA4_ATTN": FlashBuild("FlashAttention-4 (CuTe DSL)", "FlashAttention-4 (flash-attn-4, CuTe DSL)",
                           ("flash_attn.cute",), (9, 10, 11), "pip install flash-attn-4"),
    "FLASH_ATTN": FlashBuild("FlashAttention-2", "FlashAttention-2 (the flash-attn package)", ("flash_attn",), (8, 9),
                             "pip install flash-attn"),
}


def _fa2_has_func() -> bool:
    # The FA4 wheel installs flash_attn.cute under a flash_attn namespace with no FA2 in it.
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")


def installed_flash_modules() -> dict[str, str | None]:
    """Backend -> the module of its FlashAttention build importable here (None: not installed); a cache
    factor, since it changes what `auto` picks."""
    return {name: build.module() for name, build in FLASH_BUILDS.items()}


def _flash_available(backend: str) -> Callable[[Platform], str | None]:
    build = FLASH_BUILDS[backend]

    def check(platform: Platform) -> str | None:
        major = platform.capability[0] if platform.capability else None
        if major not in build.majors:
            serves = " and ".join(f"sm{m}x" if m != 9 else "sm90" for m in build.majors)
            return f"{build.label} serves {serves} GPUs, not {platform.arch} ({platform.device_name})"
        if build.module() is None:
            broken = [m for m in build.modules if _found(m) and import_error(m) is not None]
            if broken:
                return f"{build.label} is installed but does not import here ({import_error(broken[0])}); {build.install}"
            return f"{build.label} is not installed ({build.install})"
        return None

    return check


def _flash_call(backend: str) -> Callable[[Platform, AttentionCall], str | None]:
    build = FLASH_BUILDS[backend]

    def check(platform: Platform, call: AttentionCall) -> str | None:
        module = build.module()
        dtypes = build.module_dtypes(module)
        if call.dtype is not None and call.dtype not in dtypes:
            names = " or ".join(_dtype_name(d) for d in dtypes)
            return f"dtype {_dtype_name(call.dtype)} is unsupported ({module or build.label} takes {names})"
        d = call.head_dim
        if d is None:
            return None
        if backend == "FA4_ATTN" and platform.capability and platform.capability[0] >= 10:
            ok, rule = (d % 8 == 0 and (8 <= d <= 128 or d == 256)), "multiples of 8 up to 128, or 256"
        else:
            ok, rule = (d % 8 == 0 and 8 <= d <= 256), "multiples of 8 from 8 to 256"
        return None if ok else f"head_size={d} is unsupported ({build.label} takes head sizes {rule})"

    return check


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
        *(
            AttentionBackend(
                name,
                build.description,
                platforms=("cuda",),
                dtypes=HALF,
                layout="bshd",
                min_capability=(8, 0),
                available=_flash_available(name),
                head_dim=_flash_call(name),
            )
            for name, build in FLASH_BUILDS.items()
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
            return ["FA3_ATTN", "FA4_ATTN", "FLASH_ATTN", "CUDNN_ATTN", "TORCH_SDPA"]
        return ["TORCH_SDPA"]
    if platform.kind == "xpu":
        return ["TRITON_ATTN", "TORCH_SDPA"]
    # ROCm: SDPA dispatches to its CK / AOTriton flash kernels; TRITON_ATTN on request (not measured there).
    return ["TORCH_SDPA"]
