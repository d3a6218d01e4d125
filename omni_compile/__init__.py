"""omni-compile: a compiler-driven runtime for diffusion transformers, on torch.compile.

Public API: `compile(model, config)` (regional JIT compile with our passes), `uncompile(model)`,
`build(options)` (the `omni-compile build` driver), `CompileConfig`, `ShapeBucket`.
"""

__version__ = "0.1.0"

from omni_compile.config import CompileConfig, ShapeBucket  # noqa: E402
from omni_compile.compiler import compile, compile_state, uncompile  # noqa: E402
from omni_compile.counters import counters  # noqa: E402
from omni_compile.errors import ConfigError, OmniCompileError  # noqa: E402

__all__ = ["CompileConfig", "ShapeBucket", "compile", "compile_state", "uncompile", "counters", "ConfigError",
           "OmniCompileError", "__version__"]
