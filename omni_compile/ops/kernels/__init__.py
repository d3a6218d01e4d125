"""Platform kernels of the fused ops. Each module registers its kernels when Triton is importable."""

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - Triton is a dependency on Linux
    pass
else:
    from omni_compile.ops.kernels import adaln, gated_residual, quant_rows, rms_norm, rms_norm_rope  # noqa: F401
