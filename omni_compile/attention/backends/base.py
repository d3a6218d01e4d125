"""What an attention backend is: an `Implementation` of the op `attention` (`omni_compile.ops.registry`)
with the requirements of an attention call (dtype, head size, mask kind, KV length), the memory layout it
takes and how the attention pass lowers a call to it (`form`, `load`).

Each backend is declared in a file of its own in this package and joins with one `register(...)`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_compile.ops.registry import Implementation, needs_triton  # noqa: F401  (the backends' Triton check)
from omni_compile.platform import Platform

OP = "attention"
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
    # None: no mask; "key_padding": a bool [B or 1, 1, 1, Skv] mask; "key_bias": an additive float mask that is the
    # same for every query ([B or 1, H or 1, 1, Skv], e.g. `(1 - mask) * -10000`); "other": any other mask.
    mask: str | None = None
    batch: int | None = None  # what a measured choice needs besides the above (`attention.measure`)
    heads: int | None = None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def found(name: str) -> bool:
    """A module `name` is installed here (it may still fail to import)."""
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


def has_module(name: str) -> bool:
    """`name` is installed here and imports (a package can be present with a dependency missing: the
    FA4 wheel without the CUTLASS DSL's libraries, say)."""
    return found(name) and import_error(name) is None


def head_dim_range(lo: int, hi: int, what: str) -> Callable[[Platform, AttentionCall], str | None]:
    def check(platform: Platform, call: AttentionCall) -> str | None:
        d = call.head_dim
        if d is None or lo <= d <= hi:
            return None
        return f"head_size={d} is unsupported ({what} takes head sizes {lo}..{hi})"

    return check


def _to_bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def keys_first(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor):
    """(k, v, seqused_k): each batch row's keys and values reordered so that those `key_mask` [B, S_kv] keeps come
    first, in their order, and how many it keeps (int32 [B]). Attention does not depend on the order of the keys,
    so attending to the first seqused_k[b] keys of the result is the masked attention, for any key-padding mask.
    A mask that keeps a prefix (text padding at the end) gets the identity order."""
    order = torch.argsort(key_mask.logical_not().to(torch.uint8), dim=1, stable=True)
    index = order[:, :, None, None]
    k = torch.take_along_dim(k, index, dim=1)
    v = torch.take_along_dim(v, index, dim=1)
    return k, v, key_mask.sum(1, dtype=torch.int32)


def seqused_attention(op, q, k, v, key_mask, scale):
    """A key-padding-masked attention on [B, S, H, D] tensors through `op(q, k, v, seqused_k, scale)`, which
    attends to each row's first seqused_k[b] keys (`AttentionBackend.load_seqused`)."""
    k, v, used = keys_first(k, v, key_mask)
    return op(q, k, v, used, scale)


# What each mask kind is, in the words of a requirement that fails.
MASK_KINDS = {
    "key_padding": "a key-padding mask (bool, [B, 1, 1, S_kv])",
    "key_bias": "a key bias (an additive float mask the same for every query, [B, H, 1, S_kv])",
    "other": "any other mask",
}


@dataclass(frozen=True, kw_only=True)
class AttentionBackend(Implementation):
    op: str = OP
    dtypes: tuple[torch.dtype, ...] | None = None  # None: any
    layout: str = "bhsd"  # "bhsd" (SDPA's [B, H, S, D]) or "bshd" ([B, S, H, D], no transposes around the call)
    masks: tuple[str, ...] = ()  # mask kinds it takes (`MASK_KINDS`)
    head_dim: Callable[[Platform, AttentionCall], str | None] = lambda platform, call: None
    extra: Callable[[Platform, AttentionCall], str | None] = lambda platform, call: None
    # How the attention pass lowers a call (passes/attention.py):
    #   "sdpa"   left as torch dispatched it
    #   "cudnn"  SDPA's cuDNN op on the same [B, H, S, D] views
    #   "op"     a custom op f(q, k, v, scale) on [B, S, H, D] tensors, called by Inductor as an external kernel
    #   "kernel" a triton_op f(q, k, v, key_mask, scale) on [B, S, H, D], embedded in Inductor's code through
    #            its launcher (on the CPU interpreter: called as one external op)
    form: str = "sdpa"
    # Imports the backend's code on first use: for "op" the custom op; for "kernel" (triton_op, launcher).
    load: Callable[[], Any] | None = None
    # "op" backends that take key-padding masks: the custom op f(q, k, v, seqused_k, scale) attending to the
    # first seqused_k[b] keys of row b (the pass puts the kept keys first: `seqused_attention`)
    load_seqused: Callable[[], Any] | None = None
    # Why automatic selection may not take it for this call though it could run it (None: it may); a choice by
    # name skips it. E.g. a kernel that is a candidate on a GPU only for the masks the vendor kernels do not take.
    automatic: Callable[[Platform, AttentionCall], str | None] = lambda platform, call: None

    def check(self, platform: Platform, call: Any = None, explicit: bool = False) -> str | None:
        why = super().check(platform, call, explicit)
        if why is None and call is not None and not explicit:
            why = self.automatic(platform, call)
        return why

    def requirements(self, platform: Platform, call: AttentionCall) -> str | None:
        if self.dtypes is not None and call.dtype is not None and call.dtype not in self.dtypes:
            names = " or ".join(dtype_name(d) for d in self.dtypes)
            return f"dtype {dtype_name(call.dtype)} is unsupported ({self.name} takes {names})"
        reason = self.head_dim(platform, call)
        if reason:
            return reason
        if call.mask is not None and call.mask not in self.masks:
            takes = " or ".join(MASK_KINDS[m] for m in self.masks) if self.masks else "no attention mask"
            takes = "only " + takes if self.masks and "other" not in self.masks else takes
            return f"the call has an attention mask ({call.mask.replace('_', '-')}) and {self.name} takes {takes}"
        return self.extra(platform, call)

    def runner(self) -> Callable[..., torch.Tensor]:
        """fn(q, k, v, scale, key_mask=None, key_bias=None) on [B, S, H, D] tensors -> [B, S, H, D], `key_mask` a
        bool [B, S_kv] (True: attend), `key_bias` a float [B, H, S_kv] added to the scores: the backend as a
        compiled graph runs it (what `attention.measure` times)."""
        if self.form == "sdpa":
            def sdpa(q, k, v, scale, key_mask=None, key_bias=None):
                t = (_to_bshd(x) for x in (q, k, v))
                mask = None if key_mask is None else key_mask[:, None, None, :]
                mask = mask if key_bias is None else key_bias[:, :, None, :]
                return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask, scale=scale).transpose(1, 2)

            return sdpa
        if self.form == "cudnn":
            def cudnn(q, k, v, scale, key_mask=None, key_bias=None):
                assert key_mask is None and key_bias is None, "CUDNN_ATTN as wrapped here takes no mask"
                t = (_to_bshd(x) for x in (q, k, v))
                out = torch.ops.aten._scaled_dot_product_cudnn_attention(*t, None, False, 0.0, False, False,
                                                                         scale=scale)[0]  # fmt: skip
                return out.transpose(1, 2)

            return cudnn
        if self.form == "op":
            op = self.load()

            def call(q, k, v, scale, key_mask=None, key_bias=None):
                assert key_bias is None, f"{self.name} takes no key bias"
                if key_mask is None:
                    return op(q, k, v, scale)
                assert self.load_seqused is not None, f"{self.name} takes no mask"
                return seqused_attention(self.load_seqused(), q, k, v, key_mask, scale)

            return call
        op, _ = self.load()

        def kernel(q, k, v, scale, key_mask=None, key_bias=None):
            if key_bias is None:  # not every kernel takes one
                return op(q, k, v, key_mask, scale)
            return op(q, k, v, key_mask, scale, key_bias)

        return kernel
