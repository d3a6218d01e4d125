"""One profiled step per bucket: time per region and per kernel category, kernel counts, top kernels, the
GEMMs by shape (time and TFLOP/s each), and on CUDA the device timeline (busy time, idle gaps and where
the largest ones sit).

Each region instance's call runs inside a `record_function("omni_compile.region:NAME")` range, so the
profile attributes time to regions. On CUDA the kernels are the device events (their device time; a
region's time is the device time of the kernels launched inside its ranges); on the CPU they are the
leaf CPU ops (Inductor's generated C++ kernels get ranges of their own with
`cpp.enable_kernel_profile`, which `inspect --profile` turns on for its compile).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from omni_compile.build.session import sync
from omni_compile.inspect.categories import CATEGORIES, kernel_category

REGION_RANGE = "omni_compile.region:"
TOP = 15
TOP_GEMMS = 20
TOP_GAPS = 10
GAP_US = 5.0  # idle device time between two kernels counted as a gap (launch latency is ~2-4 us)
# ATen GEMM ops and how their input shapes give (batch, M, K, N); the innermost op of a nest is counted.
GEMM_OPS = {
    "aten::mm": lambda s: (1, s[0][0], s[0][1], s[1][1]),
    "aten::addmm": lambda s: (1, s[1][0], s[1][1], s[2][1]),
    "aten::addmm_": lambda s: (1, s[1][0], s[1][1], s[2][1]),  # accumulating in place (omni_compile::linear_parts)
    "aten::_addmm_activation": lambda s: (1, s[1][0], s[1][1], s[2][1]),
    "aten::bmm": lambda s: (s[0][0], s[0][1], s[0][2], s[1][2]),
    "aten::baddbmm": lambda s: (s[1][0], s[1][1], s[1][2], s[2][2]),
    "aten::_scaled_mm": lambda s: (1, s[0][0], s[0][1], s[1][1]),
}


@contextlib.contextmanager
def region_ranges(regions):
    """Wrap every instance's forward in a profiler range named after its region."""
    saved = []
    for region in regions:
        for _, module in region.instances:
            fwd = module.__dict__.get("forward")
            if fwd is None:
                continue
            saved.append((module, fwd))
            module.forward = _ranged(fwd, REGION_RANGE + region.name)
    try:
        yield
    finally:
        for module, fwd in saved:
            module.forward = fwd


def _ranged(fn, name):
    def forward(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return forward


def profile_step(step, device: str) -> dict:
    """Profile one call of `step`: kernels by category, per region, top kernels (times in ms)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        sync(device)
    events = list(prof.events())
    kernels = _device_kernels(events) if cuda else _cpu_kernels(events)
    cats: dict[str, list] = {c: [0, 0.0] for c in CATEGORIES}
    per_kernel: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        t = _time(e, cuda)
        cat = kernel_category(e.name)
        cats[cat][0] += 1
        cats[cat][1] += t
        per_kernel[e.name][0] += 1
        per_kernel[e.name][1] += t
    regions: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.name.startswith(REGION_RANGE) and e.device_type == torch.autograd.DeviceType.CPU:
            r = regions[e.name[len(REGION_RANGE):]]
            r[0] += 1
            r[1] += (e.device_time_total if cuda else e.cpu_time_total) / 1e3
    total = sum(v[1] for v in cats.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {
        "time_source": "device kernels (CUDA)" if cuda else "CPU ops (outermost kernel ops)",
        "kernels": len(kernels),
        "total_ms": round(total, 3),
        "by_category": {c: {"count": n, "ms": round(ms, 3), "share": round(ms / total, 4) if total else 0.0}
                        for c, (n, ms) in cats.items() if n},  # fmt: skip
        "by_region": {r: {"calls": n, "ms": round(ms, 3)} for r, (n, ms) in regions.items()},
        "top_kernels": [{"name": n, "category": kernel_category(n), "count": c, "ms": round(ms, 3)}
                        for n, (c, ms) in top],  # fmt: skip
        "gemms": gemm_table(events, cuda),
        "timeline": timeline(kernels) if cuda else None,
    }


def gemm_table(events, cuda: bool) -> list[dict]:
    """The GEMMs of the step grouped by (op, shape), slowest total first: calls, ms, TFLOP/s.

    Shapes come from the ATen op's recorded inputs (`record_shapes`); the time is the device time of the
    kernels it launched (CUDA) or its CPU time. A GEMM op nested in another (`linear` -> `addmm`) is
    counted once, at the innermost level."""
    rows: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        shape_of = GEMM_OPS.get(e.name)
        if shape_of is None or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if any(c.name in GEMM_OPS for c in e.cpu_children):
            continue
        try:
            b, m, k, n = shape_of(e.input_shapes)
        except (IndexError, TypeError):
            continue
        row = rows[(e.name.removeprefix("aten::"), b, m, k, n)]
        row[0] += 1
        row[1] += (e.device_time_total if cuda else e.cpu_time_total) / 1e3
    out = []
    for (op, b, m, k, n), (calls, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:TOP_GEMMS]:
        flops = 2.0 * b * m * k * n * calls
        out.append({"op": op, "shape": f"{b}x{m}x{k}x{n}" if b > 1 else f"{m}x{k}x{n}", "calls": calls,
                    "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1) if ms > 0 else 0.0})  # fmt: skip
    return out


def timeline(kernels) -> dict:
    """Device busy time against the span from the first kernel's start to the last one's end, and the
    idle gaps between kernels (the largest with the kernels on either side): what CUDA events see on top
    of the kernel sum."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "gap_ms": 0.0, "largest_gaps": []}
    busy, gaps, before = 0.0, [], defaultdict(float)
    cur_start, cur_end, end_name = spans[0]  # the current busy interval and the kernel that ends it
    for start, end, name in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= GAP_US:
                gaps.append((start - cur_end, end_name, name))
                before[kernel_category(name)] += start - cur_end
            cur_start, cur_end, end_name = start, end, name
        elif end > cur_end:
            cur_end, end_name = end, name
    busy += cur_end - cur_start
    span = cur_end - spans[0][0]
    largest = sorted(gaps, key=lambda g: -g[0])[:TOP_GAPS]
    return {
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps": len(gaps),
        "gap_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "gap_ms_before": {c: round(us / 1e3, 3) for c, us in sorted(before.items(), key=lambda kv: -kv[1])},
        "largest_gaps": [{"us": round(us, 1), "after": a[:120], "before": b[:120]} for us, a, b in largest],
    }


def _device_kernels(events) -> list:
    # A record_function range also shows up on the device as a user annotation: not a kernel. Ours are named
    # REGION_RANGE...; Inductor's ("## Call CompiledFxGraph ... ##") span a whole compiled graph.
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if e.device_type == cuda and not e.name.startswith((REGION_RANGE, "## "))]


def _cpu_kernels(events) -> list:
    """The outermost CPU ops that are kernels of a category (GEMM, attention, generated C++, copies), and
    the leaf ops outside them; wrapper ranges (regions, compiled-graph calls) are looked through."""
    out = []
    stack = [e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU]
    while stack:
        e = stack.pop()
        if not e.name.startswith(REGION_RANGE) and (kernel_category(e.name) != "other" or not e.cpu_children):
            if not e.name.startswith(_NOT_KERNELS):
                out.append(e)
            continue
        stack.extend(e.cpu_children)
    return out


_NOT_KERNELS = ("## ", "[pgo]", "Torch-Compiled Region", "CompiledFunction", "TorchDynamo", "Pregraph bytecode",
                "AOTDispatcher", "aten::empty", "aten::resolve_conj", "aten::resolve_neg")


def _time(e, cuda: bool) -> float:
    return (e.device_time if cuda else e.cpu_time) / 1e3


def profile_buckets(model, regions, inputs: dict, device: str) -> dict:
    """Per bucket: one warm step (already compiled: no compiles), then one profiled step."""
    out = {}
    with torch.no_grad(), region_ranges(regions):
        for bucket, kwargs in inputs.items():
            model(**kwargs)  # warm: allocator, autotuning caches
            out[bucket] = profile_step(lambda kw=kwargs: model(**kw), device)
    return {"device": device, "buckets": out}
