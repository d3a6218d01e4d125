"""The cache key of one compiled region file (DESIGN.md contract 6, docs/cache.md).

A key is the sha256 of a canonical JSON of every factor that changes the generated code, and of nothing
else: the region's graph hash, the call signature (shapes, strides, dtypes, non-tensor values), the pass
manager's uuid (enabled passes, their options and source, kernel choices, attention config), the
codegen-relevant build options (artifact mode, dtype, Inductor options), the torch and Triton versions,
the device architecture, and the omni-compile version. Output paths, times, host names and the weights'
values are not factors: the same region compiled anywhere on the same architecture shares one entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform as _py
from dataclasses import asdict, dataclass, field
from typing import Any

KEY_SCHEMA = "omni-compile/cache-key/3"  # 2: the graph identity is the op trace (graphs.trace); 3: regions take tensor leaves


@dataclass(frozen=True)
class KeyFactors:
    graph_hash: str  # the region's graph identity: "trace:SHA" (graphs.trace, its recorded call) or "export:SHA"
    signature: str  # the call signature (aot.call_key, as a string)
    pass_uuid: str
    torch_version: str
    triton_version: str | None
    device_arch: str  # e.g. "cuda sm90", "rocm gfx942", "cpu x86_64 avx512"
    omni_compile_version: str
    build_options: dict[str, Any] = field(default_factory=dict)  # codegen-relevant only (mode, dtype, Inductor options)

    def canonical(self) -> str:
        return json.dumps({"schema": KEY_SCHEMA, **asdict(self)}, sort_keys=True, separators=(",", ":"), default=str)

    def key(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()


def device_arch(platform) -> str:
    """The part of a `Platform` that generated code depends on: kind and architecture. Device names of
    one architecture (an H100 and an H200 are both sm90) share entries."""
    kind = platform.kind
    if kind == "cuda":
        return f"cuda {platform.arch}"
    if kind == "cpu":
        return f"cpu {cpu_isa()}"
    return f"{kind} {platform.device_name}"  # ROCm, XPU: the device name names the architecture


@functools.cache
def cpu_isa() -> str:
    """The machine type and the vector ISA ATen detected at start-up (`default`, `avx2`, `avx512`, ...),
    which is what Inductor's C++ code generation targets. Asking Inductor itself (`pick_vec_isa`)
    compiles and runs test programs: about 10 s on a 2-core machine, for every key."""
    import torch

    return f"{_py.machine()} {torch.backends.cpu.get_cpu_capability().lower()}"
