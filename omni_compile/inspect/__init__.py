"""`omni-compile inspect`: each region's graphs before/after every pass, what matched, the kernels, the
Dynamo view and a profile (docs/inspect.md)."""

from omni_compile.inspect.collect import SCHEMA, InspectOptions, inspect, inspect_artifact, inspect_model

__all__ = ["SCHEMA", "InspectOptions", "inspect", "inspect_artifact", "inspect_model"]
