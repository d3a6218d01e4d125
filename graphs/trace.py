"""A region's graph identity from the ATen ops one eager call of it runs (`trace_hash`).

An artifact build already runs every region once in eager mode per shape bucket, to record its calls.
`OpTrace` is a `TorchDispatchMode` entered around the first call of each (region, call signature): it
sees every ATen op below autograd, in order, and folds into a sha256

- the op's overload name (`aten.mm.default`),
- each argument: a tensor as where it came from (an input by name: `state.weight`, `args.0`; the output
  of an earlier op: `%12.0`; or a tensor from outside the call, whose values are hashed when it is
  small) together with its shape, stride, dtype and device type; anything else by type and repr,
- each output's shape, stride, dtype and device type.

That is the data-flow graph of the call at the ATen level, the same information an exported graph
holds, without the cost of `torch.export` (a second or more per W1 region). The store key of a region
(`omni_compile.cache.key`) uses it, so a node whose store holds every region never exports anything.
Two calls with the same trace run the same ops on the same data flow; a change of model code, of a
module attribute (eps, heads), of a global switch that changes which ops run (an attention backend), of
the dtypes or the layout changes it. What it cannot see is code that runs only while exporting or
compiling (a branch on `torch.compiler.is_compiling()`); torch's and diffusers' own such branches are
covered by the torch and omni-compile versions in the key (diffusers is pinned), see docs/cache.md.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

# A tensor from outside the call (a constant the code captured) at most this many bytes is hashed by
# value: export would bake its values into the graph as a constant.
_HASH_VALUES_UP_TO = 1 << 20


def _tensor_meta(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{tuple(t.stride())}:{t.dtype}:{t.device.type}"


class OpTrace(TorchDispatchMode):
    """Trace one call: `with OpTrace(named_inputs) as tr: module(...)`, then `tr.hexdigest()`.

    `named_inputs` maps a name to each input tensor (parameters, buffers and call arguments); a tensor
    that reaches an op and is neither an input nor an earlier op's output is an outside constant."""

    def __init__(self, named_inputs: dict[str, torch.Tensor]):
        super().__init__()
        self._h = hashlib.sha256()
        self._labels = WeakIdKeyDictionary()
        for name, t in named_inputs.items():
            if isinstance(t, torch.Tensor) and t not in self._labels:
                self._labels[t] = name
        self.ops = 0

    def _describe(self, x) -> str:
        if isinstance(x, torch.Tensor):
            label = self._labels.get(x)
            if label is None:
                label = "const"
                nbytes = x.numel() * x.element_size()
                if nbytes <= _HASH_VALUES_UP_TO and x.device.type != "meta":
                    label += "=" + hashlib.sha256(x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()[:16]
            return f"{label}<{_tensor_meta(x)}>"
        if isinstance(x, (list, tuple)):
            return "[" + ",".join(self._describe(v) for v in x) + "]"
        return f"{type(x).__name__}:{x!r}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = [str(func), self._describe(list(args))]
        if kwargs:
            record.append(",".join(f"{k}={self._describe(v)}" for k, v in sorted(kwargs.items())))
        out = func(*args, **kwargs)
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                if t not in self._labels:  # an in-place op returns its input: keep the input's name
                    self._labels[t] = f"%{self.ops}.{j}"
                record.append(_tensor_meta(t))
        self._h.update(("|".join(record) + "\n").encode())
        self.ops += 1
        return out

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def named_call_inputs(state: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Names for the tensors of one region call: `state.NAME`, then `args.PATH` and `kwargs.PATH`."""
    named = {f"state.{k}": v for k, v in state.items()}
    for prefix, tree in (("args", args), ("kwargs", dict(sorted(kwargs.items())))):
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                named[prefix + pytree.keystr(path)] = leaf
    return named
