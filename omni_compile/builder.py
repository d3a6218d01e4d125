"""`omni_compile.build(opts)`: the `omni-compile build` driver, both modes (`build.pipeline.BuildPipeline`).

`--mode aot` (default) publishes a prebuilt artifact (docs/artifact.md); `--mode jit` publishes the build
report and Inductor's compiled-cache bundle, from which a second process warm-starts (`--cache-from`).
"""

from __future__ import annotations

from typing import Any

from omni_compile.build.pipeline import BuildPipeline
from omni_compile.build.session import BuildEvents, BuildOptions

__all__ = ["BuildEvents", "BuildOptions", "build"]


def build(opts: BuildOptions, events: BuildEvents | None = None) -> dict[str, Any]:
    """Build what `opts` asks for; returns the artifact's manifest (aot) or the build report (jit)."""
    return BuildPipeline(opts, events).run()
