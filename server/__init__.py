"""The HTTP server of `omni-compile serve`: a FastAPI app running the diffusers pipeline around a
prebuilt artifact's transformer (docs/serving.md).

`build_app(config)` makes the app; `ServeConfig` holds its settings. Modules: `app` (routes, lifespan,
error handlers), `schemas` (request and response bodies), `engine` (the worker that owns the device,
its bounded queue, batching, deadlines and cancellation), `pipeline` (loading the pipeline and
running one batch), `metrics` (Prometheus metrics through prometheus_client).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_compile.server.app import build_app
    from omni_compile.server.config import ServeConfig

# Imported on first use: the command line reads `server.serve` for its options, and FastAPI, diffusers and
# torch would cost every `omni-compile` call (`--help` too) their import time.
_LAZY = {"build_app": "omni_compile.server.app", "ServeConfig": "omni_compile.server.config"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ServeConfig", "build_app"]
