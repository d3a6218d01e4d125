"""Outputs of an inspection: the terminal summary (rich), `--out DIR` files, and `--json`.

`--out DIR` layout (docs/inspect.md):

    DIR/inspect.json                               the whole report (schema.json)
    DIR/regions/REGION/KEY/{i}.{pass}.before.py    graph before each pass (readable Python)
    DIR/regions/REGION/KEY/{i}.{pass}.after.py     graph after it
    DIR/regions/REGION/KEY/{i}.{pass}.diff         unified diff (empty when the pass changed nothing)
    DIR/regions/REGION/KEY/matches.txt             the match table with model source lines
    DIR/regions/REGION/KEY/dynamo_graph.py         the graph Dynamo captured (model targets)
    DIR/regions/REGION/KEY/kernels/NAME.{py,cpp}   each generated kernel's source
    DIR/regions/REGION/KEY/output_code.N.*         Inductor's output code as generated
    DIR/dynamo/REGION.entry_N.py                   depyf's decompiled Dynamo entry points
    DIR/profile.md                                 the per-category profile table (--profile)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from omni_compile.inspect.categories import CATEGORIES, LABELS

# What write_out puts in a graph's directory: a file of an earlier run there (another pass order, more
# output code) would read as this run's.
_WRITTEN = re.compile(r"^(\d+\.\w+\.(before\.py|after\.py|diff)|output_code\.\d+\.\w+|matches\.txt|dynamo_graph\.py)$")


def region_rows(report: dict) -> list[dict]:
    """One row per compiled graph of each region (one per bucket or call): its buckets and call, instances,
    hash, op counts, matches, kernels."""
    rows = []
    for r in report["regions"]:
        for g in r["graphs"]:
            rows.append({
                "region": r["name"], "kind": r["kind"], "instances": len(r["instances"]), "key": g["key"],
                "graph_hash": g["graph_hash"][:12], "buckets": ", ".join(g["buckets"]), "call": g["call"],
                "ops_before": sum(g["op_counts"]["before"].values()),
                "ops_after": sum(g["op_counts"]["after"].values()),
                "matches": ", ".join(f"{k}={v}" for k, v in (g["matches"] or {}).items() if v) or "-",
                "kernels": sum(g["kernels"]["calls_by_category"].values()),
            })  # fmt: skip
    return rows


def pass_rows(report: dict) -> list[dict]:
    """One row per pass on each compiled graph: the graph ('REGION @ BUCKETS', with its key where the region
    has another graph for the same buckets), matches, diff lines, added ops, first model source line replaced."""
    rows = []
    for r in report["regions"]:
        seen = [", ".join(g["buckets"]) for g in r["graphs"]]
        for g in r["graphs"]:
            buckets = ", ".join(g["buckets"])
            graph = f"{r['name']} @ {buckets}" + (f" ({g['key'][:12]})" if seen.count(buckets) > 1 else "")
            for p in g["passes"]:
                site = p["sites"][0] if p["sites"] else None
                where = f"{Path(site['file']).name}:{site['line']} {site['code'][:40]}" if site else "-"
                added = ", ".join(f"{k.split('.', 1)[1]} x{v}" for k, v in p["added_ops"].items()
                                  if k.startswith("omni_compile"))  # fmt: skip
                rows.append({"graph": graph, "region": r["name"], "buckets": buckets, "key": g["key"],
                             "pass": p["name"], "matches": p["matches"], "diff_lines": p["diff"].count("\n"),
                             "added": added or "-", "where": where})  # fmt: skip
    return rows


def profile_rows(profile: dict | None) -> list[tuple[str, str, int, float, float]]:
    """(bucket, category label, kernels, ms, share) rows of the per-category table."""
    if not profile:
        return []
    rows = []
    for bucket, p in profile["buckets"].items():
        for cat in CATEGORIES:
            v = p["by_category"].get(cat)
            if v:
                rows.append((bucket, LABELS[cat], v["count"], v["ms"], v["share"]))
        rows.append((bucket, "total", p["kernels"], p["total_ms"], 1.0))
    return rows


def profile_markdown(profile: dict | None) -> str:
    if not profile:
        return ""
    lines = ["| bucket | category | kernels | ms | share |", "|---|---|---:|---:|---:|"]
    for b, label, n, ms, share in profile_rows(profile):
        lines.append(f"| {b} | {label} | {n} | {ms:.3f} | {100 * share:.1f}% |")
    for bucket, p in profile["buckets"].items():
        lines.append("")
        lines.append(f"Per region ({bucket}): " + ", ".join(f"{r} {v['ms']:.3f} ms over {v['calls']} calls"
                                                            for r, v in p["by_region"].items()))  # fmt: skip
    return "\n".join(lines) + "\n"


def print_summary(console, report: dict) -> None:
    from rich.table import Table

    t = Table(title=f"omni-compile inspect: {report['model']['source']} ({report['dtype']}, {report['device']}), "
              f"{report['target']['kind']}")  # fmt: skip
    cols = ("region", "buckets", "graph", "instances", "ops before", "ops after", "pass matches", "kernel calls")
    for col in cols:
        numeric = col in ("instances", "ops before", "ops after", "kernel calls")
        t.add_column(col, justify="right" if numeric else "left")
    for row in region_rows(report):
        t.add_row(row["region"], row["buckets"], row["key"], str(row["instances"]), str(row["ops_before"]),
                  str(row["ops_after"]), row["matches"], str(row["kernels"]))  # fmt: skip
    console.print(t)
    m = Table(title="pass matches and where they came from (first site per pass)")
    for col in ("graph", "pass", "matches", "diff lines", "added ops", "first model source line"):
        m.add_column(col, overflow="fold")
    for row in pass_rows(report):
        m.add_row(row["graph"], row["pass"], str(row["matches"]), str(row["diff_lines"]), row["added"], row["where"])
    console.print(m)
    for role, res in (report.get("attention") or {}).items():
        console.print(f"attention {role}: {res['implementation']} x{res['count']} ({res['reason']})")
    for op, res in (report.get("fused_op_implementations") or {}).items():
        console.print(f"fused op {op}: {res['implementation']} x{res['count']} ({res['reason']})")
    quality = report.get("quality")
    if quality:  # lossy options always print their error
        costs = ", ".join(f"{b} {q['rel_l2_vs_lossless']:.2e}" for b, q in quality["buckets"].items())
        console.print(f"quality: {', '.join(quality['lossy'])} (lossy): rel L2 against the model as given {costs}")
    if report.get("profile"):
        p = Table(title="profile: one step per bucket, time by kernel category")
        for col in ("bucket", "category", "kernels", "ms", "share"):
            p.add_column(col, justify="left" if col in ("bucket", "category") else "right")
        for b, label, n, ms, share in profile_rows(report["profile"]):
            p.add_row(b, label, str(n), f"{ms:.3f}", f"{100 * share:.1f}%")
        console.print(p)


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def write_out(report: dict, out: Path) -> None:
    """Every dump as files under `out` (layout in the module doc)."""
    out.mkdir(parents=True, exist_ok=True)
    for r in report["regions"]:
        for g in r["graphs"]:
            d = out / "regions" / r["name"] / g["key"]
            d.mkdir(parents=True, exist_ok=True)
            src = Path(g["dump_dir"])
            if src.resolve() != d.resolve():
                for f in d.iterdir():
                    if f.is_file() and _WRITTEN.match(f.name):
                        f.unlink()
                for f in src.iterdir() if src.is_dir() else []:
                    if f.is_file():
                        shutil.copyfile(f, d / f.name)
            for p in g["passes"]:
                (d / f"{p['index']}.{p['name']}.diff").write_text(p["diff"])
            (d / "matches.txt").write_text(match_table_text(g))
            kd = d / "kernels"
            kd.mkdir(exist_ok=True)
            for k in g["kernels"]["generated"]:
                if k["source"]:
                    (kd / f"{k['name']}.{'py' if k['language'] == 'triton' else 'cpp'}").write_text(k["source"])
    dyn = report.get("dynamo") or {}
    for item in dyn.get("regions", []):
        for e in item["entry_points"]:
            (out / "dynamo").mkdir(exist_ok=True)
            (out / "dynamo" / f"{item['region']}.entry_{e['index']}.py").write_text(e["decompiled"])
    if report.get("profile"):
        (out / "profile.md").write_text(profile_markdown(report["profile"]))
    write_json(report, out / "inspect.json")


def match_table_text(graph: dict) -> str:
    lines = []
    for p in graph["passes"]:
        lines.append(f"{p['index']}.{p['name']}: {p['matches']} match(es); added {p['added_ops'] or '-'}")
        for s in p["sites"]:
            lines.append(f"    {s['file']}:{s['line']} in {s['function']}: {s['code']}  "
                         f"({s['removed_nodes']} node(s) replaced: {s['removed_ops']})")  # fmt: skip
    return "\n".join(lines) + "\n"
