"""Regional JIT compilation: `omni_compile.compile(model, config)`.

For each region (a repeated block class, see `omni_compile.graphs.regions`), one `torch.compile`d
function is made from the class's `forward`, and every instance's `forward` is pointed at it. Dynamo
traces a block with the module as an input, so its parameters become graph inputs and one compiled
graph serves all instances. Our backend hands each captured graph to Inductor with the pass manager
installed as the post-grad custom pass and records what happened (graph hash, time, pass matches,
cache hits). The model keeps its forward signature, so it drops into a diffusers pipeline unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_compile import envs
from omni_compile.config import CompileConfig, with_precision
from omni_compile.counters import counters
from omni_compile.errors import ConfigError
from omni_compile.graphs import Region, find_regions, graph_hash, input_signature
from omni_compile.graphs.hashing import dump_graph
from omni_compile.graphs.layout import module_device, region_call
from omni_compile.passes import PassLog, PassManager
from omni_compile.platform import Platform, current_platform

logger = logging.getLogger("omni_compile")

# Dynamo recompiles one code object per bucket and layout; the default limit of 8 is too low for a
# build with many buckets, and hitting it silently runs the block eagerly.
_RECOMPILE_LIMIT = 256


@dataclass
class RegionCompile:
    """One region compiled for one input signature (shape bucket and layout)."""

    region: str
    graph_hash: str
    inputs: list
    seconds: float
    cache_hit: bool
    passes: dict[str, int]
    pass_seconds: float
    resolutions: dict[str, dict]
    attention: dict[str, dict] = field(default_factory=dict)  # role -> backend, reason, count
    # False for an Inductor cache hit whose pass log was not found (`PassLogCache`): passes unknown.
    passes_known: bool = True
    # Where `seconds` went besides Inductor: tracing the passes' patterns (once per process, by the first compile
    # that runs the passes) and each pass's run (including that tracing; the attention pass's includes timing
    # the backends).
    prepare_seconds: float = 0.0
    pass_times: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "region": self.region,
            "graph_hash": self.graph_hash,
            "seconds": round(self.seconds, 3),
            "cache_hit": self.cache_hit,
            "passes": self.passes if self.passes_known else None,
            "pass_seconds": round(self.pass_seconds, 4),
            "prepare_seconds": round(self.prepare_seconds, 3),
            "pass_times": {name: round(t, 4) for name, t in self.pass_times.items()},
            "fused_op_implementations": self.resolutions,
            "attention": self.attention,
            "tensor_inputs": sum(1 for s in self.inputs if s[0] == "tensor"),
        }


class PassLogCache:
    """What the passes did to each compiled graph, by (graph hash, pass uuid).

    An Inductor FX-graph cache hit skips the post-grad passes, so without this a warm compile would
    report no matches and no kernel choices. A cold compile records its pass log here: in memory and
    as a small JSON file under Inductor's cache directory (`omni_compile/pass_logs/`), so a later
    process sharing that directory finds it; `omni-compile build --cache-from DIR` seeds it from DIR's
    build report, so a warm start from a bundle reports what the cold build matched. The pass uuid
    covers the enabled passes, their options, kernel choices, attention config and platform, so an
    entry is only found for a graph the same passes would have rewritten the same way.
    """

    def __init__(self):
        self.entries: dict[str, dict] = {}

    @staticmethod
    def key(ghash: str, pass_uuid: str) -> str:
        return hashlib.sha256(f"{ghash}|{pass_uuid}|{torch.__version__}".encode()).hexdigest()

    @staticmethod
    def _dir() -> Path | None:
        try:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            return Path(cache_dir()) / "omni_compile" / "pass_logs"
        except Exception:  # a torch without it: memory only
            return None

    def put(self, ghash: str, pass_uuid: str, entry: dict, persist: bool = True) -> None:
        key = self.key(ghash, pass_uuid)
        self.entries[key] = entry
        root = self._dir() if persist else None
        if root is None:
            return
        try:  # a cache we cannot write costs only the warm report's detail, never the build
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(entry))
            tmp.replace(root / f"{key}.json")
        except OSError as e:
            logger.debug("could not record the pass log in %s: %s", root, e)

    def get(self, ghash: str, pass_uuid: str) -> dict | None:
        key = self.key(ghash, pass_uuid)
        if key in self.entries:
            return self.entries[key]
        root = self._dir()
        if root is None:
            return None
        try:
            entry = json.loads((root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("passes"), dict):
            return None
        self.entries[key] = entry
        return entry


pass_log_cache = PassLogCache()


@dataclass
class CompileState:
    """What `compile` attached to a model (as `model._omni_compile`)."""

    config: CompileConfig
    platform: Platform
    pass_manager: PassManager
    regions: list[Region]
    records: list[RegionCompile] = field(default_factory=list)
    on_region_compiled: Callable[[RegionCompile], None] | None = None
    cuda_graphs: Any = None  # the whole-step CudaGraphForward, when compiled with cuda_graphs=True

    @property
    def pass_uuid(self) -> str:
        return self.pass_manager.uuid()


class RegionBackend:
    """The Dynamo backend for one region: Inductor with our pass manager, plus bookkeeping."""

    def __init__(self, region: Region, state: CompileState):
        self.region = region
        self.state = state

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        ghash = graph_hash(gm, example_inputs)
        label = f"{self.region.name}@{ghash[:12]}"
        dump_dir = None
        root = self.state.config.dump_dir or envs.dump_dir()
        if root:
            dump_dir = Path(root) / self.region.name / ghash[:12]
            dump_graph(gm, dump_dir / "dynamo_graph.py")
        log = PassLog(label=label, dump_dir=dump_dir)
        counters.regions_compiled += 1
        t0 = time.perf_counter()
        pm = self.state.pass_manager
        # The passes trace their patterns on their first run (`PatternPass.materialize`): not at all when
        # Inductor's result comes from its cache.
        traced = counters.pattern_trace_seconds
        with pm.recording(log):
            compiled = compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": pm})
        record = RegionCompile(
            region=self.region.name,
            graph_hash=ghash,
            inputs=input_signature(example_inputs),
            seconds=time.perf_counter() - t0,
            cache_hit=not log.ran,
            passes=log.matches(),
            pass_seconds=sum(r.seconds for r in log.runs),
            resolutions=log.resolutions,
            attention=log.attention,
            prepare_seconds=counters.pattern_trace_seconds - traced,
            pass_times={r.name: r.seconds for r in log.runs},
        )
        if record.cache_hit:
            counters.region_cache_hits += 1
            known = pass_log_cache.get(ghash, self.state.pass_uuid)
            if known is None:
                record.passes_known = False
            else:
                record.passes = dict(known["passes"])
                record.resolutions = {k: dict(v) for k, v in known.get("fused_op_implementations", {}).items()}
                record.attention = {k: dict(v) for k, v in known.get("attention", {}).items()}
        else:
            entry = {"passes": record.passes, "fused_op_implementations": record.resolutions, "attention": record.attention}
            pass_log_cache.put(ghash, self.state.pass_uuid, entry)
        if self.state.config.sequence_parallel and record.passes_known:
            _check_every_attention_split(self.region, record)
        self.state.records.append(record)
        logger.info("compiled %s in %.2fs%s", label, record.seconds, " (cache hit)" if record.cache_hit else "")
        if self.state.on_region_compiled:
            self.state.on_region_compiled(record)
        return compiled


def _check_every_attention_split(region: Region, record: RegionCompile) -> None:
    """Under sequence parallelism each attention module of the block must have become Ulysses attention: one the
    attention pass did not see (computed without SDPA: a kernel called directly, an explicit softmax Inductor did
    not recognise) would attend to one rank's share of the tokens."""
    from omni_compile.parallel.plan import attention_heads

    modules = len(attention_heads(region.instances[0][1]))
    calls = sum(int(r.get("count", 0)) for r in record.attention.values())
    if calls < modules:
        raise ConfigError(f"sequence parallelism: a {region.name} holds {modules} attention module(s) but its graph has "
                          f"{calls} attention call(s) the attention pass could split; the others would attend to "
                          "one rank's tokens only. Run this model in one process (parallel ulysses=1)")  # fmt: skip


class RegionForward:
    """Installed as `instance.forward`: calls the region's compiled function with the instance."""

    def __init__(self, compiled: Callable, module: nn.Module, canonicalize: bool):
        self.compiled = compiled
        self.module = module
        self.canonicalize = canonicalize

    def __call__(self, *args, **kwargs):
        args, kwargs = region_call(args, kwargs, module_device(self.module), self.canonicalize)
        return self.compiled(self.module, *args, **kwargs)


def _refuse_hooked_blocks(regions) -> None:
    """A block whose forward diffusers' hooks wrap (a cache method, offloading, layerwise casting) would lose them:
    its forward is replaced by the compiled region's."""
    for region in regions:
        for path, module in region.instances:
            registry = getattr(module, "_diffusers_hook", None)
            if registry is not None and registry.hooks:
                raise ConfigError(
                    f"{path} has diffusers hooks ({', '.join(registry.hooks)}), which compiling its region would drop; "
                    "compile first, then add them (omni_compile.enable_step_cache after omni_compile.compile)"
                )


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < _RECOMPILE_LIMIT:
            setattr(cfg, name, _RECOMPILE_LIMIT)
            break
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 4 * _RECOMPILE_LIMIT:
        cfg.accumulated_recompile_limit = 4 * _RECOMPILE_LIMIT


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def make_pass_manager(config: CompileConfig, platform: Platform, adapter) -> PassManager:
    """The pass manager for a model of `adapter`'s family: checks pass switches, kernel choices, the
    attention config and its roles, and that explicit choices can run on `platform`."""
    from omni_compile.attention.config import AttentionConfig, check_roles

    check_roles(AttentionConfig.from_json(config.attention), adapter.attention_roles, adapter.family)
    return PassManager(config, platform, attention_role=adapter.attention_role)


def compile(
    model: nn.Module,
    config: CompileConfig | dict | None = None,
    *,
    regions: list[str] | None = None,
    on_region_compiled: Callable[[RegionCompile], None] | None = None,
    adapter=None,
    cuda_graphs: bool = False,
    precision: str | None = None,
    parallel=None,
    parallel_plan: dict | None = None,
) -> nn.Module:
    """Compile `model`'s regions with Inductor and our passes (JIT, on first call per bucket).

    `regions` names the block classes (default: the model's `_repeated_blocks`, else the classes of its
    lists of identical blocks, `graphs.regions.discover_block_classes`); `adapter` is the
    model family's adapter (default: found from the model's class), which maps attention modules to
    roles. `cuda_graphs` (a model on a CUDA GPU): the whole forward, regions and glue, replays one CUDA
    graph per bucket, captured on the first call of that bucket after its regions compiled (inference
    only; see `omni_compile.runtime.cuda_graphs` for the contract). `precision="fp8"` (lossy, opt-in): the
    weight transform fp8, the blocks' Linears as fp8 GEMMs (docs/fast-mode.md); None or "lossless": as the
    model is. `parallel` (`omni_compile.parallel.ParallelConfig`, or "ulysses=N"): this process is one of N ranks
    started together (torchrun) that run each call together, each on 1/N of the tokens (docs/parallel.md);
    `parallel_plan` replaces the model's context-parallel plan (`_cp_plan`). Returns the same module, whose
    forward signature is unchanged.
    """
    if isinstance(config, dict):
        config = CompileConfig.from_dict(config)
    config = config or CompileConfig()
    config = with_precision(config, precision)
    if getattr(model, "_omni_compile", None) is not None:
        raise ConfigError("this model is already compiled by omni-compile; call omni_compile.uncompile(model) first")
    platform = current_platform(_model_device(model))
    parallel_state, plan = None, None
    if parallel is not None:
        from omni_compile.parallel import ParallelConfig, init_parallel
        from omni_compile.parallel.plan import check_splittable

        parallel = ParallelConfig.parse(parallel)
        if parallel.ulysses > 1:
            plan = check_splittable(model, parallel.ulysses, parallel_plan)  # before any process group starts
            parallel_state = init_parallel(parallel, _model_device(model).type)
            config = dataclasses.replace(config, sequence_parallel=True)
    if adapter is None:
        from omni_compile.models.registry import adapter_for_model

        adapter = adapter_for_model(model)
    pass_manager = make_pass_manager(config, platform, adapter)
    found = find_regions(model, regions)
    _refuse_hooked_blocks(found)
    if config.weight_transforms or config.fp8_keep:  # once, on the weights being bound; never per step
        from omni_compile.weights import apply_transforms

        apply_transforms(model, config.weight_transforms, [m for r in found for _, m in r.instances], config.fp8_keep)
        found = find_regions(model, regions)  # again: a transform may change the blocks' structure
    state = CompileState(
        config=config,
        platform=platform,
        pass_manager=pass_manager,
        regions=found,
        on_region_compiled=on_region_compiled,
    )
    _raise_recompile_limit()
    for region in state.regions:
        fn = torch.compile(
            region.cls.forward, backend=RegionBackend(region, state), fullgraph=config.fullgraph, dynamic=False
        )
        for _, module in region.instances:
            module.forward = RegionForward(fn, module, config.canonicalize_strides)
    if cuda_graphs:
        if _model_device(model).type != "cuda":
            raise ConfigError(f"cuda_graphs=True needs the model on a CUDA GPU; it is on {_model_device(model)}")
        from omni_compile.runtime import capture_forward

        state.cuda_graphs = capture_forward(model)
    if parallel_state is not None:
        from omni_compile.parallel.plan import shard_model

        shard_model(model, parallel_state, plan)
    model._omni_compile = state
    logger.info(
        "omni-compile: %d region(s) %s on %s, passes %s",
        len(state.regions),
        [f"{r.name} x{len(r.instances)}" for r in state.regions],
        platform.kind,
        state.pass_manager.enabled,
    )
    return model


def uncompile(model: nn.Module) -> nn.Module:
    """Undo `compile`: every block runs its eager forward again (a step cache on the model is disabled first: its
    hooks wrap the compiled forwards)."""
    state = getattr(model, "_omni_compile", None)
    if state is None:
        return model
    if getattr(model, "_omni_step_cache", None) is not None:
        from omni_compile.runtime.step_cache import disable_step_cache

        disable_step_cache(model)
    if getattr(model, "_omni_parallel", None) is not None:
        from omni_compile.parallel.plan import unshard_model

        unshard_model(model)
    for region in state.regions:
        for _, module in region.instances:
            module.__dict__.pop("forward", None)
    if state.cuda_graphs is not None:
        model.__dict__.pop("forward", None)
    model._omni_compile = None
    return model


def compile_state(model: nn.Module) -> CompileState:
    state = getattr(model, "_omni_compile", None)
    if state is None:
        raise ConfigError("this model was not compiled with omni_compile.compile")
    return state
