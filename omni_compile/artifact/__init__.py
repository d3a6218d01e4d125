"""Prebuilt artifacts: `build_artifact` writes one, `load` runs it with no compilation (docs/artifact.md)."""

from omni_compile.artifact.manifest import MANIFEST, SCHEMA, ArtifactError

__all__ = ["MANIFEST", "SCHEMA", "ArtifactError", "build_artifact", "load", "verify"]


def __getattr__(name: str):
    if name == "build_artifact":
        from omni_compile.artifact.build import build_artifact

        return build_artifact
    if name in ("load", "verify"):
        from omni_compile.artifact import loader as _load

        return getattr(_load, name)
    raise AttributeError(name)
