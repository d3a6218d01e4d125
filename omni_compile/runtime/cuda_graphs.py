"""CUDA graph capture and replay of a module's forward, one graph per input signature ("bucket").

`CudaGraphForward(module)` is called like `module.forward`. The first call with a new signature copies the
inputs into static buffers, runs `warmup` eager iterations on a side stream, captures the module on those
buffers with `torch.cuda.graph`, replays it once and returns the result. A later call with the same
signature copies its inputs into the buffers and replays the graph.

The contract:

- Key. Every leaf of `(args, kwargs)` (flattened with `torch.utils._pytree`, kwargs sorted by name)
  contributes: tensors their shape, dtype, device and stride; anything else its type and repr. The pytree
  spec is part of the key too. A graph is replayed only for identical non-tensor arguments, so a Python
  float that changes every step (rather than a tensor) captures a graph per value.
- Static buffers. The module only ever sees the static buffers, never the caller's tensors: in-place
  writes to inputs are not written back, and parameters are read from the addresses they had at capture
  (replace the weights, e.g. by loading a LoRA, and call `reset()`). Every tensor argument must be on the
  same CUDA device; a CPU tensor next to CUDA ones raises, since its value would be fixed at capture.
- Clone on return. Each output tensor is cloned after replay, so an output the caller keeps is not
  overwritten by the next replay. The clone costs one device copy per output per call.
- Bounded. At most `max_graphs` graphs are kept (None: no bound); a new signature past it drops the least
  recently replayed graph (counted in `stats["evictions"]`), which a later call at its size captures again.
- One pool. All graphs of one runner share one memory pool (`torch.cuda.graph_pool_handle()`, or the
  `pool` passed in): intermediates are shared between buckets, the static outputs of each are kept.
  Sharing is safe because replays never overlap and outputs are cloned before the next replay.
- Inference only: warmup, capture and replay run under `torch.no_grad()`.
- Without CUDA, when disabled, or when no tensor argument is on a CUDA device, the module is called
  directly. A capture failure (a host sync such as `.item()`, for instance) raises a RuntimeError that names
  the bucket and says how to turn CUDA graphs off; there is no silent eager fallback. Errors during warmup
  are the module's own and propagate unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

logger = logging.getLogger("omni_compile.runtime")

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}

_TURN_OFF = ("turn CUDA graphs off with cuda_graphs=False in omni_compile.load or omni_compile.compile, or "
             "--no-cuda-graphs on the CLI")

# Output leaves that are returned as they are (they hold no device memory).
_PLAIN_OUTPUTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_inputs: list[Any]  # flattened leaves: static buffers for tensors, the call's values otherwise
    static_outputs: Any
    description: str


class CudaGraphForward:
    """Calls `module` through one captured CUDA graph per input signature; see the module docstring."""

    def __init__(self, module: nn.Module, enabled: bool = True, warmup: int = 2, pool=None,
                 max_graphs: int | None = None):  # fmt: skip
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if max_graphs is not None and max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1 or None, got {max_graphs}")
        self.module = module
        self.enabled = enabled
        self.warmup = warmup
        self.max_graphs = max_graphs
        self._pool = pool
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()  # least recently used first
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stats = {"captures": 0, "replays": 0, "eager_calls": 0, "evictions": 0}
        try:
            self._arg_names = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            self._arg_names = []

    @property
    def graphs(self) -> int:
        """Number of graphs captured (one per bucket)."""
        return len(self._graphs)

    @property
    def stats(self) -> dict[str, int]:
        """Counts of captures, replays (calls served by an existing graph), eager calls and evictions."""
        return dict(self._stats)

    def keys(self) -> list[str]:
        """The captured signatures, readable: "hidden_states=1x4096x64 bf16, return_dict=False"."""
        return [g.description for g in self._graphs.values()]

    def reset(self) -> None:
        """Drops every graph and its buffers (needed after the module's parameters are replaced)."""
        self._graphs.clear()

    def __call__(self, *args, **kwargs):
        if not self.enabled or not torch.cuda.is_available():
            return self._eager(args, kwargs)
        call_kwargs, kwargs = kwargs, dict(sorted(kwargs.items()))  # the key does not depend on kwargs' order
        leaves, spec = pytree.tree_flatten((args, kwargs))
        devices = {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}
        if not any(d.type == "cuda" for d in devices):
            return self._eager(args, kwargs)
        key = (spec, tuple(_leaf_key(leaf) for leaf in leaves))
        entry = self._graphs.get(key)
        if entry is None:
            if len(devices) > 1:
                raise RuntimeError(
                    f"CUDA graphs need every tensor argument on one CUDA device, found {sorted(map(str, devices))} "
                    f"(bucket {self._describe(args, call_kwargs)}); move them to the GPU, or {_TURN_OFF}."
                )
            if self.max_graphs is not None and len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)  # its buffers go back to the pool for the new graph
                self._stats["evictions"] += 1
            entry = self._capture(devices.pop(), leaves, spec, self._describe(args, call_kwargs))
            self._graphs[key] = entry
            self._stats["captures"] += 1
        else:
            self._graphs.move_to_end(key)
            self._stats["replays"] += 1
        for static, leaf in zip(entry.static_inputs, leaves):
            if isinstance(leaf, torch.Tensor):
                static.copy_(leaf, non_blocking=True)
        entry.graph.replay()
        with torch.no_grad():
            return _clone_outputs(entry.static_outputs)

    def _eager(self, args, kwargs):
        self._stats["eager_calls"] += 1
        return self.module(*args, **kwargs)

    def _capture(self, device: torch.device, leaves: list, spec, description: str) -> _Graph:
        with torch.cuda.device(device), torch.no_grad():
            # Normal (not inference) tensors, so the buffers can be written outside inference_mode later.
            with torch.inference_mode(False):
                static_inputs = [
                    torch.empty_like(leaf, memory_format=torch.preserve_format).copy_(leaf)
                    if isinstance(leaf, torch.Tensor)
                    else leaf
                    for leaf in leaves
                ]
            static_args, static_kwargs = pytree.tree_unflatten(static_inputs, spec)
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    self.module(*static_args, **static_kwargs)
            current.wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    static_outputs = self.module(*static_args, **static_kwargs)
            except Exception as exc:
                # torch.cuda.graph leaves the capture stream current when capture_end raises.
                torch.cuda.set_stream(current)
                _reset_generator(device)
                raise RuntimeError(
                    f"CUDA graph capture failed for bucket ({description}): {type(exc).__name__}: {exc}. "
                    f"The forward does something a graph cannot record (a host sync such as .item() or a "
                    f"CPU round trip, for instance); {_TURN_OFF}."
                ) from exc
        _check_outputs(static_outputs, description)
        return _Graph(graph, static_inputs, static_outputs, description)

    def _describe(self, args, kwargs) -> str:
        named = [(self._arg_names[i] if i < len(self._arg_names) else f"arg{i}", a) for i, a in enumerate(args)]
        parts = []
        for name, value in [*named, *kwargs.items()]:
            for path, leaf in pytree.tree_flatten_with_path(value)[0]:
                parts.append(f"{name}{pytree.keystr(path)}={_leaf_summary(leaf)}")
        return ", ".join(parts)


def _leaf_key(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride())
    return (type(leaf).__qualname__, repr(leaf))


def _leaf_summary(leaf) -> str:
    if not isinstance(leaf, torch.Tensor):
        return repr(leaf)
    shape = "x".join(str(s) for s in leaf.shape) or "scalar"
    text = f"{shape} {_DTYPE_NAMES.get(leaf.dtype, str(leaf.dtype).removeprefix('torch.'))}"
    if not leaf.is_contiguous():
        text += f" stride {','.join(str(s) for s in leaf.stride())}"
    return text


def _clone_outputs(out):
    """Clones every tensor in `out`, keeping its structure: pytree containers (tuples, lists, dicts and the
    diffusers BaseOutput classes, which register themselves with pytree) and dataclasses pytree does not know."""
    leaves, spec = pytree.tree_flatten(out)
    return pytree.tree_unflatten([_clone_leaf(leaf) for leaf in leaves], spec)


def _clone_leaf(leaf):
    if isinstance(leaf, torch.Tensor):
        return leaf.clone()
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return type(leaf)(**{f.name: _clone_outputs(getattr(leaf, f.name)) for f in dataclasses.fields(leaf) if f.init})
    return leaf


def _check_outputs(out, description: str) -> None:
    """Raises for output leaves that `_clone_outputs` cannot copy: returned as they are, they would hand the
    caller the graph's static memory, overwritten at the next replay."""
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, (torch.Tensor, *_PLAIN_OUTPUTS)):
            continue
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for f in dataclasses.fields(leaf):
                _check_outputs(getattr(leaf, f.name), description)
            continue
        raise RuntimeError(
            f"CUDA graphs cannot return an output of type {type(leaf).__qualname__} (bucket {description}): "
            f"only tensors in pytree containers or dataclasses are copied out of the graph; {_TURN_OFF}."
        )


def _reset_generator(device: torch.device) -> None:
    """After a failed capture, give the device's default generator a state that is not capturing.

    When `capture_end` raises (the capture was invalidated), torch (seen on 2.11 on an H200) never runs
    the generator's capture epilogue, and every later random op on that device fails with "Offset
    increment outside graph capture encountered unexpectedly". A clone of the state has the same seed
    and offset and no capture in progress.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError) as exc:  # another torch: nothing to repair, or no way to
        logger.debug("could not reset the CUDA generator after a failed capture: %s", exc)


class _Forward(nn.Module):
    """A bound forward as a module, for `CudaGraphForward` (which calls a module)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def capture_forward(model: nn.Module, max_graphs: int | None = None) -> CudaGraphForward:
    """Route `model.forward` through one CUDA graph per bucket around the whole forward (every region and
    the glue between them, one replay per denoise step); returns the runner, also set as `model.forward`.
    `max_graphs`: at most that many kept (`CudaGraphForward`). `del model.forward` undoes it."""
    runner = CudaGraphForward(_Forward(model.forward), max_graphs=max_graphs)
    model.forward = runner
    return runner
