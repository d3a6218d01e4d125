"""The build pipeline: one driver, `BuildPipeline`, for every build mode.

    resolve -> load -> find_regions -> trace -> compile -> check -> publish

Each stage is a method; `run` calls them in order. What differs between modes is the region compiler
(`build.compilers`: Inductor JIT, an AOTInductor package, an Inductor standalone file), chosen in `resolve`
from `--mode` and `--format`; the stages ask it, never the mode. `compile`, `check` and `publish` work in a
temporary directory beside the output, renamed into place at the end: a failed build (a compile error, a
parity failure, an interrupt) leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omni_compile.artifact.parity import PARITY_BOUND, bucket_output, rel_l2
from omni_compile.build.compilers import select
from omni_compile.build.report import build_report
from omni_compile.build.session import BuildEvents, BuildOptions, BuildSession, check_out, sync
from omni_compile.config import dtype_name
from omni_compile.counters import counters
from omni_compile.errors import ConfigError, OmniCompileError
from omni_compile.graphs import find_regions

logger = logging.getLogger("omni_compile.build")


class BuildPipeline:
    """One build of `opts`, stage by stage. The stages leave their results on the pipeline, where the
    region compiler and the report read them."""

    def __init__(self, opts: BuildOptions, events: BuildEvents | None = None):
        self.opts = opts
        self.events = events or BuildEvents()
        self.t_start = time.perf_counter()
        self._counts = _compilations()
        self.session: BuildSession | None = None
        self.compiler = None  # build.compilers.RegionCompiler
        self.out: Path | None = None
        self.model: torch.nn.Module | None = None
        self.transformed: dict[str, int] = {}  # weight transform -> modules it changed
        # bucket -> (example inputs, eager output of the model as given): the parity reference
        self.references: dict[str, tuple[dict, torch.Tensor]] = {}
        # bucket -> the eager output of the model as given, when a lossy transform runs (the cost's reference)
        self.lossless: dict[str, torch.Tensor] = {}
        self.regions: list = []  # graphs.Region, the repeated blocks
        self.targets: list = []  # artifact.aot.Target, what the compiler compiles
        self.traced: dict[str, torch.Tensor] = {}  # bucket -> the traced forward's output
        self.bucket_reports: list[dict[str, Any]] = []
        self.compiles: list[dict[str, Any]] = []  # one record per region compile (the compiler's)
        self.parity: dict[str, dict] = {}
        self.timing: dict[str, float] = {}
        self.compilations: dict[str, int] = {}

    def run(self) -> dict[str, Any]:
        """All stages; returns what the region compiler returns for the build (`RegionCompiler.result`)."""
        self.resolve()
        with self.compiler.open(self):
            self.load()
            self.find_regions()
            self.trace()
            with staging(self.out, self.opts.force) as tmp:
                self.compile(tmp)
                self.check(tmp)
                return self.publish(tmp)

    def resolve(self) -> None:
        """The model spec, targets and region compiler, checked before any slow work."""
        from omni_compile.weights import check_transforms, fp8_device_error

        check_transforms(list(self.opts.compile.weight_transforms), self.opts.compile.fp8_keep)
        self.session = BuildSession.resolve(self.opts)
        if "fp8" in self.opts.compile.weight_transforms:  # refused before the model loads, nothing written
            why = fp8_device_error(self.session.device, self.session.dtype)
            if why:
                raise ConfigError(why)
        self.compiler = select(self.opts, self.session.device)
        self.out = Path(self.opts.out) if self.opts.out else None
        if self.out is not None:
            check_out(self.out, self.opts.force)

    def load(self) -> None:
        """The model; its eager outputs when the traced forward will not give them; the weight transforms."""
        s = self.session
        self.events.on_stage(f"loading {s.spec.source} ({dtype_name(s.dtype)}, {s.device})")
        t0 = time.perf_counter()
        self.model = s.load_model()
        self.timing["model_load_seconds"] = round(time.perf_counter() - t0, 3)
        # Load-time weight transforms run before the trace: the compiled regions take the transformed weights.
        # The parity reference is the model as given (its eager output per bucket, taken first); after a lossy
        # transform it is the transformed eager model, and the model as given is what the cost is measured on.
        from omni_compile.weights import LOSSY, apply_transforms

        transforms = list(self.opts.compile.weight_transforms)
        if transforms or not self.compiler.eager_trace:
            self.references = self._eager_outputs()
        if transforms:
            blocks = [m for r in find_regions(self.model, s.spec.block_names(self.model)) for _, m in r.instances]
            self.transformed = apply_transforms(self.model, transforms, blocks, self.opts.compile.fp8_keep)
            done = ", ".join(f"{n} ({k} modules)" for n, k in self.transformed.items())
            self.events.on_stage(f"weight transforms: {done}")
            if any(t in LOSSY for t in transforms):
                self.lossless = {b: ref for b, (_, ref) in self.references.items()}
                self.references = self._eager_outputs()

    def _eager_outputs(self) -> dict[str, tuple[dict, torch.Tensor]]:
        """bucket -> (example inputs, the model's eager output on them), for every bucket."""
        s, out = self.session, {}
        with torch.no_grad():
            for bucket in s.buckets + s.check_buckets:
                inputs = s.example_inputs(self.model, bucket)
                out[str(bucket)] = (inputs, bucket_output(self.model(**inputs)).clone())
        return out

    def find_regions(self) -> None:
        """The repeated blocks (`graphs.find_regions`) and what the compiler compiles of the model."""
        spec, pm = self.session.spec, self.session.pass_manager
        self.regions = find_regions(self.model, spec.block_names(self.model))
        if not self.regions:
            raise OmniCompileError(f"{spec.source}: no repeated blocks found; nothing to compile")
        self.targets = self.compiler.targets(self)
        glue = ", ".join(t.name for t in self.targets if t.kind == "glue") or "none"
        self.events.on_stage(
            f"{len(self.regions)} region(s): " + ", ".join(f"{r.name} x{len(r.instances)}" for r in self.regions)
            + (f"; glue: {glue}" if self.compiler.compiles_glue else "")
            + f"; passes: {', '.join(pm.enabled) or 'none'}"
        )

    def trace(self) -> None:
        """One forward per bucket under the compiler's tracing (which records, or compiles, each region)."""
        s, model = self.session, self.model
        with self.compiler.tracing(self) as tracer, torch.no_grad():
            for i, bucket in enumerate(s.buckets, 1):
                key = str(bucket)
                self.events.on_stage(f"bucket {bucket} ({i}/{len(s.buckets)}): {self.compiler.trace_stage}")
                inputs = self.references[key][0] if key in self.references else s.example_inputs(model, bucket)
                tracer.bucket = key
                before = tracer.compiles()
                sync(s.device)
                t0 = time.perf_counter()
                output = bucket_output(model(**inputs))
                sync(s.device)
                seconds = time.perf_counter() - t0
                if key in self.references:
                    self.traced[key] = output
                else:  # an eager trace of the model as given: the parity reference
                    self.references[key] = (inputs, output.clone())
                compiles = tracer.compiles() - before
                self.events.on_bucket_done(bucket, seconds, compiles)
                self.bucket_reports.append({"bucket": key, "first_call_seconds": round(seconds, 3),
                                            "region_compiles": compiles})  # fmt: skip
        with torch.no_grad():  # --dynamic: sizes checked against eager, not traced
            for bucket in s.check_buckets:
                if str(bucket) not in self.references:
                    inputs = s.example_inputs(model, bucket)
                    self.references[str(bucket)] = (inputs, bucket_output(model(**inputs)).clone())

    def compile(self, tmp: Path | None) -> None:
        """What the trace did not compile; glue that no forward called drops out."""
        self.compiles = self.compiler.compile(self, tmp)
        compiled = {c["region"] for c in self.compiles}
        self.targets = [t for t in self.targets if t.kind == "block" or t.name in compiled]

    def check(self, tmp: Path | None) -> None:
        """Every bucket's compiled output against eager's (relative L2 within PARITY_BOUND, finite); a bucket
        off the bound raises, and nothing is published."""
        dtype = self.session.dtype
        parity = self.compiler.inherited_parity(self)
        if parity is None:
            outputs = self.compiler.compiled_outputs(self, tmp)
            parity = {b: _parity(outputs[b], ref) for b, (_, ref) in self.references.items()}
            for b, ref in self.lossless.items():  # a lossy transform's cost: against the model as given
                parity[b]["rel_l2_vs_lossless"] = rel_l2(outputs[b], ref)
        lossy = {b: p["rel_l2_vs_lossless"] for b, p in parity.items() if "rel_l2_vs_lossless" in p}
        if lossy:  # lossy options always print their error
            from omni_compile.weights import LOSSY

            names = ", ".join(t for t in self.opts.compile.weight_transforms if t in LOSSY)
            self.events.on_stage(f"{names} (lossy): rel L2 against the model as given "
                                 + ", ".join(f"{b} {e:.2e}" for b, e in lossy.items()))  # fmt: skip
        bad = [b for b, p in parity.items() if not p["finite"] or p["rel_l2_vs_eager"] > PARITY_BOUND[dtype]]
        if bad:
            raise OmniCompileError(
                f"the compiled regions ({self.compiler.name}) do not match eager on bucket(s) "
                + ", ".join(f"{b} (rel L2 {parity[b]['rel_l2_vs_eager']:.2e})" for b in bad)
                + f"; bound {PARITY_BOUND[dtype]:.0e} for {dtype_name(dtype)}. Nothing was published; "
                "rebuild with --passes=none to see whether a pass is the cause"
            )
        self.parity = parity

    def publish(self, tmp: Path | None) -> dict[str, Any]:
        """The compiler's files and the report into `tmp` (renamed into place by `staging`)."""
        self.timing["compile_seconds"] = round(sum(c["seconds"] for c in self.compiles), 3)
        self.timing["wall_seconds"] = round(time.perf_counter() - self.t_start, 3)
        done = _compilations()
        self.compilations = {k: done[k] - self._counts[k] for k in done}
        self.compilations["region_compiles"] = len(self.compiles)
        self.compilations["cache_hits"] = sum(bool(c.get("cache_hit")) or c.get("source") == "store"
                                              for c in self.compiles)  # fmt: skip
        self.compiler.write(self, tmp)
        report = build_report(self)
        if tmp is not None:
            path = tmp / self.compiler.report_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
        return self.compiler.result(self, report)


def _parity(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    return {"rel_l2_vs_eager": rel_l2(got, ref), "finite": bool(torch.isfinite(got).all()),
            "output_shape": list(got.shape), "checked": "here"}  # fmt: skip


def _compilations() -> dict[str, int]:
    """Files compiled, regions exported and Dynamo graphs traced so far in this process."""
    from torch._dynamo.utils import counters as dynamo_counters

    return {"aot_compiles": counters.aot_compiles, "region_exports": counters.region_exports,
            "dynamo_graphs": int(dynamo_counters["stats"].get("unique_graphs", 0))}  # fmt: skip


@contextlib.contextmanager
def staging(out: Path | None, force: bool):
    """A temporary directory beside `out`, renamed to `out` when the block ends, removed when it raises
    (None, and nothing written, when there is no `out`)."""
    if out is None:
        yield None
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            check_out(out, force)
            old = out.with_name(f".{out.name}.old-{time.time_ns()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
