"""The HTTP server of `omni-compile serve`: a FastAPI app running the diffusers pipeline around a
prebuilt artifact's transformer (docs/serving.md).

`build_app(config)` makes the app; `ServeConfig` holds its settings. Modules: `app` (routes, lifespan,
error handlers), `schemas` (request and response bodies), `engine` (the worker that owns the device,
its bounded queue, batching, deadlines and cancellation), `pipeline` (loading the pipeline and
running one batch), `metrics` (Prometheus text exposition).
"""

from omni_compile.server.app import build_app
from omni_compile.server.config import ServeConfig

__all__ = ["ServeConfig", "build_app"]
