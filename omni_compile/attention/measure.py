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
    key_padding: bool = False  # the call has a key-padding mask: timed with one (`key_mask`)
    key_bias: bool = False  # the call has a key bias: timed with one (`bias`)

    @classmethod
    def of(cls, call: AttentionCall, device: str) -> Shape | None:
        fields = (call.batch, call.heads, call.q_len, call.kv_len, call.head_dim, call.dtype)
        if any(f is None for f in fields) or call.mask not in (None, "key_padding", "key_bias"):
            return None
        return cls(*fields, device, key_padding=call.mask == "key_padding",  # type: ignore[arg-type]
                   key_bias=call.mask == "key_bias")  # fmt: skip

    def describe(self) -> str:
        masked = " key-padding mask" if self.key_padding else " key bias" if self.key_bias else ""
        return f"{self.batch}x{self.q_len}x{self.heads}x{self.head_dim} kv {self.kv_len}{masked} {str(self.dtype)[6:]}"

    def key_mask(self) -> torch.Tensor | None:
        """The mask a masked call is timed with: every 8th key dropped, so that the kept keys are no prefix (a
        backend that assumed one is off against TORCH_SDPA and dropped); the real mask is unknown at build time."""
        if not self.key_padding:
            return None
        keep = torch.arange(self.kv_len, device=self.device) % 8 != 7
        return keep.expand(self.batch, self.kv_len)

    def bias(self, generator: torch.Generator) -> torch.Tensor | None:
        """The key bias a call with one is timed with, [B, H, S_kv] of the call's dtype, one row per batch
        broadcast over the heads (stride 0, as a mask made per batch row reaches the call): random normal
        values, every 8th key at -10000 (how diffusers models write a dropped key)."""
        if not self.key_bias:
            return None
        bias = torch.randn(self.batch, 1, self.kv_len, generator=generator, device=self.device)
        bias[..., 7::8] = -10000.0
        return bias.to(self.dtype).expand(self.batch, self.heads, self.kv_len)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The mask arguments of a runner for this shape (none, `key_mask` or `key_bias`)."""
        if self.key_padding:
            return {"key_mask": self.key_mask()}
        if self.key_bias:
            return {"key_bias": self.bias(torch.Generator(device=self.device).manual_seed(1))}
        return {}


def runner(backend: str) -> Callable[..., torch.Tensor]:
    """fn(q, k, v, scale, key_mask=None) on [B, S, H, D] tensors -> [B, S, H, D]: `backend` as the compiled graph
    runs it."""
    return BACKENDS[backend].runner()


SPIN_CYCLES = 1_500_000  # about 0.75 ms at 2 GHz: longer than the host takes to launch one call of any backend


def device_times_ms(
    fn: Callable[[], object], device: str, reps: int, before: Callable[[], object] | None = None
) -> list[float]:
    """Milliseconds of `reps` runs of `fn` after a warm-up call (the first may compile): on a GPU, the device time.
    `before` (untimed) runs ahead of each GPU run, e.g. to flush the L2 cache.

    On CUDA each run is queued behind a spin kernel, so the host has launched `fn`'s kernels before the GPU
    reaches them and the events around it time the GPU work alone. Timing a call alone between two events
    would add the host's launch time whenever the kernel is shorter than it (SDPA with a mask: about 0.1 ms
    of host time around a 40 us kernel), but inside a compiled step the host runs ahead of the GPU, and a
    CUDA graph launches nothing at all.
    """
    import time

    fn()
    if device == "cpu":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        if before is not None:
            before()
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds of `fn` (device time on a GPU: `device_times_ms`), over about TARGET_MS of runs."""
    once = min(device_times_ms(fn, device, 2))
    reps = max(MIN_REPS, min(MAX_REPS, math.ceil(TARGET_MS / max(once, 1e-3))))
    return statistics.median(device_times_ms(fn, device, reps))


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
        masked = shape.inputs()
        reference = runner("TORCH_SDPA")(q, k, v, scale, **masked).float()
        out: dict[str, float | str] = {}
        for name in backends:
            fn = runner(name)
            try:
                got = fn(q, k, v, scale, **masked).float()
                err = float((got - reference).norm() / reference.norm())
                if not err <= EXACT_BOUND:
                    out[name] = f"output off by rel L2 {err:.1e} against TORCH_SDPA"
                    continue
                out[name] = round(_time_ms(lambda: fn(q, k, v, scale, **masked), shape.device), 4)
            except Exception as e:  # a build that cannot run this shape here: not a candidate
                out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        logger.info("attention timings for %s: %s", shape.describe(), out)
        return out


def fastest(times: dict[str, float | str]) -> str | None:
    """The backend with the lowest time (ties: the earlier one, i.e. the preference order)."""
    timed = [(ms, i, name) for i, (name, ms) in enumerate(times.items()) if isinstance(ms, float)]
    return min(timed)[2] if timed else None
