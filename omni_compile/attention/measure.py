"""Choosing an attention backend by measurement, as cuDNN's benchmark mode and Inductor's autotuning do.

On a GPU, `auto` times every capable, exact (not lossy) backend once per call shape, on random inputs of
that shape laid out as the model lays them out ([B, S, H, D] memory; SDPA backends get the transposed
view), and keeps the fastest. Each candidate's output is compared with TORCH_SDPA's on the same inputs
first: a build whose output differs (rel L2 above `EXACT_BOUND`) is dropped, with the reason. Timings
are kept per process (`measure` is memoised), so the regions of one build that share a shape time it
once; the attention pass records them in the build report and the manifest, and a loaded artifact runs
the compiled choice without timing anything.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_compile.attention.backends import BACKENDS, AttentionCall

logger = logging.getLogger("omni_compile.attention")

EXACT_BOUND = 2e-2  # rel L2 against TORCH_SDPA: bf16 rounding is ~4e-3; a wrong kernel is ~1
TARGET_MS = 50.0  # time each backend for about this long (at least MIN_REPS runs)
MIN_REPS, MAX_REPS = 5, 100


@dataclass(frozen=True)
class Shape:
    """The full shape of an attention call, what a measurement needs."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, call: AttentionCall, device: str) -> Shape | None:
        fields = (call.batch, call.heads, call.q_len, call.kv_len, call.head_dim, call.dtype)
        return None if any(f is None for f in fields) or call.mask else cls(*fields, device)  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"{self.batch}x{self.q_len}x{self.heads}x{self.head_dim} kv {self.kv_len} {str(self.dtype)[6:]}"


def runner(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """fn(q, k, v, scale) on [B, S, H, D] tensors -> [B, S, H, D]: `backend` as the compiled graph runs it."""
    return BACKENDS[backend].runner()


def _time_ms(fn: Callable[[], torch.Tensor], device: str) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU), after a warm-up call (the first may compile)."""
    import time

    def once() -> float:
        if device == "cpu":
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    fn()
    reps = max(MIN_REPS, min(MAX_REPS, math.ceil(TARGET_MS / max(once(), 1e-3))))
    return statistics.median(once() for _ in range(reps))


@functools.cache
def measure(backends: tuple[str, ...], shape: Shape) -> dict[str, float | str]:
    """Backend -> median ms on `shape`, or the reason it was dropped (it raised, or its output is off)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with torch._guards.tracing(None), unset_fake_temporarily(), torch.no_grad():
        g = torch.Generator(device=shape.device).manual_seed(0)

        def rand(s):
            return torch.randn(shape.batch, s, shape.heads, shape.head_dim, generator=g, device=shape.device,
                               dtype=shape.dtype)  # fmt: skip

        q, k, v = rand(shape.q_len), rand(shape.kv_len), rand(shape.kv_len)
        scale = 1.0 / math.sqrt(shape.head_dim)
        reference = runner("TORCH_SDPA")(q, k, v, scale).float()
        out: dict[str, float | str] = {}
        for name in backends:
            fn = runner(name)
            try:
                got = fn(q, k, v, scale).float()
                err = float((got - reference).norm() / reference.norm())
                if not err <= EXACT_BOUND:
                    out[name] = f"output off by rel L2 {err:.1e} against TORCH_SDPA"
                    continue
                out[name] = round(_time_ms(lambda: fn(q, k, v, scale), shape.device), 4)
            except Exception as e:  # a build that cannot run this shape here: not a candidate
                out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        logger.info("attention timings for %s: %s", shape.describe(), out)
        return out


def fastest(times: dict[str, float | str]) -> str | None:
    """The backend with the lowest time (ties: the earlier one, i.e. the preference order)."""
    timed = [(ms, i, name) for i, (name, ms) in enumerate(times.items()) if isinstance(ms, float)]
    return min(timed)[2] if timed else None
