"""The region-compiler interface of the build pipeline, and its registry.

A `RegionCompiler` is the one thing that differs between build modes (as vLLM's `compiler_interface.py`
puts Inductor, Inductor standalone and eager behind one `CompilerManager`): the pipeline
(`omni_compile.build.pipeline`) resolves, loads, finds regions, traces, compiles, checks against eager and
publishes the same way for every compiler, and asks the compiler, through the methods below, for what
only it knows. A new compiler is one class here-beside with `@register` (and its module imported by
`omni_compile.build.compilers`); `select` finds it from `--mode` and `--format`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from omni_compile.artifact.aot import Target
from omni_compile.build.session import BuildOptions
from omni_compile.errors import ConfigError

BuildPipeline = Any  # build.pipeline.BuildPipeline (which imports this module): the build, stages so far


class Tracer(Protocol):
    """What `RegionCompiler.tracing` yields: told the bucket being traced, counts the compiles so far."""

    bucket: str | None

    def compiles(self) -> int:
        """Region compiles the traced forwards have needed so far (done, or to do in `compile`)."""
        ...


class RegionCompiler(Protocol):
    """How a build turns its regions into compiled code; one instance per build."""

    name: str  # the registry key; the report's compiler.name
    mode: str  # the --mode that selects it
    format: str | None  # the --format that selects it (None: the mode has no format choice)
    report_path: str  # where the build report goes in the output directory
    eager_trace: bool  # the tracing forward runs eagerly: its output is the parity reference
    compiles_glue: bool  # compiles the transformer's glue modules too, not only its repeated blocks
    trace_stage: str  # what the progress display says while a bucket is traced

    @classmethod
    def default_for(cls, device: str) -> bool:
        """Whether this compiler is its mode's choice on `device` when no --format is given."""
        ...

    def check(self, opts: BuildOptions) -> None:
        """Raise ConfigError for an option this compiler cannot take (before any slow work)."""
        ...

    def open(self, build: BuildPipeline) -> AbstractContextManager:
        """Around the whole build, from the model load to the publish: stores, caches, warm starts."""
        ...

    def targets(self, build: BuildPipeline) -> list[Target]:
        """What it compiles: the build's regions (`build.regions`), and glue modules if it compiles them."""
        ...

    def tracing(self, build: BuildPipeline) -> AbstractContextManager[Tracer]:
        """Around the one forward per bucket (`build.trace`)."""
        ...

    def compile(self, build: BuildPipeline, tmp: Path | None) -> list[dict[str, Any]]:
        """Compile what the tracing did not (files go under `tmp`); one record per region compile, with at
        least region, graph_hash, seconds, passes, fused_op_implementations and attention."""
        ...

    def inherited_parity(self, build: BuildPipeline) -> dict[str, dict] | None:
        """Per bucket, a parity check already made for exactly these compiled regions, or None."""
        ...

    def compiled_outputs(self, build: BuildPipeline, tmp: Path | None) -> dict[str, torch.Tensor]:
        """Per bucket, the compiled model's output on the bucket's example inputs (`build.references`)."""
        ...

    def write(self, build: BuildPipeline, tmp: Path | None) -> None:
        """The compiler's own files beside the report (a cache bundle, a manifest), into `tmp`."""
        ...

    def section(self, build: BuildPipeline) -> dict[str, Any]:
        """The report's `compiler` section: name, mode and what only this compiler knows."""
        ...

    def result(self, build: BuildPipeline, report: dict[str, Any]) -> dict[str, Any]:
        """What `omni_compile.build` returns (and `--json` prints)."""
        ...


COMPILERS: dict[str, type] = {}


def register(cls: type) -> type:
    """Add a region compiler to the registry (a class decorator)."""
    assert cls.name not in COMPILERS, f"region compiler {cls.name!r} registered twice"
    COMPILERS[cls.name] = cls
    return cls


def select(opts: BuildOptions, device: str) -> RegionCompiler:
    """The region compiler `opts.mode` and `opts.format` choose on `device`, checked against `opts`."""
    modes = sorted({c.mode for c in COMPILERS.values()})
    if opts.mode not in modes:
        raise ConfigError(f"unknown build mode {opts.mode!r}; choose one of {', '.join(modes)}")
    candidates = [c for c in COMPILERS.values() if c.mode == opts.mode]
    formats = [c.format for c in candidates if c.format]
    if opts.format is None:
        chosen = next((c for c in candidates if c.default_for(device)), candidates[0])
    elif not formats:
        modes_with = sorted({c.mode for c in COMPILERS.values() if c.format})
        raise ConfigError(f"--format chooses an artifact build's compiled-file format; use it with --mode "
                          + " or ".join(modes_with))
    elif opts.format not in formats:
        raise ConfigError(f"unknown --format {opts.format!r}; choose one of {', '.join(formats)}")
    else:
        chosen = next(c for c in candidates if c.format == opts.format)
    compiler = chosen()
    compiler.check(opts)
    return compiler
