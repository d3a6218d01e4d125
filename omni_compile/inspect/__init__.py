"""`omni-compile inspect`: each region's graphs before/after every pass, what matched, the kernels, the
Dynamo view and a profile (docs/inspect.md).

The names below are loaded on first use: the CLI builds its parser from `omni_compile.inspect.command`, and
importing the collector (passes, Inductor) there would cost every command line about two seconds."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["SCHEMA", "InspectOptions", "inspect", "inspect_artifact", "inspect_model"]

if TYPE_CHECKING:
    from omni_compile.inspect.collect import SCHEMA, InspectOptions, inspect, inspect_artifact, inspect_model


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("omni_compile.inspect.collect"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
