"""Region compilers (`base.RegionCompiler`) and their registry: `InductorJit` (`--mode jit`), `AotiPackage`
and `InductorStandalone` (`--mode aot`, `--format`). Importing this package registers them."""

from omni_compile.build.compilers import aot, jit
from omni_compile.build.compilers.base import COMPILERS, RegionCompiler, Tracer, register, select

__all__ = ["COMPILERS", "RegionCompiler", "Tracer", "aot", "jit", "register", "select"]
