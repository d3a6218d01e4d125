"""Base classes of every omni-compile pass.

`OmniPass` implements Inductor's `CustomGraphPass`: `__call__(graph)` rewrites a post-grad ATen graph
in place and returns how many rewrites it made, and `uuid()` hashes the pass's own source, the
source of every pattern it registered and its options, so Inductor's caches key on exactly what
the pass does.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

from omni_compile.config import CompileConfig
from omni_compile.errors import ConfigError
from omni_compile.platform import Platform


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return getattr(obj, "__qualname__", repr(obj))


def _trace_like_post_grad(fn, args, **kwargs):
    """fwd_only, then the view -> reshape rewrite Inductor applies before post-grad passes run."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = fwd_only(fn, args, **kwargs)
    view_to_reshape(gm)
    return gm


class OmniPass(CustomGraphPass):
    """One graph rewrite. Subclasses set `name`, `OPTIONS` (option -> default) and implement `apply`."""

    name: ClassVar[str]
    enabled_by_default: ClassVar[bool] = True
    OPTIONS: ClassVar[dict[str, Any]] = {}

    def __init__(self, options: dict[str, Any] | None = None):
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ConfigError(
                f"pass {self.name!r} has no option(s) {unknown}; its options are {sorted(self.OPTIONS) or 'none'}"
            )
        self.options = {**self.OPTIONS, **options}
        self._extra_sources: list[str] = []

    def is_applicable(self, platform: Platform, config: CompileConfig) -> bool:
        return True

    def apply(self, graph: torch.fx.Graph) -> int:
        raise NotImplementedError

    def __call__(self, graph: torch.fx.Graph) -> int:
        return self.apply(graph)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for cls in type(self).__mro__:
            if cls in (OmniPass, PatternPass, CustomGraphPass) or not issubclass(cls, OmniPass):
                continue
            h.update(_source(cls).encode())
        for src in self._extra_sources:
            h.update(src.encode())
        h.update(json.dumps(self.options, sort_keys=True, default=str).encode())
        return h.hexdigest()


class PatternPass(OmniPass):
    """A pass made of Inductor pattern replacements, registered by `register_patterns()`.

    Patterns are ordinary eager functions traced with `fwd_only`; `register` records their source
    for `uuid()` as they register, so the hash can never miss one.
    """

    def __init__(self, options: dict[str, Any] | None = None):
        super().__init__(options)
        self.patterns = PatternMatcherPass(pass_name=f"omni_compile.{self.name}")
        # `register` records each pattern's source at once (for `uuid()`) and defers the tracing (about a
        # second for all passes) to the first `apply`: a build whose regions all come from a store, or
        # that only computes cache keys, never pays it.
        self._pending: list[Callable[[], None]] = []
        self.register_patterns()

    def register_patterns(self) -> None:
        raise NotImplementedError

    def register(
        self,
        search_fn: Callable,
        replace_fn: Callable,
        example_inputs: list[Any],
        extra_check: Callable | None = None,
        scalar_workaround: dict[str, float] | None = None,
    ) -> None:
        for fn in (search_fn, replace_fn, extra_check):
            if fn is not None:
                self._extra_sources.append(_source(fn))
        self._extra_sources.append(repr([(getattr(t, "dtype", t), getattr(t, "shape", None)) for t in example_inputs]))
        self._pending.append(
            lambda: register_replacement(
                search_fn,
                replace_fn,
                example_inputs,
                _trace_like_post_grad,
                self.patterns,
                extra_check=extra_check or (lambda match: True),
                scalar_workaround=scalar_workaround,
                skip_duplicates=True,
            )
        )

    def register_handler(self, pattern, handler: Callable, extra_check: Callable | None = None) -> None:
        """Register a hand-written pattern (for ops a traced eager function cannot express)."""
        from torch._inductor.pattern_matcher import register_graph_pattern

        self._extra_sources.append(repr(pattern))
        self._extra_sources.append(_source(handler))
        self._pending.append(
            lambda: register_graph_pattern(
                pattern, extra_check=extra_check or (lambda match: True), pass_dict=self.patterns
            )(handler)
        )

    def materialize(self) -> None:
        """Trace and register the patterns recorded so far, in registration order (once).

        `PassManager.prepare` calls this before Inductor compiles. Called from inside a compile (the
        post-grad pass), the tracing must not see that compile's fake-tensor mode or tracing context,
        or the traced patterns differ from the graphs they should match (as Inductor's own lazily
        initialised patterns do: `pattern_matcher.init_once_fakemode`)."""
        if not self._pending:
            return
        from torch._dynamo.utils import counters as dynamo_counters
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        pending, self._pending = self._pending, []
        before = dynamo_counters["inductor"].copy()
        with torch._guards.tracing(None), unset_fake_temporarily():
            for register in pending:
                register()
        dynamo_counters["inductor"] = before  # tracing patterns is not matching them

    def apply(self, graph: torch.fx.Graph) -> int:
        self.materialize()
        return self.patterns.apply(graph)


@functools.cache
def shared_pass(cls: type[OmniPass], options_json: str) -> OmniPass:
    """The one instance of a pass class with these options (JSON) in this process: tracing patterns costs
    time, so the pass manager and the passes that run another pass's patterns share it."""
    return cls(json.loads(options_json))
