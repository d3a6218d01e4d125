"""Read one compiled graph's dumps: the graph before and after every pass, diffs, match tables, op counts.

Works on the readable dumps alone (`GraphModule.print_readable` text, as the pass manager writes them),
so an artifact built elsewhere is inspected from its files. In that text every node is one line
`name: "type" = torch.ops.NS.OP.OVERLOAD(...)`, and Dynamo's stack traces appear as
`# File: PATH:LINE in FUNCTION, code: SOURCE` comments above the nodes they produced. A pass's
match table is derived from what it changed: the nodes it removed, grouped by the model source line
they came from, and the ops it added.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from pathlib import Path

_NODE = re.compile(r"^\s+(\w+)(?:: \"[^\"]*\")? = (.+)$")
_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)(?:\.(\w+))?\(")
_CALL = re.compile(r"^([\w.]+)\(")
_FILE = re.compile(r"^\s+# File: (.+?):(\d+) in (\S+), code: (.*)$")
_DUMP = re.compile(r"^(\d+)\.(\w+)\.(before|after)\.py$")
_FORWARD = re.compile(r"^\s*def forward\(self, (.*)\):?\s*$", re.MULTILINE)
_INPUT = re.compile(r'(\w+): "\w+\[([^\]]*)\]')

# Ops our passes produce (namespace `omni_compile`) and Inductor's user-kernel wrappers.
FUSED_NAMESPACE = "omni_compile"


def parse_nodes(text: str) -> list[dict]:
    """The op nodes of a readable graph: name, op (e.g. 'aten.addmm' or 'omni_compile.rms_norm') and the
    model source line it came from (None without a stack trace)."""
    nodes = []
    source = None
    for line in text.splitlines():
        m = _FILE.match(line)
        if m:
            path, lineno, fn, code = m.groups()
            source = {"file": path, "line": int(lineno), "function": fn, "code": code.strip()}
            continue
        if line.strip().startswith("# No stacktrace"):
            source = None
            continue
        m = _NODE.match(line)
        if not m or m.group(1) == "return":
            continue
        name, rhs = m.groups()
        op = _op_name(rhs)
        if op is None:
            continue
        nodes.append({"name": name, "op": op, "source": source})
    return nodes


def _op_name(rhs: str) -> str | None:
    m = _OP.match(rhs)
    if m:
        return f"{m.group(1)}.{m.group(2)}"
    m = _CALL.match(rhs)
    if m and not rhs.startswith(("self.", "getattr")):
        return m.group(1)  # e.g. operator.getitem, torch._higher_order_ops...
    return None


def dynamo_call(text: str | None) -> str:
    """'temb 1x32, hidden_states 1x64x32, ...': the region call's own tensor inputs (name and shape) in the
    readable text of the graph Dynamo captured, i.e. its placeholders less the module's parameters and
    buffers (`L_self_...`); "" without the text."""
    m = _FORWARD.search(text or "")
    if m is None:
        return ""
    parts = []
    for name, shape in _INPUT.findall(m.group(1)):
        if name.startswith("L_self_"):
            continue
        name = name.removeprefix("L_").removesuffix("_")
        parts.append(f"{name} {'x'.join(d.strip() for d in shape.split(',')) or 'scalar'}")
    return ", ".join(parts)


def op_counts(text: str) -> dict[str, int]:
    """Op -> number of nodes, most frequent first (getitem left out: it is tuple indexing)."""
    counts = Counter(n["op"] for n in parse_nodes(text) if n["op"] != "operator.getitem")
    return dict(counts.most_common())


def op_kinds(counts: dict[str, int]) -> dict[str, int]:
    """Op counts summed by kind: fused (our ops), gemm, attention, reduction, view, pointwise, other."""
    kinds: Counter = Counter()
    for op, n in counts.items():
        kinds[op_kind(op)] += n
    return dict(kinds.most_common())


_GEMM = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "convolution")
_VIEW = ("view", "reshape", "permute", "expand", "unsqueeze", "squeeze", "slice", "select", "split", "unbind",
         "unflatten", "t", "transpose", "alias", "as_strided", "clone", "cat",
         "slice_scatter", "select_scatter")  # fmt: skip
_REDUCE = ("sum", "mean", "amax", "amin", "var_mean", "var", "max", "min", "argmax", "softmax", "_softmax")


def op_kind(op: str) -> str:
    ns, _, name = op.partition(".")
    if ns == FUSED_NAMESPACE or name.startswith("triton_kernel_wrapper"):  # our ops, or their lowered Triton launch
        return "fused"
    if "attention" in name or "flash" in name or "attn" in name:
        return "attention"
    if name in _GEMM:
        return "gemm"
    if name in _REDUCE:
        return "reduction"
    if name in _VIEW:
        return "view"
    if ns in ("aten", "prims"):
        return "pointwise"
    return "other"


def pass_dumps(directory: Path) -> list[tuple[int, str, Path, Path]]:
    """(index, pass, before, after) of the dumps in `directory`, in pass order."""
    found: dict[tuple[int, str], dict[str, Path]] = {}
    for f in directory.iterdir() if directory.is_dir() else []:
        m = _DUMP.match(f.name)
        if m:
            found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f
    return [(i, name, d["before"], d["after"]) for (i, name), d in sorted(found.items()) if len(d) == 2]


def pass_record(index: int, name: str, before: str, after: str, matches: int | None) -> dict:
    """One pass on one graph: texts, unified diff, and the match table (sites in the model's source)."""
    diff = "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True),
            fromfile=f"{index}.{name}.before", tofile=f"{index}.{name}.after", n=2,
        )
    )  # fmt: skip
    b_nodes, a_nodes = parse_nodes(before), parse_nodes(after)
    b_names, a_names = {n["name"] for n in b_nodes}, {n["name"] for n in a_nodes}
    removed = [n for n in b_nodes if n["name"] not in a_names]
    added = [n for n in a_nodes if n["name"] not in b_names]
    sites: dict[tuple, dict] = {}
    for n in removed:
        src = n["source"] or {"file": "?", "line": 0, "function": "?", "code": "(no stack trace)"}
        key = (src["file"], src["line"])
        site = sites.setdefault(key, {**src, "removed_nodes": 0, "removed_ops": Counter()})
        site["removed_nodes"] += 1
        site["removed_ops"][n["op"]] += 1
    return {
        "index": index,
        "name": name,
        "matches": matches,
        "changed": bool(diff),
        "before": before,
        "after": after,
        "diff": diff,
        "removed_ops": dict(Counter(n["op"] for n in removed).most_common()),
        "added_ops": dict(Counter(n["op"] for n in added).most_common()),
        "sites": [{**s, "removed_ops": dict(s["removed_ops"])} for s in sites.values()],
    }


def read_graph_dumps(directory: Path, matches: dict[str, int] | None) -> dict:
    """Everything about one compiled graph from its dump directory (see `record`)."""
    passes = []
    for index, name, before, after in pass_dumps(directory):
        n = None if matches is None else matches.get(name)
        passes.append(pass_record(index, name, before.read_text(), after.read_text(), n))
    dynamo = directory / "dynamo_graph.py"
    first = passes[0]["before"] if passes else ""
    last = passes[-1]["after"] if passes else ""
    return {
        "dynamo_graph": dynamo.read_text() if dynamo.is_file() else None,
        "op_counts": {"before": op_counts(first), "after": op_counts(last)},
        "op_kinds": {"before": op_kinds(op_counts(first)), "after": op_kinds(op_counts(last))},
        "passes": passes,
    }
