"""Every environment variable omni-compile reads, in one place.

Other modules call these functions; none of them touches `os.environ` for our variables directly.
"""

import os


def passes_override() -> str | None:
    """OMNI_COMPILE_PASSES: pass switches applied after the config's, e.g. '-rms_norm'."""
    return os.environ.get("OMNI_COMPILE_PASSES") or None


def kernels_override() -> str | None:
    """OMNI_COMPILE_KERNELS: fused-op implementations applied over the config's, e.g. 'rms_norm=triton,*=native'."""
    return os.environ.get("OMNI_COMPILE_KERNELS") or None


def dump_dir() -> str | None:
    """OMNI_COMPILE_DUMP_DIR: graph dumps when the config sets no dump_dir."""
    return os.environ.get("OMNI_COMPILE_DUMP_DIR") or None


def log_level() -> str | None:
    """OMNI_COMPILE_LOG_LEVEL: the CLI's log level (default WARNING)."""
    return os.environ.get("OMNI_COMPILE_LOG_LEVEL") or None


def attention_backend() -> str | None:
    """OMNI_COMPILE_ATTENTION_BACKEND: the default attention backend, e.g. CUDNN_ATTN (replaces the config's default)."""
    return os.environ.get("OMNI_COMPILE_ATTENTION_BACKEND") or None


def fp8_any_device() -> bool:
    """OMNI_COMPILE_FP8_ANY_DEVICE=1: the fp8 weight transform runs on any device (for tests: torch's CPU
    `_scaled_mm` runs the same arithmetic, slowly); otherwise it needs a CUDA GPU of compute capability 8.9+."""
    return os.environ.get("OMNI_COMPILE_FP8_ANY_DEVICE") == "1"


def cuda_graphs_max() -> int:
    """OMNI_COMPILE_CUDA_GRAPHS_MAX: CUDA graphs kept per model at once (default 8; the least recently used is dropped
    for a new size). A `--dynamic` artifact serves many sizes, and each graph keeps its outputs in the pool."""
    value = os.environ.get("OMNI_COMPILE_CUDA_GRAPHS_MAX") or "8"
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"OMNI_COMPILE_CUDA_GRAPHS_MAX must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"OMNI_COMPILE_CUDA_GRAPHS_MAX must be a positive integer, got {value!r}")
    return n
