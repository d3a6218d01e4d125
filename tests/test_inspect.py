"""`omni-compile inspect`: graphs before/after every pass, match tables, kernels, Dynamo view, profile,
JSON against its schema, and the HTML report in a real headless Chromium.

Each model is compiled once per module (JIT, two small buckets); the artifact tests inspect the session's
flux-tiny artifact (`flux_artifact`, tests/conftest.py: two buckets) from its stored dumps through the CLI,
as on a machine without the build's GPU.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FLUX_ARTIFACT_BUCKETS
from omni_compile.inspect import InspectOptions, inspect

SCHEMA = Path(__file__).parent.parent / "omni_compile" / "inspect" / "schema.json"
FUSION = {
    "rms_norm": "omni_compile.rms_norm",
    "qk_norm_rope": "omni_compile.rms_norm_rope",
    "adaln": "omni_compile.adaln",
}
# Exact matches per region (docs/passes.md), with qk_norm_rope on: it consumes the q/k norms it fuses.
EXPECTED = {
    "FluxTransformerBlock": {"rms_norm": 4, "qk_norm_rope": 2, "adaln": 4},
    "FluxSingleTransformerBlock": {"rms_norm": 2, "qk_norm_rope": 2, "adaln": 1},
    "WanTransformerBlock": {"rms_norm": 4, "qk_norm_rope": 2, "adaln": 2},
}


def _no_caches():
    from torch._inductor import config

    return config.patch(fx_graph_cache=False)


# Two buckets each: every region is compiled once per bucket, and each graph must be told apart.
FLUX_BUCKETS = ["64x64", "128x128"]
WAN_BUCKETS = ["64x64x5", "64x96x9"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    torch._dynamo.reset()
    with _no_caches():
        report = inspect(InspectOptions(target="flux-tiny", shapes=",".join(FLUX_BUCKETS), profile=True),
                         tmp_path_factory.mktemp("flux"))  # fmt: skip
    torch._dynamo.reset()
    return report


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    torch._dynamo.reset()
    with _no_caches():
        opts = InspectOptions(target="wan-tiny", shapes=",".join(WAN_BUCKETS), dynamo=False)
        report = inspect(opts, tmp_path_factory.mktemp("wan"))
    torch._dynamo.reset()
    return report


def _check_diffs(report):
    """Every region, bucket and pass: the diff is non-empty exactly when the pass matched, and the dumps
    of one graph are one pass application each (pass i's after-graph is pass i+1's before-graph)."""
    checked = 0
    for region in report["regions"]:
        for g in region["graphs"]:
            assert g["passes"] or not g["dumps"]
            for p in g["passes"]:
                where = (region["name"], g["buckets"], p["index"], p["name"], p["matches"])
                assert p["changed"] == (p["diff"] != "") == (p["matches"] > 0), where
                checked += 1
            for p, q in zip(g["passes"], g["passes"][1:]):
                assert p["after"] == q["before"], (region["name"], g["buckets"], p["name"], q["name"])
    assert checked > 0


def _check_passes(report, regions, buckets):
    names = {r["name"] for r in report["regions"]}
    assert names == set(regions)
    assert report["buckets"] == buckets
    _check_diffs(report)
    for region in report["regions"]:
        # one distinct region: one compiled graph per bucket, named by its bucket and call
        assert [g["buckets"] for g in region["graphs"]] == [[b] for b in buckets]
        assert len({g["call"] for g in region["graphs"]}) == len(buckets)
        assert all("hidden_states 1x" in g["call"] for g in region["graphs"])  # the call's inputs, named
        for g in region["graphs"]:
            _check_graph(report, region, g)
    summed = {}
    for region in report["regions"]:
        for g in region["graphs"]:
            for name, n in g["matches"].items():
                summed[name] = summed.get(name, 0) + n
    assert summed == report["passes"]["matches"]


def _check_graph(report, region, g):
    passes = {p["name"]: p for p in g["passes"]}
    assert [p["name"] for p in g["passes"]] == report["passes"]["enabled"]
    assert {n: g["matches"][n] for n in FUSION} == EXPECTED[region["name"]]
    first_before = g["passes"][0]["before"]
    for name, op in FUSION.items():
        p = passes[name]
        assert p["matches"] == g["matches"][name]
        assert op not in first_before  # the graph before the passes has none of our ops
        assert p["added_ops"].get(op, 0) == p["matches"]  # each match is one fused node in the after graph
        assert p["after"].count(f"torch.ops.{op}.default(") >= p["matches"] > 0
        assert p["changed"] and p["diff"].startswith("---")
        assert p["sites"] and all(s["line"] > 0 and s["code"] for s in p["sites"])
    # The attention pass resolves each call; TORCH_SDPA (all the CPU has) keeps torch's node: no match.
    att = passes["attention"]
    assert att["matches"] == 0 and set(v["implementation"] for v in g["attention"].values()) == {"TORCH_SDPA"}
    assert sum(v["count"] for v in g["attention"].values()) >= 1  # resolved, and the report says so
    assert not att["changed"] and att["diff"] == ""
    lower = passes["lower_fused_ops"]  # on the CPU every fused op is inlined as its native body
    assert lower["matches"] == sum(v["count"] for v in g["fused_op_implementations"].values()) > 0
    assert lower["changed"] and not any(op in lower["after"] for op in FUSION.values())
    assert g["op_counts"]["before"] and g["op_kinds"]["before"]["gemm"] > 0
    k = g["kernels"]
    extern_categories = {e["category"] for e in k["extern"]}
    assert {"gemm", "attention"} <= extern_categories
    assert any(x["language"] == "cpp" and x["source"] for x in k["generated"])


@pytest.mark.compile
def test_flux_passes_and_kernels(flux):
    _check_passes(flux, ["FluxTransformerBlock", "FluxSingleTransformerBlock"], FLUX_BUCKETS)
    assert flux["regions"][0]["instances"] == ["transformer_blocks.0", "transformer_blocks.1"]


@pytest.mark.compile
def test_wan_passes_and_kernels(wan):
    _check_passes(wan, ["WanTransformerBlock"], WAN_BUCKETS)
    assert wan["dynamo"] is None and wan["profile"] is None


@pytest.mark.compile
def test_flux_dynamo_view(flux):
    d = flux["dynamo"]
    assert d["available"]
    for item in d["regions"]:
        # one compile per bucket; the second bucket's is a recompile for its shapes
        assert item["compiles"] == len(FLUX_BUCKETS) and len(item["recompile_reasons"]) == len(FLUX_BUCKETS) - 1
        assert item["explain"]["graph_count"] == 1 and item["explain"]["graph_break_count"] == 0
        assert len(item["entry_points"]) == len(FLUX_BUCKETS)
        assert all("def " in e["decompiled"] for e in item["entry_points"])


@pytest.mark.compile
def test_flux_profile(flux):
    p = flux["profile"]["buckets"]["64x64"]
    assert p["kernels"] == sum(v["count"] for v in p["by_category"].values())
    for cat in ("gemm", "attention", "triton"):  # addmm, SDPA, Inductor's generated C++ kernels
        assert p["by_category"][cat]["count"] > 0
    # 2 double and 2 single blocks: one range per instance call
    calls = {r: v["calls"] for r, v in p["by_region"].items()}
    assert calls == {"FluxTransformerBlock": 2, "FluxSingleTransformerBlock": 2}
    assert p["top_kernels"]


def cli(*args, env, timeout=900):
    return subprocess.run([sys.executable, "-P", "-m", "omni_compile.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def artifact_inspection(tmp_path_factory, subprocess_env, flux_artifact):
    art, out = flux_artifact.path, tmp_path_factory.mktemp("art") / "inspect"
    # Inspect from the stored dumps only: no compile, no device (what another machine does).
    proc = cli("inspect", str(art), "--out", str(out), "--html", str(out / "report.html"), "--json",
               str(out / "inspect.json"), env=dict(subprocess_env, CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "FluxSingleTransformerBlock" in proc.stderr  # the terminal summary
    return art, out, json.loads((out / "inspect.json").read_text())


@pytest.mark.compile
def test_artifact_matches_equal_build_report(artifact_inspection):
    art, out, report = artifact_inspection
    assert report["target"]["kind"] == "artifact"
    assert report["buckets"] == FLUX_ARTIFACT_BUCKETS and len(FLUX_ARTIFACT_BUCKETS) == 2
    _check_diffs(report)
    build = json.loads((art / "report" / "build_report.json").read_text())
    per_file = {(c["region"], Path(c["file"]).stem): c["passes"] for r in build["regions"] for c in r["compiles"]}
    total = {}
    for region in report["regions"]:
        for g in region["graphs"]:
            assert g["dumps"]
            assert g["matches"] == per_file[(region["name"], g["key"])]
            for p in g["passes"]:
                assert p["matches"] == per_file[(region["name"], g["key"])][p["name"]]
                assert p["changed"] == (p["matches"] > 0)
                if p["name"] in FUSION:
                    assert p["added_ops"].get(FUSION[p["name"]], 0) == p["matches"]
                d = out / "regions" / region["name"] / g["key"]
                assert (d / f"{p['index']}.{p['name']}.diff").read_text() == p["diff"]
                assert (d / f"{p['index']}.{p['name']}.before.py").is_file()
            for name, n in g["matches"].items():
                total[name] = total.get(name, 0) + n
    assert total == build["passes"]["matches"]
    assert sum(total[n] for n in FUSION) > 0
    kinds = {r["kind"] for r in report["regions"]}
    assert kinds == {"block", "glue"}


@pytest.mark.compile
def test_reports_validate_against_the_schema(flux, wan, artifact_inspection):
    jsonschema = pytest.importorskip("jsonschema")  # in the test extra
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for report in (flux, wan, artifact_inspection[2]):
        jsonschema.validate(json.loads(json.dumps(report)), schema, cls=jsonschema.Draft202012Validator)
        assert report["quality"] is None  # every option lossless: no cost to report
    bad = json.loads(json.dumps(wan))
    bad["regions"][0]["graphs"][0]["passes"][0].pop("diff")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.compile
def test_rows_name_their_bucket_and_call(flux, wan, artifact_inspection):
    """Each row of the region and pass tables (terminal and HTML) says which compiled graph it is: with two
    buckets a region has two graphs, which must not read as two identical rows."""
    from rich.console import Console

    from omni_compile.inspect.html import render
    from omni_compile.inspect.report import pass_rows, print_summary, profile_rows, region_rows

    for report in (flux, wan, artifact_inspection[2]):
        rows = region_rows(report)
        assert all(r["buckets"] and "?" not in r["buckets"] for r in rows)
        assert len({(r["region"], r["buckets"], r["call"]) for r in rows}) == len(rows)
        assert all(r["call"] for r in rows if r["kind"] == "block")
        passes = pass_rows(report)
        assert len({(r["region"], r["buckets"], r["key"], r["pass"]) for r in passes}) == len(passes)
        console = Console(width=1000, record=True, file=io.StringIO())
        print_summary(console, report)
        lines = [line for line in console.export_text().splitlines() if line.startswith("│")]
        # one line per row (nothing folds at this width; the profile table's rows come last) ...
        assert len(lines) == len(rows) + len(passes) + len(profile_rows(report.get("profile")))
        assert len(set(lines)) == len(lines)  # ... and no two rows read the same
        html = render(report)
        for region in report["regions"]:
            for g in region["graphs"]:
                assert f"{region['name']} @ {', '.join(g['buckets'])} <span" in html


@pytest.mark.compile
def test_out_holds_only_this_runs_files(flux, tmp_path):
    """`--out DIR` over an earlier run's DIR: no dump, diff or output code of that run is left beside this
    run's (another pass order leaves other `{i}.{pass}` names)."""
    from omni_compile.inspect.report import write_out

    region = flux["regions"][0]
    g = region["graphs"][0]
    d = tmp_path / "regions" / region["name"] / g["key"]
    d.mkdir(parents=True)
    (d / "0.gated_residual.diff").write_text("+ stale\n")
    (d / "9.rms_norm.after.py").write_text("stale")
    (d / "output_code.9.py").write_text("stale")
    (d / "notes.txt").write_text("the user's own file")
    write_out(flux, tmp_path)
    expected = {f.name for f in Path(g["dump_dir"]).iterdir() if f.is_file()}
    expected |= {f"{p['index']}.{p['name']}.diff" for p in g["passes"]} | {"matches.txt", "notes.txt"}
    assert {f.name for f in d.iterdir() if f.is_file()} == expected


class _NormProj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(32, eps=1e-6)
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(self.norm(x))


class _NormProjModel(torch.nn.Module):
    _repeated_blocks = ["_NormProj"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_NormProj(), _NormProj()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.compile
@pytest.mark.parametrize("switches", [[], ["-rms_norm"]])
def test_a_pass_that_matched_nothing_changed_nothing(switches, tmp_path, fresh_dynamo, no_inductor_cache):
    """Each pass's dump pair is one application of it, and a pass with 0 matches leaves the graph as it was.
    An RMSNorm with no rotary embedding after it: rms_norm fuses it (when on), qk_norm_rope has nothing to fuse."""
    import omni_compile
    from omni_compile.compiler import compile_state
    from omni_compile.inspect.graphs import read_graph_dumps

    model = _NormProjModel()
    omni_compile.compile(model, omni_compile.CompileConfig(passes=switches, dump_dir=str(tmp_path)))
    with torch.no_grad():
        model(torch.randn(2, 8, 32))
    (rec,) = compile_state(model).records
    passes = read_graph_dumps(tmp_path / rec.region / rec.graph_hash[:12], rec.passes)["passes"]
    assert [p["name"] for p in passes] == list(rec.passes) and rec.passes["qk_norm_rope"] == 0
    _check_diffs({"regions": [{"name": rec.region, "graphs": [{"buckets": ["-"], "dumps": True, "passes": passes}]}]})


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.compile
def test_html_in_headless_chromium(artifact_inspection, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("OMNI_COMPILE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("OMNI_COMPILE_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    _, out, report = artifact_inspection
    html = (out / "report.html").read_text()
    assert "http://" not in html and "https://" not in html and "<link" not in html  # no external assets
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--enable-logging=stderr", "--v=0", "--window-size=1400,1000"]  # fmt: skip
    url = (out / "report.html").resolve().as_uri()
    shot = tmp_path / "report.png"
    proc = subprocess.run([browser, *flags, f"--user-data-dir={tmp_path / 'p1'}", f"--screenshot={shot}", url],
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CONSOLE" not in proc.stderr and "Uncaught" not in proc.stderr, proc.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a rendered page, not a blank one
    dom = subprocess.run([browser, *flags, f"--user-data-dir={tmp_path / 'p2'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "CONSOLE" not in dom.stderr and "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    assert '<body data-ready="1"' in dom.stdout  # the inline script ran to the end
    assert '<div id="js-errors"></div>' in dom.stdout  # and reported no script error
    assert 'id="regions-table"' in dom.stdout
    for region in report["regions"]:
        assert f">{region['name']}</a>" in dom.stdout


def test_kernel_categories_and_output_code_parsing():
    from omni_compile.inspect.categories import kernel_category
    from omni_compile.inspect.kernels import parse_output_code

    cases = {
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "gemm", "aten::addmm": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention",
        "fmha_cutlassF_f32_aligned_64x64": "attention",
        "_rms_norm_rope_kernel": "fused_ops", "_adaln_kernel": "fused_ops", "triton_poi_fused_add_0": "triton",
        "graph_0_cpp_fused_add_1": "triton", "Memcpy DtoD (Device -> Device)": "copy", "aten::gelu": "other",
    }  # fmt: skip
    assert {n: kernel_category(n) for n in cases} == cases
    code = (
        "_adaln_kernel_0 = async_compile.triton('_adaln_kernel', '''\n@triton.jit\ndef _adaln_kernel(x): pass\n''')\n"
        "triton_poi_fused_add_1 = async_compile.triton('triton_poi_fused_add_1', '''\ndef triton_poi(x): pass\n''')\n"
        "def call(args):\n"
        "    extern_kernels.mm(a, b, out=c)\n    extern_kernels.mm(a, b, out=d)\n"
        "    _adaln_kernel_0.run(x, y)\n    triton_poi_fused_add_1.run(x)\n    triton_poi_fused_add_1.run(y)\n"
        "    buf = torch.ops.aten._scaled_dot_product_cudnn_attention.default(q, k, v)\n"
    )
    parsed = parse_output_code(code)
    gen = {k["name"]: (k["kernel"], k["user_kernel"], k["category"], k["calls"]) for k in parsed["generated"]}
    assert gen == {"_adaln_kernel_0": ("_adaln_kernel", True, "fused_ops", 1),
                   "triton_poi_fused_add_1": ("triton_poi_fused_add_1", False, "triton", 2)}  # fmt: skip
    assert {e["name"]: (e["calls"], e["category"]) for e in parsed["extern"]} == {
        "extern_kernels.mm": (2, "gemm"), "aten._scaled_dot_product_cudnn_attention": (1, "attention")}  # fmt: skip


def test_cuda_artifact_built_on_an_h200_read_here(tmp_path):
    """A flux-tiny CUDA artifact built on the H200 (run 10: manifest, build report and report/inspect/ of its
    two block regions; compiled files and glue left out) is inspected here, with no GPU and no compile."""
    import tarfile

    from omni_compile.inspect import inspect_artifact

    with tarfile.open(Path(__file__).parent / "data" / "inspect-flux-tiny-h200.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    art = tmp_path / "flux-tiny-h200"
    # The manifest of run 10 predates the weights record kept in the tarball (left out), the seed, the
    # example-input function and the regions' calling convention: give it those fields (the convention of
    # its time) so that it reads as a current manifest; inspect reads none of them.
    m = json.loads((art / "manifest.json").read_text())
    m.setdefault("weights", {"reference": "random seed 0", "seed": 0, "tensors": {}})
    m["build"].update({"region_call": "(state, args, kwargs)", "seed": 0, "example_inputs": None})
    (art / "manifest.json").write_text(json.dumps(m))
    report = inspect_artifact(art)
    assert report["device"] == "cuda" and report["platform"]["device_name"] == "NVIDIA H200"
    build = json.loads((art / "report" / "build_report.json").read_text())
    per_file = {(f["region"], Path(f["file"]).stem): f["passes"] for f in build["files"]}
    for region in report["regions"]:
        (g,) = region["graphs"]
        assert g["matches"] == per_file[(region["name"], g["key"])] == EXPECTED[region["name"]] | g["matches"]
        passes = {p["name"]: p for p in g["passes"]}
        for name, op in FUSION.items():
            assert op not in g["passes"][0]["before"]
            assert passes[name]["added_ops"].get(op, 0) == passes[name]["matches"] > 0
        # On CUDA each fused op is lowered to an embedded launch of our Triton kernel ...
        added = passes["lower_fused_ops"]["added_ops"]
        assert added["higher_order.triton_kernel_wrapper_functional"] == g["matches"]["lower_fused_ops"]
        # ... which Inductor's output code declares with its source and launches once per fused op.
        user = [k for k in g["kernels"]["generated"] if k["user_kernel"]]
        assert all("@triton.jit" in k["source"] and k["category"] == "fused_ops" for k in user)
        launches = {}
        for k in user:
            launches[k["kernel"]] = launches.get(k["kernel"], 0) + k["calls"]
        m = g["matches"]
        assert launches == {"_adaln_kernel": m["adaln"], "_rms_norm_rope_kernel": m["qk_norm_rope"]}
        assert g["kernels"]["calls_by_category"]["gemm"] > 0 and g["kernels"]["calls_by_category"]["triton"] > 0
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, json.loads(SCHEMA.read_text()), cls=jsonschema.Draft202012Validator)
