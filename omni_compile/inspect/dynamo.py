"""The Dynamo view of a compiled model: per region its compiled entry points decompiled by depyf, the
recompile reasons Dynamo logged, and graph breaks (`torch._dynamo.explain` of one instance's call).

`explain` resets Dynamo's caches, so it runs last, after everything that needs the compiled regions.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("omni_compile.inspect")


def _decompile(code) -> str:
    try:
        import depyf
    except ImportError:
        return "# depyf is not installed: pip install depyf"
    try:
        return depyf.decompile(code)
    except Exception as e:  # depyf does not cover every bytecode; say so instead of failing the report
        return f"# depyf could not decompile {getattr(code, 'co_name', code)}: {type(e).__name__}: {e}"


def entry_points(fn) -> list[dict]:
    """Dynamo's transformed code objects for `fn`'s code (one per compiled guard set), decompiled."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out = []
    for i, entry in enumerate(_debug_get_cache_entry_list(code)):
        out.append({"index": i, "name": entry.code.co_name, "decompiled": _decompile(entry.code)})
    return out


def _explain(region, call) -> dict:
    module, args, kwargs = call
    try:
        with torch.no_grad():
            ex = torch._dynamo.explain(region.cls.forward)(module, *args, **kwargs)
    except Exception as e:  # a model Dynamo cannot trace at all: report it, keep the rest of the inspection
        return {"error": f"{type(e).__name__}: {e}"}
    reasons = []
    for r in ex.break_reasons:
        frame = r.user_stack[-1] if getattr(r, "user_stack", None) else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else None
        reasons.append({"reason": str(r.reason), "where": where})
    return {
        "graph_count": ex.graph_count,
        "graph_break_count": ex.graph_break_count,
        "op_count": ex.op_count,
        "break_reasons": reasons,
    }


def _where(fn) -> str:
    """'FILE:LINE' of `fn`'s code, as Dynamo's recompile messages name the function they recompile."""
    code = fn.__code__
    return f"{code.co_filename}:{code.co_firstlineno}"


def dynamo_view(state, calls: dict, recompile_lines: list[str]) -> dict:
    regions = []
    for region in state.regions:
        compiles = [r for r in state.records if r.region == region.name]
        regions.append({
            "region": region.name,
            "compiles": len(compiles),
            "recompile_reasons": [line for line in recompile_lines if _where(region.cls.forward) in line],
            "entry_points": entry_points(region.cls.forward),
        })  # fmt: skip
    for item, region in zip(regions, state.regions):
        item["explain"] = _explain(region, calls[region.name]) if region.name in calls else None
    return {"available": True, "recompile_log": recompile_lines, "regions": regions}
