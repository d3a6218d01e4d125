"""The build pipeline (`omni_compile.build.pipeline`): one driver for every region compiler, the compiler
registry, one report schema for both modes, and the parity check that keeps a wrong build unpublished.

The pipeline's own behaviour is tested with a fake region compiler registered for the test (its "compiled"
model is the eager one, its outputs optionally wrong): no Inductor compile, seconds on a CPU. The real
compilers' reports come from the session's builds (`flux_jit_build`, `flux_artifact`, tests/conftest.py)."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from omni_compile.artifact.aot import Target
from omni_compile.build.compilers import COMPILERS, select
from omni_compile.build.pipeline import BuildPipeline, staging
from omni_compile.build.report import SCHEMA, SCHEMA_FILE
from omni_compile.build.session import BuildOptions
from omni_compile.counters import counters
from omni_compile.errors import ConfigError, OmniCompileError


class _NoCompiles:
    bucket = None

    def compiles(self) -> int:
        return 0


class FakeCompiler:
    """A region compiler whose compiled model is the eager model, its outputs times `scale`."""

    name = "fake-eager"
    mode = "fake"
    format = None
    report_path = "build_report.json"
    eager_trace = False
    compiles_glue = False
    trace_stage = "running eagerly"
    scale = 1.0

    @classmethod
    def default_for(cls, device):
        return True

    def check(self, opts):
        pass

    def open(self, build):
        return contextlib.nullcontext()

    def targets(self, build):
        return [Target(r.name, "block", list(r.instances)) for r in build.regions]

    def tracing(self, build):
        return contextlib.nullcontext(_NoCompiles())

    def compile(self, build, tmp):
        return [{"region": t.name, "graph_hash": "0" * 64, "seconds": 0.0, "passes": {"rms_norm": 1},
                 "fused_op_implementations": {}, "attention": {}} for t in build.targets]  # fmt: skip

    def inherited_parity(self, build):
        return None

    def compiled_outputs(self, build, tmp):
        return {b: out * self.scale for b, out in build.traced.items()}

    def write(self, build, tmp):
        (tmp / "compiled.txt").write_text("the fake compiler's file\n")

    def section(self, build):
        return {"name": self.name, "mode": self.mode}

    def result(self, build, report):
        return report


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(COMPILERS, FakeCompiler.name, FakeCompiler)
    return FakeCompiler


def _opts(out, **kw):
    return BuildOptions(model="flux-tiny", shapes="64x64", out=str(out), mode="fake", **kw)


def validate(report):
    jsonschema = pytest.importorskip("jsonschema")  # in the test extra
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(json.dumps(report)), schema, cls=jsonschema.Draft202012Validator)


def test_registry_holds_the_three_compilers():
    assert set(COMPILERS) >= {"inductor-jit", "aoti-package", "inductor-standalone"}
    assert select(BuildOptions(mode="jit"), "cpu").name == "inductor-jit"
    assert select(BuildOptions(mode="aot", out="o"), "cpu").name == "aoti-package"  # by device
    assert select(BuildOptions(mode="aot", out="o"), "cuda").name == "inductor-standalone"
    assert select(BuildOptions(mode="aot", out="o", format="aoti-package"), "cuda").name == "aoti-package"


@pytest.mark.parametrize(
    "opts,message",
    [
        (BuildOptions(mode="ahead"), "unknown build mode 'ahead'; choose one of aot, jit"),
        (BuildOptions(mode="aot", out="o", format="onnx"),
         "unknown --format 'onnx'; choose one of aoti-package, inductor-standalone"),
        (BuildOptions(mode="jit", format="aoti-package"),
         "--format chooses an artifact build's compiled-file format; use it with --mode aot"),
        (BuildOptions(mode="jit", store="file:///tmp/s"), "--mode jit --store needs a redis:// store"),
        (BuildOptions(mode="aot", out="o", cache_from="d"), "--cache-from warm-starts a JIT build"),
        (BuildOptions(mode="aot"), "an artifact build needs --out DIR"),
    ],
)
def test_a_wrong_choice_is_a_one_line_config_error(opts, message):
    with pytest.raises(ConfigError) as e:
        select(opts, "cpu")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_registered_compiler_runs_every_stage(fake, tmp_path):
    out = tmp_path / "out"
    with counters.expect(regions_compiled=0, aot_compiles=0, region_exports=0):
        report = BuildPipeline(_opts(out)).run()
    validate(report)
    assert json.loads((out / "build_report.json").read_text()) == report
    assert (out / "compiled.txt").is_file() and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert report["schema"] == SCHEMA and report["compiler"] == {"name": "fake-eager", "mode": "fake"}
    assert [r["name"] for r in report["regions"]] == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    assert report["passes"]["matches"] == {"rms_norm": 2} and report["compilations"]["region_compiles"] == 2
    assert report["parity"]["buckets"]["64x64"]["rel_l2_vs_eager"] == 0.0
    assert report["buckets"] == [{"bucket": "64x64", "first_call_seconds": report["buckets"][0]["first_call_seconds"],
                                  "region_compiles": 0}]  # fmt: skip


@pytest.mark.parametrize("scale", [1.5, math.nan])
def test_a_parity_failure_publishes_nothing(fake, monkeypatch, tmp_path, scale):
    monkeypatch.setattr(FakeCompiler, "scale", scale)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("the previous build")
    with pytest.raises(OmniCompileError, match=r"do not match eager on bucket\(s\) 64x64 .*Nothing was published"):
        BuildPipeline(_opts(out, force=True)).run()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial directory left
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "the previous build"


def test_staging_removes_its_directory_when_the_block_raises(tmp_path):
    with pytest.raises(KeyboardInterrupt), staging(tmp_path / "out", force=False) as tmp:
        (tmp / "half").write_text("x")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with staging(None, force=False) as tmp:
        assert tmp is None


@pytest.mark.compile
def test_both_modes_write_one_report_schema(flux_jit_build, flux_artifact):
    jit = flux_jit_build.report
    aot = json.loads((flux_artifact.path / "report" / "build_report.json").read_text())
    manifest = json.loads((flux_artifact.path / "manifest.json").read_text())
    for report in (jit, aot):
        validate(report)
    assert jit.keys() == aot.keys()
    assert jit["compiler"]["name"] == "inductor-jit" and aot["compiler"]["name"] == "aoti-package"
    for section in ("model", "parity", "timing", "attention", "passes"):
        assert jit[section].keys() == aot[section].keys(), section
    assert jit["regions"][0].keys() == aot["regions"][0].keys()
    shared = {"region", "graph_hash", "seconds", "passes", "fused_op_implementations", "attention"}
    assert all(shared <= c.keys() for r in jit["regions"] + aot["regions"] for c in r["compiles"])
    # the ahead-of-time report says what the manifest says, and names every file
    assert aot["parity"]["buckets"] == manifest["parity"] and aot["timing"] == manifest["timing"]
    files = {e["file"] for r in manifest["regions"] for entries in r["buckets"].values() for e in entries}
    assert set(aot["compiler"]["files"]) == files == {c["file"] for r in aot["regions"] for c in r["compiles"]}
    assert [r["name"] for r in aot["regions"]] == [r["name"] for r in manifest["regions"]]
    n = len(files)
    assert {k: aot["compilations"][k] for k in ("aot_compiles", "region_exports", "region_compiles", "cache_hits")} \
        == {"aot_compiles": n, "region_exports": n, "region_compiles": n, "cache_hits": 0}  # fmt: skip
    assert aot["passes"]["matches"] == manifest["fusion"]["matches"]
    assert jit["compilations"]["region_compiles"] == 2 and jit["compilations"]["aot_compiles"] == 0


class _DataDependent(torch.nn.Module):
    def forward(self, x):
        counts = torch.bincount(x.int().flatten()).cpu().numpy()  # what export cannot trace (HiDream's MoE routing)
        return x * float(counts[0])


def test_a_region_that_does_not_trace_is_named_with_the_models_line():
    """An ahead-of-time compile error names the line of the model's code it came from (HiDream's MoE routing read
    `.numpy()` of a tensor, and the build said only ".numpy() is not supported for tensor subclasses")."""
    import inspect

    from omni_compile.build.compilers.aot import model_frame

    with pytest.raises(Exception) as e:  # noqa: PT011 - torch's error type for this varies between releases
        torch.export.export(_DataDependent(), (torch.ones(4),), strict=False)
    line = inspect.getsourcelines(_DataDependent.forward)[1] + 1
    assert model_frame(e.value) == f"test_build_pipeline.py:{line} (forward)"
    assert model_frame(ValueError("raised here, no traceback")) is None
