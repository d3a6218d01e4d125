"""Typed configuration.

Each field carries a docstring. `compute_hash()` covers exactly the fields that change generated
code; `from_dict` rejects unknown keys so a typo is an error, not a silently ignored option.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_compile.argtypes import region_list  # noqa: F401  (its home before argtypes)
from omni_compile.errors import ConfigError

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


_BUCKET_RE = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class ShapeBucket:
    """One static input shape the build compiles for: pixels height x width [x frames], and batch."""

    height: int
    width: int
    frames: int | None = None
    batch: int = 1

    @classmethod
    def parse(cls, text: str, default_batch: int = 1) -> "ShapeBucket":
        m = _BUCKET_RE.match(text.strip().lower())
        if not m:
            raise ConfigError(
                f"malformed shape {text!r}: expected HEIGHTxWIDTH or HEIGHTxWIDTHxFRAMES, "
                "optionally @BATCH (e.g. 1024x1024, 480x832x81, 512x512@2)"
            )
        h, w, f, b = m.groups()
        bucket = cls(int(h), int(w), int(f) if f else None, int(b) if b else default_batch)
        if min(bucket.height, bucket.width, bucket.batch) <= 0 or (bucket.frames is not None and bucket.frames <= 0):
            raise ConfigError(f"shape {text!r} has a zero dimension; every dimension must be positive")
        return bucket

    @classmethod
    def parse_list(cls, text: str | list[str], default_batch: int = 1) -> list["ShapeBucket"]:
        items = text.split(",") if isinstance(text, str) else list(text)
        items = [t for t in (i.strip() for i in items) if t]
        if not items:
            raise ConfigError("no shapes given: pass --shapes like 1024x1024 (or 480x832x81 for video)")
        buckets = [cls.parse(t, default_batch) for t in items]
        return list(dict.fromkeys(buckets))

    def __str__(self) -> str:
        s = f"{self.height}x{self.width}"
        if self.frames is not None:
            s += f"x{self.frames}"
        return s + (f"@{self.batch}" if self.batch != 1 else "")


_RANGE_RE = re.compile(r"^(\d+)-(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class DynamicRange:
    """`build --dynamic LO-HI[:STEP]`: every height and width from LO to HI pixels in steps of STEP (default 64),
    served by regions compiled once with symbolic sequence lengths instead of one file per bucket."""

    low: int
    high: int
    step: int = 64

    @classmethod
    def parse(cls, text: str) -> DynamicRange:
        m = _RANGE_RE.match(text.strip())
        if not m:
            raise ConfigError(f"malformed --dynamic {text!r}: expected LOW-HIGH[:STEP] in pixels, e.g. 512-1536:64")
        low, high, step = int(m.group(1)), int(m.group(2)), int(m.group(3) or 64)
        if low <= 0 or step <= 0:
            raise ConfigError(f"--dynamic {text!r}: sizes and the step must be positive")
        if high - low < step or (high - low) % step:
            raise ConfigError(f"--dynamic {text!r}: HIGH - LOW must be a positive multiple of STEP ({step}); "
                              f"e.g. {low}-{low + 4 * step}:{step}")  # fmt: skip
        return cls(low, high, step)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> DynamicRange | None:
        return None if not data else cls(int(data["min"]), int(data["max"]), int(data["step"]))

    def to_json(self) -> dict[str, int]:
        return {"min": self.low, "max": self.high, "step": self.step}

    def contains(self, height: int, width: int) -> bool:
        return all(self.low <= v <= self.high and (v - self.low) % self.step == 0 for v in (height, width))

    def probes(self, frames: int | None = None, batch: int = 1) -> list[ShapeBucket]:
        """The two sizes a build records to find which dimensions vary: the range's ends, height and width one
        step apart (so that no two sizes of the call are equal by chance)."""
        lo, hi = self.low, self.high
        return [ShapeBucket(lo, lo + self.step, frames, batch), ShapeBucket(hi, hi - self.step, frames, batch)]

    def middle(self, frames: int | None = None, batch: int = 1) -> ShapeBucket:
        """A size between the probes, checked after the build: it must run through the compiled files."""
        n = (self.high - self.low) // self.step
        h = self.low + (n // 2) * self.step
        w = h + self.step if h + self.step <= self.high else h - self.step
        return ShapeBucket(h, w, frames, batch)

    def __str__(self) -> str:
        return f"{self.low}-{self.high}:{self.step}"


def _field_docs(cls) -> dict[str, str]:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _from_dict(cls, data: dict[str, Any]):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s) {unknown}; valid keys are {sorted(known)}")
    return cls(**data)


@dataclass
class CompileConfig:
    """How omni-compile compiles the regions of a model."""

    passes: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "Pass switches applied in order over each pass's default: '+name' or 'name' enables, "
            "'-name' disables, 'none' disables all, 'all' enables all."
        },
    )
    pass_options: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata={"doc": "Per-pass options by pass name, e.g. {'rms_norm': {'semantics': ['torch']}}."},
    )
    kernels: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "doc": "Implementation per fused op: 'auto' (the platform kernel where it can run, else native), "
            "'native', or a kernel name such as 'triton' (an error if it cannot run). Key '*' sets every op."
        },
    )
    attention: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "Attention backend per role: {'default': {'backend': NAME}, 'per_role': {ROLE: {'backend': NAME}}, "
            "'measure': true}; NAME is auto (default) or TORCH_SDPA, CUDNN_ATTN, FA3_ATTN, FA4_ATTN, FLASH_ATTN, "
            "TRITON_ATTN, SAGE_ATTN. A per_role entry replaces the default for that role; 'measure' (default true): "
            "auto on a GPU times the capable backends per call shape and takes the fastest (docs/attention.md)."
        },
    )
    weight_transforms: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "Load-time weight transforms, run once when the weights are bound (compile, build, load), "
            "never per step: 'fuse_projections' (each attention module's q/k/v projections as one GEMM; "
            "the separate weights become views of the fused one; docs/artifact.md#weight-transforms); 'fp8' "
            "(lossy: the blocks' Linears as fp8 GEMMs, CUDA sm89+ and omni_compile.compile only; "
            "docs/fast-mode.md)."
        },
    )
    fp8_keep: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "With the weight transform 'fp8': Linears that stay in the model's dtype, as fnmatch patterns "
            "of module paths ('transformer_blocks.*.ff.net.2', '*.attn.to_out.0'), beside those that always stay "
            "(modulation Linears, and everything outside the repeated blocks). Each pattern must match a Linear "
            "fp8 would take."
        },
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={
            "doc": "Every attention call of a region runs as Ulysses attention over the sequence-parallel group "
            "(omni_compile.parallel; compile(parallel=...) sets it): the regions then run on one rank's share "
            "of the tokens. Without a group (one process) the attention is the backend's as usual."
        },
    )
    fullgraph: bool = field(
        default=True, metadata={"doc": "Each region must trace as one graph; a graph break is an error."}
    )
    canonicalize_strides: bool = field(
        default=True,
        metadata={
            "doc": "Give size-1 dimensions of region inputs contiguous strides (a free view) so instances "
            "fed by views and by fresh tensors share one compiled graph."
        },
    )
    dump_dir: str | None = field(
        default=None,
        metadata={"doc": "Write each region's Dynamo graph and the post-grad graph before/after every pass here."},
    )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CompileConfig":
        return _from_dict(cls, data)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        return _field_docs(cls)

    def compute_hash(self) -> str:
        """Hash of the fields that change generated code (dump_dir does not)."""
        factors = {
            "passes": list(self.passes),
            "pass_options": self.pass_options,
            "kernels": self.kernels,
            "attention": self.attention,
            "fullgraph": self.fullgraph,
            "canonicalize_strides": self.canonicalize_strides,
        }
        if self.weight_transforms:  # only when set: the hash of every earlier config stays what it was
            factors["weight_transforms"] = list(self.weight_transforms)
        if self.fp8_keep:
            factors["fp8_keep"] = list(self.fp8_keep)
        if self.sequence_parallel:
            factors["sequence_parallel"] = True
        return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def json_arg(value: str | None, what: str) -> dict[str, Any] | None:
    """A JSON-object argument: inline JSON, or the path of a file holding it (None stays None)."""
    if value is None:
        return None
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.exists():
            raise ConfigError(f"{what} {value!r} is neither inline JSON nor an existing file")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object")
    return data


PRECISIONS = ("lossless", "fp8")


def with_precision(config: CompileConfig, precision: str | None) -> CompileConfig:
    """`config` with what `precision` asks: "fp8" adds the lossy weight transform fp8; None or "lossless" leaves it
    (a copy when it changes: the caller's config is never modified)."""
    if precision is None or precision == "lossless":
        return config
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}; choose {' or '.join(PRECISIONS)}")
    if "fp8" in config.weight_transforms:
        return config
    return dataclasses.replace(config, weight_transforms=[*config.weight_transforms, "fp8"])


def compile_config_from_flags(args) -> CompileConfig:
    """The CompileConfig of `--config`, `--passes`, `--kernels`, `--attention` and `--attention-backend`
    (build and inspect take the same flags)."""
    config = CompileConfig.from_dict(json_arg(args.config, "--config") or {})
    config.passes = [*config.passes, *args.passes]
    transforms = getattr(args, "weight_transforms", None)
    if transforms:
        from omni_compile.weights import check_transforms

        names = [t.strip() for t in transforms.split(",") if t.strip()]
        check_transforms(names)
        config.weight_transforms = [*config.weight_transforms, *(n for n in names if n not in config.weight_transforms)]
    config = with_precision(config, getattr(args, "precision", None))
    keep = getattr(args, "fp8_keep", None)
    if keep:
        config.fp8_keep = [*config.fp8_keep, *(k.strip() for k in keep.split(",") if k.strip())]
    if args.kernels:
        from omni_compile.ops.registry import parse_kernel_items

        config.kernels = {**config.kernels, **parse_kernel_items(",".join(args.kernels))}
    attention_text = getattr(args, "attention", None)
    if attention_text or args.attention_backend:
        from omni_compile.attention.config import backend_name, merge_attention, parse_attention_text

        attention = merge_attention(config.attention, parse_attention_text(attention_text or ""))
        if args.attention_backend:
            attention["default"] = {"backend": backend_name(args.attention_backend, "--attention-backend")}
        config.attention = attention
    return config
