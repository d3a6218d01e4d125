"""The diffusers pipeline around the artifact's transformer: loading it, checking prompts, running a batch.

The artifact's model family picks the task (`TASKS`): FLUX runs text-to-image (`FluxPipeline`,
`text_to_image.py`), Wan text-to-video (`WanPipeline`, `text_to_video.py`). Where the parts come from:
`--pipeline DIR` if given; else the pipeline directory the artifact was built from (`omni-compile build DIR`
records DIR/transformer as the model source); else, for a preset artifact (`flux-tiny`, `flux-dev`,
`wan-tiny`, `wan-1.3b`), a seeded random pipeline made in memory (`omni_compile.models.flux_pipeline`,
`omni_compile.models.wan_pipeline`). The transformer is always `omni_compile.load(ARTIFACT, weights=...)`: its
regions run the compiled files.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

import omni_compile
from omni_compile.server.config import ServeConfig

logger = logging.getLogger("omni_compile.server")


@dataclass
class Bucket:
    height: int
    width: int
    batch: int
    frames: int | None = None  # a video bucket's frames (None: an image)


@dataclass
class ServedPipeline:
    """A diffusers pipeline around the artifact's transformer, and what the engine and the routes need of it: the
    prompt check, the served sizes, and `run` (one batch, a step callback). One subclass per task
    (`text_to_image.ImagePipeline`, `text_to_video.VideoPipeline`); `TASKS` maps a model family to its class."""

    task: ClassVar[str] = ""  # "text-to-image" or "text-to-video"
    pipeline_class: ClassVar[str] = ""  # the diffusers pipeline class, read from a directory's model_index.json
    default_guidance: ClassVar[float] = 3.5
    supports_step_cache: ClassVar[bool] = True

    pipe: Any
    manifest: dict[str, Any]
    device: torch.device
    text_len: int
    buckets: list[Bucket]
    compiled: bool  # False: the transformer was JIT-compiled (--jit-fallback on another platform)
    source: str  # where the text encoders, VAE and scheduler came from
    seconds: dict[str, float] = field(default_factory=dict)
    step_cache: Any = None  # omni_compile.runtime.step_cache.StepCache when served with --step-cache
    loras: Any = None  # omni_compile.runtime.lora.LoraSet of the transformer (None: a pipeline without one)
    dynamic: Any = None  # omni_compile.config.DynamicRange of a `build --dynamic` artifact: sizes served besides buckets
    last_calls: tuple[int, int] | None = None

    def __post_init__(self):
        # Prompts are checked on the request path while the worker thread runs the pipeline. A fast (Rust) tokenizer
        # keeps its padding and truncation settings as state that every call sets: a check call racing the
        # pipeline's padded T5 call left that call unpadded (4 tokens for a 4-token prompt, not text_len), and the
        # transformer was called at a shape the artifact does not hold. The checks use private copies.
        self._check_tokenizers = {name: copy.deepcopy(getattr(self.pipe, name)) for name, _, _ in self.token_limits()}
        self._check_lock = threading.Lock()

    # --- what a task defines ----------------------------------------------------------------------------
    def token_limits(self) -> list[tuple[str, str, int]]:
        """(pipeline attribute of a tokenizer, its name in errors, most tokens a prompt may have) per tokenizer."""
        raise NotImplementedError

    def generate(self, prompts: list[str], generators: list[torch.Generator], height: int, width: int, steps: int,
                 guidance: float, frames: int | None, callback: Callable) -> list[bytes]:  # fmt: skip
        """One pipeline call; the encoded outputs (PNG, MP4), one per prompt."""
        raise NotImplementedError

    @classmethod
    def random_pipeline(cls, preset: str, transformer, *, text_len: int, dtype: torch.dtype, device: str, seed: int):
        """A preset's pipeline with seeded random parts around `transformer`."""
        raise NotImplementedError

    @classmethod
    def match_build_call(cls, transformer) -> None:
        """Make the pipeline's transformer call look like the build's (the compiled files are looked up by it)."""

    def configure(self, config: ServeConfig) -> None:
        """Take the server options of this task (e.g. the video frame rate)."""

    # --- shared -------------------------------------------------------------------------------------------
    @property
    def sizes(self) -> list[str]:
        """Served sizes as OpenAI writes them, WIDTHxHEIGHT, in the manifest's order."""
        return list(dict.fromkeys(f"{b.width}x{b.height}" for b in self.buckets))

    def _at(self, height: int, width: int) -> list[Bucket]:
        """The buckets of this size; for a size of the dynamic range that is no bucket, every bucket (their frame
        counts and batch sizes are the dimensions the build kept static)."""
        exact = [b for b in self.buckets if (b.height, b.width) == (height, width)]
        if not exact and self.dynamic is not None and self.dynamic.contains(height, width):
            return list(self.buckets)
        return exact

    def frames(self, height: int, width: int) -> list[int]:
        """The frame counts served at this size (video); [] for images."""
        return sorted({b.frames for b in self._at(height, width) if b.frames})

    def batch_sizes(self, height: int, width: int, frames: int | None = None) -> list[int]:
        sizes = sorted({b.batch for b in self._at(height, width) if b.frames == frames})
        return sizes or [1]  # a size outside the buckets (JIT fallback) runs one at a time

    def prompt_error(self, prompt: str) -> str | None:
        """Why `prompt` is too long for a tokenizer, or None."""
        for name, label, limit in self.token_limits():
            with self._check_lock:
                n = len(self._check_tokenizers[name](prompt).input_ids)
            if n > limit:
                return f"prompt is {n} tokens for the {label} tokenizer, which takes at most {limit} here; shorten it"
        return None

    def run(self, prompts: list[str], seeds: list[int], height: int, width: int, steps: int, guidance: float,
            on_step: Callable[[int], None] | None = None, step_cache: str | None = None,
            lora: tuple[str, float] | None = None, frames: int | None = None) -> list[bytes]:  # fmt: skip
        """One pipeline call: len(prompts) outputs, output i drawn from a generator seeded seeds[i]; encoded bytes.
        `step_cache`: the setting for this call ("off": every step computed) on a pipeline loaded with one;
        `last_calls` is then (transformer calls, computed calls) of the call. `lora`: (name, scale) merged into
        the transformer's weights for this call (None: the base weights); ConfigError when it is not loaded.
        `frames`: a video's frame count."""
        gens = [torch.Generator(self.device).manual_seed(s) for s in seeds]
        if self.loras is None and lora is not None:
            raise omni_compile.ConfigError("this server's model takes no LoRA")
        # only this thread runs the transformer: the weights switch here, and an unload waits for the call
        applied = self.loras.applied(*(lora or (None,))) if self.loras is not None else contextlib.nullcontext()
        cache = self.step_cache
        if cache is not None:
            from omni_compile.runtime.step_cache import EVERY_STEP, StepCacheConfig

            cache.set_config(EVERY_STEP if step_cache in (None, "off") else StepCacheConfig.parse(step_cache))
            before = cache.stats.snapshot()

        def callback(pipe, i, t, kwargs):
            if on_step is not None:
                on_step(i)
            return {}

        with applied, torch.no_grad():  # no grad, as the CUDA-graph runtime is tested (not inference mode)
            out = self.generate(prompts, gens, height, width, steps, guidance, frames, callback)
        if cache is not None:
            after = cache.stats.snapshot()
            self.last_calls = (after[0] - before[0], after[1] - before[1])
        return out


# The task of each model family the server runs: (module, class) in omni_compile.server, imported when used.
TASKS = {"flux": ("text_to_image", "ImagePipeline"), "wan": ("text_to_video", "VideoPipeline")}


def task_class(manifest, artifact) -> type[ServedPipeline]:
    """The served pipeline class of the artifact's model family; ConfigError for a family no task runs."""
    family = manifest.model.family
    if family not in TASKS:
        raise omni_compile.ConfigError(
            f"{artifact} holds a {family!r} model; `omni-compile serve` runs "
            + ", ".join(f"{f} ({_task_name(f)})" for f in TASKS) + " models"
        )
    module, name = TASKS[family]
    return getattr(importlib.import_module(f"omni_compile.server.{module}"), name)


def _task_name(family: str) -> str:
    return TASKS[family][0].replace("_", "-")


def pipeline_dir(config: ServeConfig, source: str, pipeline_class: str | None = None) -> Path | None:
    """The diffusers pipeline directory to read the other parts from, or None for a preset's random one;
    `source` is the artifact's model source. With `pipeline_class` (e.g. "WanPipeline"), a directory whose
    model_index.json names another pipeline class is refused."""
    if config.pipeline:
        d = Path(config.pipeline)
        if not (d / "model_index.json").is_file():
            raise omni_compile.ConfigError(f"--pipeline {d} is not a diffusers pipeline directory (no model_index.json)")
    elif source.startswith("preset:"):
        return None
    else:
        d = next((c for c in (Path(source), Path(source).parent) if (c / "model_index.json").is_file()), None)
        if d is None:
            raise omni_compile.ConfigError(
                f"the artifact was built from {source}, which is not inside a diffusers pipeline directory; pass "
                "--pipeline DIR (a directory with model_index.json, text encoders, tokenizers, VAE and scheduler)"
            )
    if pipeline_class is not None:
        try:
            found = json.loads((d / "model_index.json").read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError) as e:
            raise omni_compile.ConfigError(f"{d / 'model_index.json'} is not readable JSON: {e}") from None
        if found != pipeline_class:
            raise omni_compile.ConfigError(f"{d} holds a {found}; this artifact's model runs in a {pipeline_class}: "
                                           f"pass --pipeline with a {pipeline_class} directory")  # fmt: skip
    return d


def weights_dir(path: str) -> Path:
    """The transformer directory of --weights: the directory itself, or a pipeline directory's transformer/."""
    d = Path(path)
    for cand in (d, d / "transformer"):
        if (cand / "config.json").is_file():
            return cand
    raise omni_compile.ConfigError(f"--weights {d} is not a diffusers transformer directory (no config.json in it or "
                                   "in its transformer/)")  # fmt: skip


def load_pipeline(config: ServeConfig, checked: tuple | None = None, preloaded=None) -> ServedPipeline:
    """The pipeline with the artifact's transformer, as its task's class. `checked`: `artifact.loader.check`'s result
    for the artifact (`omni-compile serve` checks before it starts): the manifest is read and the files hashed once.
    `preloaded`: `artifact.loader.preload`'s compiled files, loading while the weights are read."""
    import diffusers
    from diffusers.utils import logging as dlogging

    from omni_compile.artifact.manifest import read_manifest
    from omni_compile.config import parse_dtype
    from omni_compile.models import resolve_model

    manifest = checked[0] if checked is not None else read_manifest(Path(config.artifact))
    cls = task_class(manifest, config.artifact)
    if config.step_cache and not cls.supports_step_cache:
        raise omni_compile.ConfigError(f"--step-cache: not available for {cls.task} yet; serve without it")
    device = config.device or manifest.build.device
    dtype = parse_dtype(manifest.build.dtype)
    root = pipeline_dir(config, manifest.model.source, cls.pipeline_class)
    # the text length the transformer was compiled for (a build from a directory records none: the family's default)
    text_len = int(manifest.build.text_len or omni_compile.models.ADAPTERS[manifest.model.family].default_text_len)
    dlogging.set_verbosity_error()
    t0 = time.perf_counter()
    if root is None:  # a random pipeline of the same preset around the build's seeded random weights (or --weights)
        preset, seed = manifest.model.source.removeprefix("preset:"), manifest.weights.get("seed", 0)
    if config.weights:  # another checkpoint of the architecture: omni_compile.load checks its config
        weights = resolve_model(str(weights_dir(config.weights))).load(dtype=dtype, device=device)
    elif root is None:
        weights = resolve_model(preset, model_config=manifest.model.config).load(dtype=dtype, device=device,
                                                                                   seed=seed)  # fmt: skip
    else:
        weights = resolve_model(str(root / "transformer")).load(dtype=dtype, device=device)
    t1 = time.perf_counter()
    # step caching skips blocks per call: a whole-step CUDA graph would replay one path
    graphs = {"cuda_graphs": False} if config.step_cache else {}
    transformer = omni_compile.load(config.artifact, weights=weights, device=device, jit_fallback=config.jit_fallback,
                                    checked=checked, preloaded=preloaded, **graphs)  # fmt: skip
    t2 = time.perf_counter()
    if root is None:
        pipe = cls.random_pipeline(preset, transformer, text_len=text_len, dtype=dtype, device=device, seed=seed)
        source = f"random {preset} pipeline (seed {seed})"
    else:
        pipeline_type = getattr(diffusers, cls.pipeline_class)
        pipe = pipeline_type.from_pretrained(root, transformer=transformer, dtype=dtype, local_files_only=True)
        pipe = pipe.to(device)
        source = str(root)
    cls.match_build_call(transformer)
    seconds = {"transformer_weights": t1 - t0, "artifact_load": t2 - t1, "other_parts": time.perf_counter() - t2}
    seconds = {k: round(v, 3) for k, v in seconds.items()}
    pipe.set_progress_bar_config(disable=True)
    buckets = [Bucket(b.height, b.width, b.batch, b.frames)
               for b in map(omni_compile.ShapeBucket.parse, manifest.build.buckets)]  # fmt: skip
    artifact_info = getattr(transformer, "_omni_artifact", None)
    if artifact_info is not None:
        seconds.update({f"artifact_{k}": v for k, v in artifact_info.seconds.items()})
    cache = None
    if config.step_cache:
        from omni_compile.runtime.step_cache import enable_step_cache

        cache = enable_step_cache(pipe, config.step_cache)
    from omni_compile.runtime.lora import lora_adapters

    loras = lora_adapters(transformer)  # bf16 or fp8 Linears alike
    for name, path in config.loras.items():
        loras.load(name, path)
    served = cls(pipe=pipe, manifest=manifest, device=torch.device(device), text_len=text_len, buckets=buckets,
                 compiled=artifact_info is not None, source=source, seconds=seconds, step_cache=cache, loras=loras,
                 dynamic=manifest.build.dynamic_range if artifact_info is not None else None)  # fmt: skip
    served.configure(config)
    return served
