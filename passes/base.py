"""Base classes of every omni-compile pass, and the protocol between a pass and the pass manager.

`OmniPass` implements Inductor's `CustomGraphPass`: `__call__(graph)` rewrites a post-grad ATen graph
in place and returns how many rewrites it made, and `uuid()` hashes the pass's own source, the
source of every pattern it registered, its options and the code every pass shares (`code_fingerprint`:
the passes, fused ops, kernels and attention backends), so Inductor's caches key on exactly what the
pass does: a cache written by other code of these is never read back.

The manager makes each pass from a `PassContext` (`OmniPass.from_context`: the platform, the compile
config, the pass's options, the implementation choices and the adapter's attention roles) and runs it
through `OmniPass.run(graph) -> PassResult` (the rewrite count, and the implementation choices the pass
made, for the build report). A pass reads what it needs from the context and reports through the
result; the manager knows no pass by name.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
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


@functools.cache
def code_fingerprint() -> str:
    """A hash of the source files of what the passes emit and how: the passes themselves, the fused ops and
    their kernels, the attention backends. A pass's own class source misses the helpers it calls (a function
    of its module, a kernel's launcher); with this, changing any of them changes every pass's uuid."""
    from pathlib import Path

    import omni_compile

    here = Path(__file__).resolve().parent
    package = Path(omni_compile.__file__).resolve().parent
    files = sorted({*here.glob("*.py"), *(package / "ops").rglob("*.py"), *(package / "attention").rglob("*.py")})
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _trace_like_post_grad(fn, args, **kwargs):
    """fwd_only, then the view -> reshape rewrite Inductor applies before post-grad passes run.

    The match check re-traces a search function on the matched tensors; a function that cannot run on them (a
    chain of another rank that the pattern, its literals ignored, matched: symbolic sizes ignore more of
    them) is no match. torch counts only a RuntimeError as such, so the others are raised as one."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    try:
        gm = fwd_only(fn, args, **kwargs)
    except (ValueError, IndexError, TypeError) as e:
        raise RuntimeError(f"the search function does not run on the matched tensors: {e}") from e
    view_to_reshape(gm)
    return gm


def known_size(d) -> bool:
    """Whether a size has a value at compile time: an int, or a symbolic size with an example value. A size that
    depends on data (the count of `nonzero`, of a mask's true entries) has none until the graph runs."""
    return not isinstance(d, torch.SymInt) or d.node.hint is not None


def size_hint(d) -> int:
    """A size as an int without specializing it: a symbolic size (a `--dynamic` build's sequence length) gives the
    example's value, for choices that need a number (a backend's shape class, a block size), never for shapes
    the graph computes with. `int(d)` on a SymInt would guard on that value and compile for it alone."""
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        if hint is None:
            raise ValueError(f"size {d} has no example value")
        return int(hint)
    return int(d)


@dataclass(frozen=True)
class PassContext:
    """What a pass may read when the manager makes it: nothing model-family specific besides the adapter's
    mapping of attention modules to roles."""

    platform: Platform
    config: CompileConfig
    options: dict[str, Any] = field(default_factory=dict)  # this pass's options (config.pass_options[name])
    kernel_choices: dict[str, str] = field(default_factory=dict)  # fused op -> auto | native | kernel name
    attention: Any = None  # attention.config.AttentionConfig (with the environment applied)
    attention_role: Callable[[str], str] | None = None  # attention module path -> role (the adapter's)


@dataclass
class PassResult:
    """What one run of a pass did to one graph."""

    rewrites: int
    # Implementation choices made in this graph, for the build report: report table ("fused_ops" or
    # "attention") -> key (op or role) -> {"implementation", "reason", "count", ...}.
    implementations: dict[str, dict[str, dict]] = field(default_factory=dict)


class OmniPass(CustomGraphPass):
    """One graph rewrite. Subclasses set `name`, `OPTIONS` (option -> default) and implement `apply`;
    a pass that needs more than its options overrides `from_context`, one that reports implementation
    choices overrides `run`."""

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

    @classmethod
    def from_context(cls, ctx: PassContext) -> OmniPass:
        """The pass for this build. Pattern passes are shared per options (`shared_pass`): tracing their
        patterns costs time."""
        return shared_pass(cls, json.dumps(ctx.options, sort_keys=True))

    def is_applicable(self, platform: Platform, config: CompileConfig) -> bool:
        return True

    def prepare(self) -> None:
        """Slow set-up to do before Inductor compiles (tracing patterns); the manager calls it once."""

    def run(self, graph: torch.fx.Graph) -> PassResult:
        """Rewrite `graph` in place (the manager's entry point)."""
        return PassResult(int(self.apply(graph) or 0))

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
        h.update(code_fingerprint().encode())
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
        skip_duplicates: bool = True,
        recheck: bool = True,
    ) -> None:
        """`skip_duplicates=False` keeps a pattern that equals an earlier one but for literals that the first
        comparison ignores (ints, bools, dtypes) and torch's re-check at the match's shapes compares.

        With the re-check (torch's `register_replacement` re-traces the search function with the match's
        values and compares every literal), the arguments named in `scalar_workaround` are traced at their
        workaround values, so they match any value, as in the first comparison: a float such as eps is rendered
        differently by torch releases (torch 2.11's graphs hold `1e-05` where its re-trace does not; 2.13
        rounds it to fp32 in both), and a literal compare would miss a real match. `extra_check` reads them.

        `recheck=False`: no such re-check; `extra_check` alone decides. For chains whose only literals the
        check already reads (the slice bounds of a prefix, ...), or that must match whatever their ints are."""
        for fn in (search_fn, replace_fn, extra_check):
            if fn is not None:
                self._extra_sources.append(_source(fn))
        self._extra_sources.append(repr([(getattr(t, "dtype", t), getattr(t, "shape", None)) for t in example_inputs]))
        if not recheck:
            self._extra_sources.append("recheck=False")
            self._pending.append(
                lambda: _register_without_recheck(
                    self.patterns, search_fn, replace_fn, _as_fake(example_inputs), extra_check, scalar_workaround
                )
            )
            return
        pinned = search_fn  # the re-check's search function (see above); the replacement takes the match's eps
        if scalar_workaround:
            pinned = _pinned(search_fn, scalar_workaround)
            self._extra_sources.append(f"re-check with {sorted(scalar_workaround.items())}")
        self._pending.append(
            lambda: register_replacement(
                pinned,
                replace_fn,
                _as_fake(example_inputs),
                _trace_like_post_grad,
                self.patterns,
                extra_check=extra_check or (lambda match: True),
                scalar_workaround=scalar_workaround,
                skip_duplicates=skip_duplicates,
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

    def register_traced(self, search_fn: Callable, example_inputs: list[Any], handler: Callable,
                        extra_check: Callable, scalar_workaround: dict[str, float] | None = None) -> None:
        """The search function's pattern (ints, floats, dtypes and bools ignored, as with `recheck=False`) with a
        handler of its own, `handler(match)`, which replaces the match (for replacements that depend on what the
        check read: a layout, a slice's start)."""  # fmt: skip
        from torch._inductor.pattern_matcher import gen_pattern, register_graph_pattern

        for fn in (search_fn, handler, extra_check):
            self._extra_sources.append(_source(fn))
        self._extra_sources.append(repr([(getattr(t, "dtype", t), getattr(t, "shape", None)) for t in example_inputs]))

        def trace() -> None:
            pattern = gen_pattern(search_fn, _as_fake(example_inputs), _trace_like_post_grad, scalar_workaround)
            register_graph_pattern(pattern, extra_check=extra_check, pass_dict=self.patterns)(
                lambda match, *args, **kwargs: handler(match)
            )

        self._pending.append(trace)

    def materialize(self) -> None:
        """Trace and register the patterns recorded so far, in registration order (once).

        The pass's first run calls this (a compile whose Inductor result comes from a cache traces nothing);
        `PassManager.prepare` calls it before an ahead-of-time build. Called from inside a compile (the
        post-grad pass), the tracing must not see that compile's fake-tensor mode or tracing context,
        or the traced patterns differ from the graphs they should match (as Inductor's own lazily
        initialised patterns do: `pattern_matcher.init_once_fakemode`). Like those, they are traced in a fake
        mode of their own, on fake example inputs: tracing real tensors made a new fake mode for every value
        to record its metadata (about a third of the tracing time)."""
        if not self._pending:
            return
        import time

        from torch._dynamo.utils import counters as dynamo_counters
        from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

        from omni_compile.counters import counters

        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        before = dynamo_counters["inductor"].copy()
        with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
            for register in pending:
                register()
        dynamo_counters["inductor"] = before  # tracing patterns is not matching them
        counters.pattern_trace_seconds += time.perf_counter() - t0

    def prepare(self) -> None:
        self.materialize()

    def apply(self, graph: torch.fx.Graph) -> int:
        self.materialize()
        return self.patterns.apply(graph)


def _as_fake(values: list[Any]) -> list[Any]:
    """`values` with each tensor made a fake tensor of the active fake mode (`materialize`'s), if there is one."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None:
        return values
    return [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]


def _pinned(search_fn: Callable, scalar_workaround: dict[str, float]) -> Callable:
    """`search_fn` with the arguments named in `scalar_workaround` fixed at their workaround values (same
    signature: torch reads the argument names from it)."""
    names = list(inspect.signature(search_fn).parameters)

    @functools.wraps(search_fn)
    def pinned(*args):
        return search_fn(*(scalar_workaround.get(n, a) for n, a in zip(names, args)))

    return pinned


def _register_without_recheck(patterns, search_fn, replace_fn, example_inputs, extra_check, scalar_workaround):
    """The search function's pattern (ints, floats, dtypes and bools ignored) with `extra_check`, replaced by
    `replace_fn` traced on the match's tensors, its other arguments (eps, ...) bound as constants."""
    import inspect

    from torch._inductor.pattern_matcher import gen_pattern, register_graph_pattern

    names = list(inspect.signature(replace_fn).parameters)

    def handler(match, *args, **kwargs):
        bound = {n: match.kwargs.get(n) for n in names}
        tensors = [n for n in names if isinstance(bound[n], torch.fx.Node)]

        def replacement(*values):
            return replace_fn(**{**bound, **dict(zip(tensors, values))})

        match.replace_by_example(replacement, [bound[n] for n in tensors])

    pattern = gen_pattern(search_fn, example_inputs, _trace_like_post_grad, scalar_workaround)
    register_graph_pattern(pattern, extra_check=extra_check or (lambda match: True), pass_dict=patterns)(handler)


@functools.cache
def shared_pass(cls: type[OmniPass], options_json: str) -> OmniPass:
    """The one instance of a pass class with these options (JSON) in this process: tracing patterns costs
    time, so the pass manager and the passes that run another pass's patterns share it."""
    return cls(json.loads(options_json))
