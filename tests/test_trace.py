"""`graphs.trace`: the op-trace graph identity that keys a region in a shared store.

The same call gives the same hash in any process and with any weight values; anything that changes
the ops that run or how data flows between them (code, a module attribute, a shape, a dtype, a captured
constant) changes it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from omni_compile.artifact.aot import CallRecorder, Target, module_state
from omni_compile.graphs.trace import OpTrace, named_call_inputs


class Block(nn.Module):
    def __init__(self, dim=8, eps=1e-6, approximate="tanh"):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.fc = nn.Linear(dim, dim)
        self.approximate = approximate

    def forward(self, x, scale):
        return nn.functional.gelu(self.fc(self.norm(x)) * (1 + scale), approximate=self.approximate) + x


def _hash(module, *args, **kwargs) -> str:
    with torch.no_grad(), OpTrace(named_call_inputs(module_state(module), args, kwargs)) as tr:
        module(*args, **kwargs)
    assert tr.ops > 0
    return tr.hexdigest()


def _inputs(shape=(2, 4, 8), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype), torch.randn(shape[0], 1, shape[2], generator=g).to(dtype)


def test_same_call_same_hash_whatever_the_weights_and_values():
    torch.manual_seed(0)
    a = _hash(Block(), *_inputs())
    torch.manual_seed(1)
    b = _hash(Block(), *_inputs(seed=3))  # other weights, other input values
    assert a == b


@pytest.mark.parametrize(
    "change",
    [
        lambda: (Block(eps=1e-5), _inputs()),  # a module attribute
        lambda: (Block(approximate="none"), _inputs()),  # a different op
        lambda: (Block(), _inputs(shape=(2, 6, 8))),  # a shape
        lambda: (Block().to(torch.float64), _inputs(dtype=torch.float64)),  # a dtype
    ],
    ids=["eps", "op", "shape", "dtype"],
)
def test_what_changes_the_graph_changes_the_hash(change):
    module, args = change()
    assert _hash(module, *args) != _hash(Block(), *_inputs())


def test_data_flow_is_part_of_the_hash():
    class F(nn.Module):
        def __init__(self, second: bool):
            super().__init__()
            self.second = second

        def forward(self, x, y):
            return x * y + (y if self.second else x)  # same ops in the same order, different operands

    x, y = torch.randn(3), torch.randn(3)
    assert _hash(F(False), x, y) != _hash(F(True), x, y)


def test_a_captured_constant_is_hashed_by_value():
    class C(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table  # a plain attribute, not a buffer: export would bake it into the graph

        def forward(self, x):
            return x * self.table

    x = torch.randn(4)
    assert _hash(C(torch.ones(4)), x) == _hash(C(torch.ones(4)), x)
    assert _hash(C(torch.ones(4)), x) != _hash(C(torch.full((4,), 2.0)), x)


def test_recorder_traces_the_first_call_of_each_signature():
    blocks = nn.ModuleList([Block(), Block()])
    target = Target("Block", "block", [("0", blocks[0]), ("1", blocks[1])])
    rec = CallRecorder([target])
    with rec, torch.no_grad():
        for shape in ((2, 4, 8), (2, 4, 8), (2, 6, 8)):
            x, s = _inputs(shape)
            blocks[1](blocks[0](x, s), s)
    r = rec.records["Block"]
    assert len(r.keys) == 2 and set(r.traces) == set(r.keys)  # two signatures, each traced once
    assert len(set(r.traces.values())) == 2
    assert r.traces[next(iter(r.keys))] == _hash(Block(), *_inputs())
    assert rec._tracing is None and torch._C._len_torch_dispatch_stack() == 0  # no mode left behind


def test_hash_is_the_same_in_another_process():
    code = (
        "import torch, test_trace as t; torch.manual_seed(5); "
        "print(t._hash(t.Block(), *t._inputs()))"
    )
    import os

    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == _hash(Block(), *_inputs())
