"""Prebuilt artifacts: the ahead-of-time compile of a region (`aot`), the manifest, `load` (runs one with no
compilation) and `verify` (docs/artifact.md). `omni_compile.build` writes them (`build.compilers.aot`)."""

from omni_compile.artifact.manifest import MANIFEST, SCHEMA, ArtifactError

__all__ = ["MANIFEST", "SCHEMA", "ArtifactError", "load", "verify"]


def __getattr__(name: str):
    if name in ("load", "verify"):
        from omni_compile.artifact import loader as _load

        return getattr(_load, name)
    raise AttributeError(name)
