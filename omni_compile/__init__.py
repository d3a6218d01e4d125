"""omni-compile: a compiler-driven runtime for diffusion transformers, on torch.compile.

Public API: `compile(model, config)` (regional JIT compile with our passes), `uncompile(model)`,
`compile_state(model)`, `build(options)` (the `omni-compile build` driver), `load(artifact, weights=...)`
(a prebuilt artifact, no compilation), `CompileConfig`,
`ShapeBucket`, `counters`; `enable_step_cache(pipe, ...)` / `disable_step_cache` (lossy step caching,
`StepCacheConfig`); `lora_adapters(model)` (LoRA merged into the bound weights, zero compiles). Attributes load
lazily, so `import omni_compile` stays cheap.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CompileConfig": "omni_compile.config",
    "ShapeBucket": "omni_compile.config",
    "compile": "omni_compile.compiler",
    "compile_state": "omni_compile.compiler",
    "uncompile": "omni_compile.compiler",
    "build": "omni_compile.builder",
    "BuildOptions": "omni_compile.build.session",
    "load": "omni_compile.artifact.loader",
    "ArtifactError": "omni_compile.artifact.manifest",
    "ConfigError": "omni_compile.errors",
    "enable_step_cache": "omni_compile.runtime.step_cache",
    "disable_step_cache": "omni_compile.runtime.step_cache",
    "StepCacheConfig": "omni_compile.runtime.step_cache",
    "lora_adapters": "omni_compile.runtime.lora",
    "OmniCompileError": "omni_compile.errors",
}

# Eager: the module and the object share a name, and a lazy export would be shadowed by the module.
from omni_compile.counters import counters  # noqa: E402

__all__ = [*_EXPORTS, "counters", "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'omni_compile' has no attribute {name!r}")
