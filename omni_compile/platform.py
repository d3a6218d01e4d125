"""Platform detection as a value.

Nothing here runs at import time. `current_platform(device)` inspects torch lazily and returns a
frozen `Platform` that passes and kernels consult through `is_applicable` and capability checks.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Platform:
    kind: str  # "cuda", "rocm", "xpu" or "cpu"
    device_name: str
    capability: tuple[int, int] | None
    torch_version: str
    triton_version: str | None
    cuda_version: str | None
    hip_version: str | None

    @property
    def arch(self) -> str:
        """Short architecture tag: 'sm90' for CUDA compute capability 9.0, else the platform kind."""
        if self.kind == "cuda" and self.capability:
            return f"sm{self.capability[0]}{self.capability[1]}"
        return self.kind

    def to_json(self) -> dict:
        d = asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        d["arch"] = self.arch
        return d


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)


@functools.cache
def _detect(device_type: str) -> Platform:
    common = dict(
        torch_version=torch.__version__,
        triton_version=_triton_version(),
        cuda_version=torch.version.cuda,
        hip_version=getattr(torch.version, "hip", None),
    )
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA platform requested but torch.cuda.is_available() is False")
        kind = "rocm" if common["hip_version"] else "cuda"
        return Platform(
            kind=kind,
            device_name=torch.cuda.get_device_name(),
            capability=tuple(torch.cuda.get_device_capability()),
            **common,
        )
    if device_type == "xpu":
        return Platform(kind="xpu", device_name=torch.xpu.get_device_name(), capability=None, **common)
    import platform as _py_platform

    return Platform(
        kind="cpu", device_name=_py_platform.processor() or _py_platform.machine(), capability=None, **common
    )


def current_platform(device: torch.device | str | None = None) -> Platform:
    """The platform of `device` (default: CUDA when available, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _detect(torch.device(device).type)
