"""Process-wide counters that tests assert exact deltas on.

Modelled on vLLM's `compilation_counter`: every compile, cache hit and pattern match increments a
named counter; `counters.expect(regions_compiled=2)` checks the change inside a `with` block.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CompilationCounters:
    # Dynamo graphs handed to our region backend (one per region x bucket x layout).
    regions_compiled: int = 0
    # Region compiles whose Inductor result came from a cache (our passes did not run).
    region_cache_hits: int = 0
    # AOTInductor packages compiled by an artifact build (a package taken from a store is not counted).
    aot_compiles: int = 0
    # Regions exported with torch.export by an artifact build (only to compile them: a store hit exports nothing).
    region_exports: int = 0
    # Times the pass manager ran over a post-grad graph.
    pass_manager_runs: int = 0
    # Modules changed by load-time weight transforms (`omni_compile.weights`; once per bind, never per step).
    weight_transforms: int = 0
    # Linears a LoRA was merged into (`omni_compile.runtime.lora`; once per switch of adapter or scale).
    lora_merges: int = 0
    # Attention calls that ran as `omni_compile::ulysses_attention` (a region compiled for sequence parallelism).
    ulysses_calls: int = 0
    # Ulysses attention calls that exchanged tokens for heads with the other ranks (`omni_compile.parallel.ulysses`).
    ulysses_exchanges: int = 0
    # Seconds spent tracing the passes' patterns (once per process, by the first compile that runs the passes).
    pattern_trace_seconds: float = 0.0
    # Pattern matches per pass name.
    pass_matches: Counter = field(default_factory=Counter)

    def snapshot(self) -> "CompilationCounters":
        return copy.deepcopy(self)

    @contextlib.contextmanager
    def expect(self, **expected):
        """Assert exact deltas, e.g. `expect(regions_compiled=2, pass_matches={"rms_norm": 6})`."""
        before = self.snapshot()
        yield
        for name, want in expected.items():
            now, old = getattr(self, name), getattr(before, name)
            if isinstance(want, dict):
                got = {k: now[k] - old[k] for k in want}
            else:
                got = now - old
            assert got == want, f"counter {name}: expected delta {want}, got {got}"


counters = CompilationCounters()
