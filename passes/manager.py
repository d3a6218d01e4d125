"""The pass manager: the one object installed as Inductor's `post_grad_custom_post_pass`.

It runs the enabled passes in their fixed order over each post-grad graph, times each, records a
match table for the region being compiled, and can dump the graph before and after every pass. Its
`uuid()` combines the uuids of the enabled passes, so Inductor's FX-graph cache keys change when
(and only when) a pass is toggled, its options change, or its source changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from omni_compile import envs
from omni_compile.attention.config import AttentionConfig
from omni_compile.config import CompileConfig
from omni_compile.counters import counters
from omni_compile.errors import ConfigError
from omni_compile.graphs.symbolic import sizes_from_inputs
from omni_compile.passes.base import OmniPass, PassContext
from omni_compile.ops.registry import parse_kernel_choices
from omni_compile.passes.adaln import AdaLNPass
from omni_compile.passes.attention import AttentionPass
from omni_compile.passes.cat_gemm import CatGemmPass
from omni_compile.passes.complex_mul import ComplexMulPass
from omni_compile.passes.fp8_act import Fp8ActPass
from omni_compile.passes.gated_residual import GatedResidualPass
from omni_compile.passes.gemm_gelu import GemmGeluPass
from omni_compile.passes.lower_fused_ops import LowerFusedOpsPass
from omni_compile.passes.qk_norm_rope import QKNormRopePass
from omni_compile.passes.rms_norm import RMSNormPass
from omni_compile.platform import Platform

logger = logging.getLogger("omni_compile.passes")

# The fixed order passes run in. Fusion passes first, lowering of fused ops last.
PASS_ORDER: tuple[type[OmniPass], ...] = (
    ComplexMulPass,
    RMSNormPass,
    QKNormRopePass,
    AdaLNPass,
    GatedResidualPass,
    Fp8ActPass,
    GemmGeluPass,
    CatGemmPass,
    AttentionPass,
    LowerFusedOpsPass,
)
PASSES: dict[str, type[OmniPass]] = {cls.name: cls for cls in PASS_ORDER}


def resolve_enabled(switches: list[str]) -> list[str]:
    """Apply '+name' / '-name' / 'none' / 'all' switches, in order, over each pass's default."""
    enabled = {name for name, cls in PASSES.items() if cls.enabled_by_default}
    for raw in switches:
        for item in (s.strip() for s in raw.split(",")):
            if not item:
                continue
            if item in ("all", "none"):
                enabled = set(PASSES) if item == "all" else set()
                continue
            sign, name = (item[0], item[1:]) if item[0] in "+-" else ("+", item)
            if name not in PASSES:
                raise ConfigError(f"unknown pass {name!r} in switch {item!r}; passes are {', '.join(PASSES)}")
            (enabled.add if sign == "+" else enabled.discard)(name)
    return [name for name in PASSES if name in enabled]


@dataclass
class PassRun:
    name: str
    matches: int
    seconds: float


@dataclass
class PassLog:
    """What the passes did to one post-grad graph (one region at one bucket)."""

    label: str
    dump_dir: Path | None = None
    runs: list[PassRun] = field(default_factory=list)
    resolutions: dict[str, dict] = field(default_factory=dict)  # fused op -> implementation, reason, count
    attention: dict[str, dict] = field(default_factory=dict)  # role -> backend, reason, count

    def table(self, name: str) -> dict[str, dict]:
        """The report table a `PassResult` names: "fused_ops" or "attention"."""
        return {"fused_ops": self.resolutions, "attention": self.attention}[name]

    @property
    def ran(self) -> bool:
        return bool(self.runs)

    def matches(self) -> dict[str, int]:
        return {r.name: r.matches for r in self.runs}


_current_log: contextvars.ContextVar[PassLog | None] = contextvars.ContextVar("omni_compile_pass_log", default=None)
_dump_root: contextvars.ContextVar[Path | None] = contextvars.ContextVar("omni_compile_dump_root", default=None)


def current_log() -> PassLog | None:
    """The pass log of the graph being compiled (inside `PassManager.recording`), else None."""
    return _current_log.get()


@contextlib.contextmanager
def dumping(root: Path):
    """Dump every graph rewritten inside this block under `root/REGION/KEY` (from a log labelled
    'REGION@KEY'), unless its log has a dump_dir of its own. The artifact build uses it to store the
    graphs `omni-compile inspect` reads."""
    token = _dump_root.set(Path(root))
    try:
        yield
    finally:
        _dump_root.reset(token)


def enabled_passes(config: CompileConfig) -> list[str]:
    """The passes `config` (plus OMNI_COMPILE_PASSES) enables; raises ConfigError for unknown names."""
    switches = list(config.passes)
    if envs.passes_override():
        switches.append(envs.passes_override())
    unknown = sorted(set(config.pass_options) - set(PASSES))
    if unknown:
        raise ConfigError(f"pass_options names unknown pass(es) {unknown}; passes are {', '.join(PASSES)}")
    return resolve_enabled(switches)


class PassManager(CustomGraphPass):
    def __init__(self, config: CompileConfig, platform: Platform, attention_role=None):
        """`attention_role(module_path) -> role` is the model adapter's mapping of attention modules to roles."""
        self.enabled = enabled_passes(config)
        self.platform = platform
        # Parsed (and validated) even with the attention pass off, so a bad config is always an error.
        self.attention_config = AttentionConfig.from_json(config.attention).with_env()
        self._uuid: str | None = None
        self.passes: list[OmniPass] = []
        choices = parse_kernel_choices(config.kernels, envs.kernels_override())
        for name in self.enabled:
            ctx = PassContext(platform, config, config.pass_options.get(name, {}), choices, self.attention_config,
                              attention_role)  # fmt: skip
            p = PASSES[name].from_context(ctx)
            if p.is_applicable(platform, config):
                self.passes.append(p)
        # What runs here: the switched-on passes that apply to this platform (gemm_gelu, cat_gemm: GPUs).
        self.enabled = [p.name for p in self.passes]

    def __deepcopy__(self, memo):
        # Inductor deep-copies its config for an ahead-of-time compile, this pass included. A copy of our patterns
        # would hold a copy of the pattern matcher's MULTIPLE, which torch tests by identity: every pattern node
        # that allows several users (Wan's rotary scatter) would then match nothing. The manager holds no state a
        # compile changes (the match log is a context variable), so the copy is the manager itself.
        return self

    def prepare(self) -> None:
        """Trace the pattern passes' patterns now, outside any compile (an ahead-of-time build does). Without
        it each pass traces them on its first run (a compile that Inductor's cache serves traces nothing)."""
        for p in self.passes:
            p.prepare()

    @contextlib.contextmanager
    def recording(self, log: PassLog):
        token = _current_log.set(log)
        try:
            yield log
        finally:
            _current_log.reset(token)

    def __call__(self, graph: torch.fx.Graph) -> None:
        log = _current_log.get() or PassLog(label="<unattributed>")
        if log.dump_dir is None and _dump_root.get() is not None:
            log.dump_dir = _dump_root.get().joinpath(*log.label.split("@", 1))
        counters.pass_manager_runs += 1
        for i, p in enumerate(self.passes):
            if log.dump_dir is not None:
                _dump(log.dump_dir / f"{i}.{p.name}.before.py", graph)
            t0 = time.perf_counter()
            sizes_from_inputs(graph)  # symbolic sizes (--dynamic): read from the inputs, not the tensors patterns match
            result = p.run(graph)
            graph.eliminate_dead_code()
            seconds = time.perf_counter() - t0
            log.runs.append(PassRun(p.name, result.rewrites, seconds))
            counters.pass_matches[p.name] += result.rewrites
            for table, entries in result.implementations.items():
                log.table(table).update(entries)
            if log.dump_dir is not None:
                _dump(log.dump_dir / f"{i}.{p.name}.after.py", graph)
        graph.lint()
        summary = ", ".join(f"{r.name}={r.matches}" for r in log.runs) or "no passes"
        logger.info("passes on %s: %s (%.1f ms)", log.label, summary, 1e3 * sum(r.seconds for r in log.runs))

    def uuid(self) -> str:
        # Inductor asks on every compile; the pass list is fixed at construction, so hash it once.
        if self._uuid is None:
            parts = [(p.name, p.uuid()) for p in self.passes]
            self._uuid = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
        return self._uuid


def _dump(path: Path, graph: torch.fx.Graph) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    gm = graph.owning_module
    text = gm.print_readable(print_output=False) if gm is not None else str(graph)
    path.write_text(text)
