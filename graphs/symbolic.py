"""Graphs with symbolic sizes (a `build --dynamic` region): each size computed once, from the graph inputs.

Export writes a size the graph computes with as `aten.sym_size.int(t, dim)` of whichever tensor it was read from,
and each use of a derived size as its own expression node. Both stop our patterns from matching: a size read
from an intermediate (the concatenation of text and image queries) is one more user of that tensor, where the
pattern expects exactly its data users; and two reshapes to the same size through two different nodes bind a
pattern's size argument twice with different nodes. `sizes_from_inputs` gives every size one node, read from
the inputs right after them (`8 + s0` as `operator.add(sym_size(input, 1), 8)`). A static graph has no
symbolic size and is left as it is.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

aten = torch.ops.aten


def sizes_from_inputs(graph: torch.fx.Graph) -> int:
    """Compute every symbolic size of `graph` once, from the graph inputs' sizes, right after the inputs: each
    `sym_size` read and each size expression (`operator.add(8, s0)`) is replaced by the one node of its value.
    Returns how many nodes were replaced. A value that is not a sum, product or floor division of input sizes
    and integers is left where it is. Equal sizes must be one node: a pattern that binds a size twice (a reshape
    to [1, S, ...] and another to [1, S, ...]) matches only when both read the same node."""
    sized = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.SymInt)]
    if not sized:
        return 0
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources: dict[sympy.Symbol, tuple[torch.fx.Node, int]] = {}
    for p in placeholders:
        val = p.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                sources.setdefault(size.node.expr, (p, d))
    anchor = [placeholders[-1]]  # the new nodes go after the inputs, in order
    made: dict[Any, Any] = {}  # expression -> its node (or int)

    def insert(target, args, val) -> torch.fx.Node:
        with graph.inserting_after(anchor[0]):
            node = graph.call_function(target, args)
        node.meta["val"] = val
        anchor[0] = node
        return node

    def build(expr):
        if expr in made:
            return made[expr]
        out = None
        if isinstance(expr, sympy.Integer):
            out = int(expr)
        elif isinstance(expr, sympy.Symbol):
            if expr in sources:
                p, d = sources[expr]
                out = insert(aten.sym_size.int, (p, d), p.meta["val"].shape[d])
        elif isinstance(expr, (sympy.Add, sympy.Mul)):
            op = operator.add if isinstance(expr, sympy.Add) else operator.mul
            terms = [build(a) for a in expr.args]
            if all(t is not None for t in terms):
                out = terms[0]
                for t in terms[1:]:
                    out = insert(op, (out, t), op(_value(out), _value(t)))
        elif isinstance(expr, FloorDiv):
            a, b = (build(x) for x in expr.args)
            if a is not None and b is not None:
                out = insert(operator.floordiv, (a, b), _value(a) // _value(b))
        made[expr] = out
        return out

    moved = 0
    for node in sized:
        new = build(node.meta["val"].node.expr)
        if new is None or new is node:
            continue
        if isinstance(new, torch.fx.Node):
            node.replace_all_uses_with(new)
        else:
            _replace_with_int(node, new)
        if not node.users:
            graph.erase_node(node)
        moved += 1
    return moved


def _value(x):
    return x.meta["val"] if isinstance(x, torch.fx.Node) else x


def _replace_with_int(node: torch.fx.Node, value: int) -> None:
    """Uses of a size that is a constant after all (an expression that sympy folded) take the constant."""
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
