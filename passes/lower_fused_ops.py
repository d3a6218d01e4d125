"""Lower fused ops to the implementation their platform resolved to.

Runs last. For each `omni_compile::*` op in the graph, asks the op's registry entry which
implementation serves this platform (`FusedOp.resolve`). Where that is the native implementation,
the call is replaced by the traced body of `forward_native`, so Inductor fuses it with its
neighbours exactly as it would the original chain (an opaque call would run eager torch, several
kernels, inside compiled code). Where a platform kernel exists the call stays, and Inductor calls
that kernel. The resolutions are recorded for the build report.
"""

from __future__ import annotations

import hashlib

import torch
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match, PatternMatcherPass, register_graph_pattern

from omni_compile.ops import FUSED_OPS, FusedOp, Resolution
from omni_compile.passes.base import OmniPass
from omni_compile.platform import Platform


class LowerFusedOpsPass(OmniPass):
    """Inlines the native implementation of fused ops that have no kernel on this platform."""

    name = "lower_fused_ops"

    def __init__(self, options=None, platform: Platform | None = None):
        super().__init__(options)
        self.platform = platform
        self.resolutions: dict[str, Resolution] = {}
        self._patterns: PatternMatcherPass | None = None

    def apply(self, graph: torch.fx.Graph) -> int:
        assert self.platform is not None, "LowerFusedOpsPass needs its platform before it runs"
        if self._patterns is None:
            self._patterns = PatternMatcherPass(pass_name="omni_compile.lower_fused_ops")
            for op in FUSED_OPS.values():
                self._register(op)
        return self._patterns.apply(graph)

    def _register(self, op: FusedOp) -> None:
        pattern = CallFunction(op.overload, *[KeywordArg(name) for name in op.arg_names])

        def lower(match: Match, **bound) -> None:
            resolution = op.resolve(self.platform)
            self.resolutions[op.name] = resolution
            if resolution.implementation != "native":
                return  # the call stays; Inductor calls the platform kernel
            tensors = [n for n in op.arg_names if isinstance(bound[n], torch.fx.Node)]
            constants = {n: v for n, v in bound.items() if n not in tensors}

            def native(*values):
                return op.native(**dict(zip(tensors, values)), **constants)

            match.replace_by_example(native, [bound[n] for n in tensors])

        register_graph_pattern(pattern, pass_dict=self._patterns)(lower)

    def uuid(self) -> str:
        # The resolution depends on the platform's kernels; they join the hash as they are registered.
        kernels = sorted((name, kind, k[0]) for name, op in FUSED_OPS.items() for kind, k in op.kernels.items())
        return hashlib.sha256((super().uuid() + repr(kernels)).encode()).hexdigest()
