"""One self-contained HTML report: inline CSS and a little inline JS, no network, no external assets.

Rendered in Python (it reads without JS); the JS only adds a region filter and expand/collapse-all, and
writes any script error into `#js-errors` (the browser test reads it). Navigation follows the issue:
regions -> passes (before / after / diff, match table) -> kernels -> Dynamo -> profile.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from omni_compile.inspect.report import profile_rows, region_rows

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;display:flex;color:#1b1f24}
nav{width:260px;min-width:260px;height:100vh;overflow:auto;position:sticky;top:0;background:#f3f4f6;padding:12px;
box-sizing:border-box;font-size:13px}
nav a{display:block;color:#0b5394;text-decoration:none;padding:1px 0}
nav .l2{padding-left:12px}nav .l3{padding-left:24px}
main{flex:1;padding:16px 24px;min-width:0}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#eef1f4}td.n{text-align:right}
pre{background:#f6f8fa;border:1px solid #d0d7de;padding:8px;overflow:auto;max-height:520px;font-size:12px}
.add{background:#e6ffec;display:block}.del{background:#ffebe9;display:block}.hunk{color:#6639ba;display:block}
details{margin:4px 0}summary{cursor:pointer;font-weight:600}.muted{color:#57606a}
#js-errors:empty{display:none}#js-errors{background:#ffebe9;border:1px solid #cf222e;padding:8px}
h2{border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:28px}
"""

_JS = """
window.__errors=[];
window.addEventListener('error',function(e){window.__errors.push(String(e.message));
 document.getElementById('js-errors').textContent='script error: '+window.__errors.join('; ');});
document.addEventListener('DOMContentLoaded',function(){
 var f=document.getElementById('region-filter');
 f.addEventListener('input',function(){var q=f.value.toLowerCase();
  document.querySelectorAll('#regions-table tbody tr').forEach(function(r){
   r.style.display=r.textContent.toLowerCase().indexOf(q)>=0?'':'none';});});
 document.getElementById('expand-all').addEventListener('click',function(){
  document.querySelectorAll('details').forEach(function(d){d.open=true;});});
 document.getElementById('collapse-all').addEventListener('click',function(){
  document.querySelectorAll('details').forEach(function(d){d.open=false;});});
 document.body.setAttribute('data-ready','1');
});
"""


def _table(headers, rows, table_id=None, numeric=()) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=n' if i in numeric else ''}>{c}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    tid = f' id="{table_id}"' if table_id else ""
    return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _pre(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def _diff(text: str) -> str:
    if not text:
        return "<p class=muted>no change</p>"
    out = []
    for line in text.splitlines():
        cls = {"@": "hunk", "+": "add", "-": "del"}.get(line[:1], "")
        out.append(f'<span class="{cls}">{escape(line)}</span>' if cls else escape(line))
    return "<pre>" + "\n".join(out) + "</pre>"


def _anchor(*parts: str) -> str:
    return "-".join("".join(c if c.isalnum() else "_" for c in p) for p in parts)


def _graph_section(region: dict, g: dict) -> tuple[str, list[str]]:
    gid = _anchor(region["name"], g["key"])
    buckets = escape(", ".join(g["buckets"]))
    nav = [f'<a class=l2 href="#{gid}">{buckets} <span class=muted>{escape(g["key"][:12])}</span></a>']
    parts = [f'<h3 id="{gid}">{escape(region["name"])} @ {buckets} <span class=muted>({escape(g["key"])})</span></h3>',
             f"<p>buckets {buckets}; call <code>{escape(g['call'] or '-')}</code>; "
             f"graph hash <code>{escape(g['graph_hash'])}</code></p>"]  # fmt: skip
    kinds = sorted(set(g["op_kinds"]["before"]) | set(g["op_kinds"]["after"]))
    parts.append(_table(["op kind", "before passes", "after passes"],
                        [[escape(k), g["op_kinds"]["before"].get(k, 0), g["op_kinds"]["after"].get(k, 0)]
                         for k in kinds],
                        numeric=(1, 2)))  # fmt: skip
    rows = []
    for p in g["passes"]:
        pid = _anchor(region["name"], g["key"], str(p["index"]), p["name"])
        sites = "<br>".join(f"{escape(Path(s['file']).name)}:{s['line']} <code>{escape(s['code'])}</code> "
                            f"({s['removed_nodes']} nodes)" for s in p["sites"]) or "-"  # fmt: skip
        added = ", ".join(f"{escape(k)} x{v}" for k, v in p["added_ops"].items()) or "-"
        rows.append([f'<a href="#{pid}">{escape(p["name"])}</a>', p["matches"], p["diff"].count("\n"), added, sites])
    parts.append("<h4>Passes: match table</h4>")
    parts.append(_table(["pass", "matches", "diff lines", "added ops", "model source lines matched"], rows,
                        table_id=f"matches-{gid}", numeric=(1, 2)))  # fmt: skip
    for p in g["passes"]:
        pid = _anchor(region["name"], g["key"], str(p["index"]), p["name"])
        nav.append(f'<a class=l3 href="#{pid}">{p["index"]}. {escape(p["name"])} ({p["matches"]})</a>')
        parts.append(f'<details id="{pid}"><summary>{p["index"]}. {escape(p["name"])}: {p["matches"]} match(es), '
                     f'{"changed" if p["changed"] else "unchanged"}</summary>'
                     f"<details open><summary>diff</summary>{_diff(p['diff'])}</details>"
                     f"<details><summary>before</summary>{_pre(p['before'])}</details>"
                     f"<details><summary>after</summary>{_pre(p['after'])}</details></details>")  # fmt: skip
    kid = _anchor(region["name"], g["key"], "kernels")
    nav.append(f'<a class=l3 href="#{kid}">kernels</a>')
    k = g["kernels"]
    parts.append(f'<h4 id="{kid}">Kernels</h4>')
    by_cat = ", ".join(f"{c} {n}" for c, n in k["calls_by_category"].items())
    parts.append(f"<p>calls by category: {escape(by_cat)}</p>")
    parts.append(_table(["extern call", "calls", "category"],
                        [[escape(e["name"]), e["calls"], e["category"]] for e in k["extern"]],
                        numeric=(1,)))  # fmt: skip
    for kern in k["generated"]:
        tag = " (user kernel)" if kern["user_kernel"] else ""
        parts.append(f"<details><summary>{escape(kern['name'])} [{kern['language']}{tag}, {kern['category']}, "
                     f"{kern['calls']} call(s)]</summary>"
                     f"{_pre(kern['source'] or '(source not stored)')}</details>")  # fmt: skip
    res = [[escape(op), escape(v["implementation"]), v["count"], escape(v["reason"])]
           for op, v in {**g["fused_op_implementations"], **g["attention"]}.items()]  # fmt: skip
    if res:
        parts.append(_table(["fused op / attention role", "resolved to", "count", "why"], res, numeric=(2,)))
    if g.get("dynamo_graph"):
        parts.append(f"<details><summary>Dynamo graph</summary>{_pre(g['dynamo_graph'])}</details>")
    return "\n".join(parts), nav


def render(report: dict) -> str:
    nav = ['<b>omni-compile inspect</b>', '<a href="#regions">Regions</a>']
    body = [f"<h1>{escape(report['model']['source'])}</h1>",
            f"<p>{escape(report['target']['kind'])}; {escape(report['dtype'])} on {escape(report['device'])} "
            f"({escape(str(report['platform'].get('device_name', '')))}); "
            f"buckets {escape(', '.join(report['buckets']))}; "
            f"passes {escape(', '.join(report['passes']['enabled']))}</p>",
            '<div id="js-errors"></div>',
            '<p><input id="region-filter" placeholder="filter regions"> <button id="expand-all">expand all</button> '
            '<button id="collapse-all">collapse all</button></p>',
            '<h2 id="regions">Regions</h2>']  # fmt: skip
    rows = []
    for r in region_rows(report):
        link = f'<a href="#{_anchor(r["region"], r["key"])}">{escape(r["region"])}</a>'
        rows.append([link, escape(r["buckets"]), f"<code>{escape(r['call'] or '-')}</code>", r["kind"],
                     r["instances"], f"<code>{r['graph_hash']}</code>", r["ops_before"], r["ops_after"],
                     escape(r["matches"]), r["kernels"]])  # fmt: skip
    body.append(_table(["region", "buckets", "call", "kind", "instances", "graph hash", "ops before", "ops after",
                        "pass matches", "kernel calls"], rows, table_id="regions-table",
                       numeric=(4, 6, 7, 9)))  # fmt: skip
    attn = [[escape(role), escape(v["implementation"]), v["count"], escape(v["reason"])]
            for role, v in (report.get("attention") or {}).items()]  # fmt: skip
    if attn:
        body.append(_table(["attention role", "backend", "calls", "why"], attn, numeric=(2,)))
    for region in report["regions"]:
        nav.append(f'<a href="#{_anchor(region["name"])}">{escape(region["name"])}</a>')
        body.append(f'<h2 id="{_anchor(region["name"])}">{escape(region["name"])} <span class=muted>'
                    f'({escape(region["class"])}, {len(region["instances"])} instance(s))</span></h2>')  # fmt: skip
        for g in region["graphs"]:
            html, gnav = _graph_section(region, g)
            body.append(html)
            nav += gnav
    nav.append('<a href="#dynamo">Dynamo</a>')
    body.append(_dynamo(report.get("dynamo")))
    nav.append('<a href="#profile">Profile</a>')
    body.append(_profile(report.get("profile")))
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>omni-compile inspect: "
            f"{escape(report['model']['source'])}</title><style>{_CSS}</style><script>{_JS}</script></head>"
            f"<body><nav>{''.join(nav)}</nav><main>{''.join(body)}</main></body></html>\n")  # fmt: skip


def _dynamo(d: dict | None) -> str:
    if not d or not d.get("available"):
        why = (d or {}).get("reason", "not collected (--no-dynamo)")
        return f'<h2 id="dynamo">Dynamo</h2><p class=muted>{escape(why)}</p>'
    parts = ['<h2 id="dynamo">Dynamo</h2>']
    rows = []
    for item in d["regions"]:
        ex = item.get("explain") or {}
        breaks = "<br>".join(escape(f"{b['reason']} at {b['where']}") for b in ex.get("break_reasons", [])) or "none"
        rows.append([escape(item["region"]), item["compiles"], ex.get("graph_count", "-"),
                     ex.get("graph_break_count", "-"),
                     breaks, "<br>".join(escape(x) for x in item["recompile_reasons"]) or "none"])  # fmt: skip
    parts.append(_table(["region", "compiles", "graphs", "graph breaks", "break reasons", "recompile reasons"], rows,
                        numeric=(1, 2, 3)))  # fmt: skip
    for item in d["regions"]:
        for e in item["entry_points"]:
            parts.append(f"<details><summary>{escape(item['region'])}: decompiled entry point {e['index']} "
                         f"({escape(e['name'])})</summary>{_pre(e['decompiled'])}</details>")  # fmt: skip
    return "\n".join(parts)


def _profile(p: dict | None) -> str:
    if not p:
        return '<h2 id="profile">Profile</h2><p class=muted>not collected (run with --profile)</p>'
    parts = ['<h2 id="profile">Profile</h2>']
    parts.append(_table(["bucket", "category", "kernels", "ms", "share"],
                        [[escape(b), escape(c), n, f"{ms:.3f}", f"{100 * s:.1f}%"]
                         for b, c, n, ms, s in profile_rows(p)],
                        table_id="profile-table", numeric=(2, 3, 4)))  # fmt: skip
    for bucket, b in p["buckets"].items():
        parts.append(f"<h3>{escape(bucket)}: per region, top kernels</h3>")
        regions = [[escape(r), v["calls"], f"{v['ms']:.3f}"] for r, v in b["by_region"].items()]
        parts.append(_table(["region", "calls", "ms"], regions, numeric=(1, 2)))
        parts.append(_table(["kernel", "category", "count", "ms"], [[escape(k["name"][:120]), k["category"], k["count"],
                     f"{k['ms']:.3f}"] for k in b["top_kernels"]], numeric=(2, 3)))  # fmt: skip
    return "\n".join(parts)


def write_html(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(report))
