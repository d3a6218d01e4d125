"""`BuildSession`: one build's model spec, dtype, device, buckets, text length and pass manager, resolved
and checked once, before any slow work, for every build mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_compile.config import CompileConfig, DynamicRange, ShapeBucket, parse_dtype
from omni_compile.errors import ConfigError


@dataclass
class BuildOptions:
    """What `omni-compile build` (and `inspect` of a model) was asked for, as the user said it."""

    model: str | None = None
    shapes: str | None = None
    dtype: str | None = None
    device: str | None = None
    out: str | None = None
    seed: int = 0
    text_len: int | None = None
    example_inputs: str | None = None
    model_config: dict[str, Any] | None = None
    regions: list[str] | None = None  # block classes to compile (default: _repeated_blocks, else discovered)
    compile: CompileConfig = field(default_factory=CompileConfig)
    cache_from: str | None = None
    store: str | None = None  # aot: file://PATH or redis://... store of compiled files; jit: Inductor's remote caches (redis)
    format: str | None = None  # aot mode: "aoti-package" or "inductor-standalone" (None: by device; build.compilers)
    force: bool = False
    mode: str = "aot"  # "aot": a prebuilt artifact; "jit": report + Inductor cache bundle (build.compilers.select)
    parity: str = "auto"  # aot: "auto" skips the check when the store's publishers checked every file; "always"
    dynamic: str | None = None  # aot: "LOW-HIGH[:STEP]", sizes served by regions with symbolic sequence lengths


@dataclass
class BuildEvents:
    """Callbacks the CLI uses for its progress display."""

    on_stage: Callable[[str], None] = lambda msg: None
    on_region_compiled: Callable[[Any], None] = lambda rec: None  # a compiler.RegionCompile
    on_bucket_done: Callable[[ShapeBucket, float, int], None] = lambda bucket, seconds, compiles: None
    on_warning: Callable[[str], None] = lambda msg: None


@dataclass
class BuildSession:
    """A build's model and targets, resolved once from its options (`resolve`)."""

    opts: BuildOptions
    spec: Any  # models.ModelSpec
    dtype: torch.dtype
    device: str
    buckets: list[ShapeBucket]
    text_len: int | None  # tokens per prompt in the example inputs: --text-len, the preset's, the adapter's
    pass_manager: Any  # passes.PassManager, made for this platform and model family
    dynamic: DynamicRange | None = None  # --dynamic: buckets then start with the range's probes
    check_buckets: list[ShapeBucket] = field(default_factory=list)  # run against eager after the build, not traced

    @classmethod
    def resolve(cls, opts: BuildOptions) -> BuildSession:
        """Model, shapes, pass switches, pass options and kernel choices (a kernel asked for by name must be
        able to run on this platform) are checked here, before any slow work."""
        from omni_compile.compiler import make_pass_manager
        from omni_compile.models import resolve_model
        from omni_compile.platform import current_platform

        spec = resolve_model(opts.model, example_inputs=opts.example_inputs, model_config=opts.model_config,
                             regions=opts.regions)  # fmt: skip
        device = _resolve_device(opts.device, spec.default_device)
        # A model with no preset: bf16 on an accelerator, fp32 on the CPU (where bf16 is slow and rarely meant).
        default_dtype = spec.default_dtype or ("fp32" if torch.device(device).type == "cpu" else "bf16")
        dtype = parse_dtype(opts.dtype or default_dtype)
        shapes = opts.shapes or spec.default_shapes
        if not shapes:
            raise ConfigError(f"{spec.source} has no default shapes; pass --shapes (e.g. 1024x1024)")
        buckets = ShapeBucket.parse_list(shapes)
        dynamic, checks = None, []
        if opts.dynamic:
            dynamic = DynamicRange.parse(opts.dynamic)
            buckets, checks = _dynamic_buckets(dynamic, buckets, explicit=bool(opts.shapes))
        for bucket in buckets + checks:
            spec.adapter.check_bucket(bucket)
        pm = make_pass_manager(opts.compile, current_platform(device), spec.adapter)
        text_len = opts.text_len or spec.text_len or spec.adapter.default_text_len
        return cls(opts, spec, dtype, device, buckets, text_len, pm, dynamic, checks)

    def load_model(self) -> torch.nn.Module:
        """The model with the session's dtype, device and seed (random weights or the directory's)."""
        model = self.spec.load(dtype=self.dtype, device=self.device, seed=self.opts.seed)
        sync(self.device)
        return model

    def example_inputs(self, model: torch.nn.Module, bucket: ShapeBucket, seed: int | None = None) -> dict:
        """The forward's keyword arguments for `bucket`, from the family's adapter (or the user's function)."""
        return self.spec.adapter.example_inputs(model, bucket, dtype=self.dtype, device=self.device,
                                                text_len=self.text_len, seed=self.opts.seed if seed is None else seed)


def _dynamic_buckets(dynamic: DynamicRange, given: list[ShapeBucket], explicit: bool):
    """(buckets to record, buckets to check) for a `--dynamic` build: per frame count and batch of the given
    buckets, the range's two probes (recorded: the dimensions that differ between them become symbolic) and
    its middle (checked: it must run through the compiled files with no compile); then the given buckets that
    lie in the range. An explicit --shapes bucket outside the range is an error; a preset's is dropped."""
    outside = [b for b in given if not dynamic.contains(b.height, b.width)]
    if outside and explicit:
        raise ConfigError(f"--shapes {', '.join(map(str, outside))} outside --dynamic {dynamic} (heights and widths "
                          f"from {dynamic.low} to {dynamic.high} in steps of {dynamic.step}); widen the range or "
                          "drop those shapes")  # fmt: skip
    kinds = list(dict.fromkeys((b.frames, b.batch) for b in given))
    probes = [p for f, n in kinds for p in dynamic.probes(f, n)]
    inside = [b for b in given if b not in outside and b not in probes]
    checks = [m for m in (dynamic.middle(f, n) for f, n in kinds) if m not in inside and m not in probes]
    return probes + inside, checks


def _resolve_device(requested: str | None, default: str | None) -> str:
    device = requested or default or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but this machine has no CUDA GPU; use --device cpu")
    if kind not in ("cuda", "cpu", "xpu"):
        raise ConfigError(f"unsupported device {device!r}; use cuda, cpu or xpu")
    return device


def check_out(out: Path, force: bool) -> None:
    """An output directory may be written: absent, empty, or `force`."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"output {out} exists and is not empty; pass --force to replace it or choose another --out")


def sync(device: str) -> None:
    """Wait for the device (a timing or a memory reading follows)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
