"""The cache key of one compiled region file (DESIGN.md contract 6, docs/cache.md).

A key is the sha256 of a canonical JSON of every factor that changes the generated code, and of nothing
else: the region's graph hash, the call signature (shapes, strides, dtypes, non-tensor values), the pass
manager's uuid (enabled passes, their options and source, kernel choices, attention config), the
codegen-relevant build options (artifact mode, dtype, Inductor options), the torch and Triton versions,
the device architecture, and the omni-compile version. Output paths, times, host names and the weights'
values are not factors: the same region compiled anywhere on the same architecture shares one entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

KEY_SCHEMA = "omni-compile/cache-key/1"


@dataclass(frozen=True)
class KeyFactors:
    graph_hash: str  # sha256 of the region's exported graph code
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
        import platform as _py

        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            isa = str(pick_vec_isa())
        except Exception:  # noqa: BLE001  (no compiler to probe with): the machine type still separates entries
            isa = "unknown-isa"
        return f"cpu {_py.machine()} {isa}"
    return f"{kind} {platform.device_name}"  # ROCm, XPU: the device name names the architecture
