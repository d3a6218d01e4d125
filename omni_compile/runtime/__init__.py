"""Runtime wrappers around a loaded model: `CudaGraphForward` (CUDA graph capture and replay per bucket)."""

from omni_compile.runtime.cuda_graphs import CudaGraphForward, capture_forward

__all__ = ["CudaGraphForward", "capture_forward"]
