"""The passes across diffusers transformers (bench/coverage.py): every count of the coverage table in
docs/passes.md, asserted. The table (docs/data/coverage.json) is written by `python bench/coverage.py --write`
through Inductor; here each model goes through the same passes with Inductor's lowering left out (`--fast`,
seconds a model), so a pass that stops matching, or a recompile, fails here, and so does a table not
regenerated after a pass changed."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = {r["model"]: r for r in json.loads((ROOT / "docs" / "data" / "coverage.json").read_text())}


def _coverage():
    # Loaded by path: bench/ on sys.path would let bench/kernels.py shadow the `kernels` package transformers probes.
    spec = importlib.util.spec_from_file_location("omni_bench_coverage", ROOT / "bench" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_covers_eight_classes_without_an_adapter_of_every_kind():
    generic = [r for r in TABLE.values() if r["model"] not in ("flux", "wan")]
    assert len(generic) >= 8 and not any("error" in r for r in TABLE.values())
    kinds = " ".join(r["kind"] for r in generic)
    for kind in ("image", "video", "audio", "MMDiT", "single-stream"):
        assert kind in kinds, kind


@pytest.mark.compile  # each model through Dynamo and the passes (Inductor's lowering left out)
@pytest.mark.parametrize("name", sorted(TABLE))
def test_counts_of_the_coverage_table(name, fresh_dynamo, no_inductor_cache):
    cov = _coverage()
    ref, config, inputs_ref, shape, _ = cov.models()[name]
    row = cov.measure(name, ref, config, inputs_ref, shape, fast=True)
    expected = TABLE[name]
    assert row["matches"] == expected["matches"], (row["matches"], expected["matches"])
    assert row["occurs"] == expected["occurs"]
    assert row["compiles"] == expected["compiles"] == expected["expected_compiles"]  # one per region and call shape
    assert row["rel_l2"] < 1e-4 and expected["rel_l2"] < 1e-4


def test_a_pass_matches_wherever_its_pattern_occurs_or_the_table_says_why():
    cov = _coverage()
    for r in TABLE.values():
        for p, n in r["occurs"].items():
            if n and r["matches"][p] < n:
                assert (r["model"], p) in cov.NOTES, f"{r['model']}: {p} matched {r['matches'][p]} of {n}, no note"
