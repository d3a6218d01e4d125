"""The diffusers pipeline around the artifact's transformer: loading it, checking prompts, running a batch.

Where the parts come from: `--pipeline DIR` if given; else the pipeline directory the artifact was built
from (`omni-compile build DIR` records DIR/transformer as the model source); else, for a preset artifact
(`flux-tiny`, `flux-dev`), a seeded random pipeline made in memory (`omni_compile.models.flux_pipeline`).
The transformer is always `omni_compile.load(ARTIFACT, weights=...)`: its regions run the compiled files.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import omni_compile
from omni_compile.server.config import ServeConfig

logger = logging.getLogger("omni_compile.server")


@dataclass
class Bucket:
    height: int
    width: int
    batch: int


@dataclass
class LoadedPipeline:
    """The pipeline and what the server needs to know about it."""

    pipe: Any
    manifest: dict[str, Any]
    device: torch.device
    text_len: int
    buckets: list[Bucket]
    compiled: bool  # False: the transformer was JIT-compiled (--jit-fallback on another platform)
    source: str  # where the text encoders, VAE and scheduler came from
    seconds: dict[str, float] = field(default_factory=dict)
    step_cache: Any = None  # omni_compile.runtime.step_cache.StepCache when served with --step-cache
    loras: Any = None  # omni_compile.runtime.lora.LoraSet of the transformer (None: an fp8 model, no LoRA)
    last_calls: tuple[int, int] | None = None

    def __post_init__(self):
        # Prompts are checked on the request path while the worker thread runs the pipeline. A fast (Rust) tokenizer
        # keeps its padding and truncation settings as state that every call sets: a check call racing the
        # pipeline's padded T5 call left that call unpadded (4 tokens for a 4-token prompt, not text_len), and the
        # transformer was called at a shape the artifact does not hold. The checks use private copies.
        names = ("tokenizer", "tokenizer_2")
        self._check_tokenizers = {name: copy.deepcopy(getattr(self.pipe, name)) for name in names}
        self._check_lock = threading.Lock()

    @property
    def sizes(self) -> list[str]:
        """Served sizes as OpenAI writes them, WIDTHxHEIGHT, in the manifest's order."""
        return list(dict.fromkeys(f"{b.width}x{b.height}" for b in self.buckets))

    def batch_sizes(self, height: int, width: int) -> list[int]:
        sizes = sorted({b.batch for b in self.buckets if (b.height, b.width) == (height, width)})
        return sizes or [1]  # a size outside the buckets (JIT fallback) runs one image at a time

    def prompt_error(self, prompt: str) -> str | None:
        """Why `prompt` is too long for a tokenizer, or None."""
        for name, limit in (("tokenizer", self.pipe.tokenizer.model_max_length), ("tokenizer_2", self.text_len)):
            with self._check_lock:
                n = len(self._check_tokenizers[name](prompt).input_ids)
            if n > limit:
                return (f"prompt is {n} tokens for the {'CLIP' if name == 'tokenizer' else 'T5'} tokenizer, which "
                        f"takes at most {limit} here; shorten it")  # fmt: skip
        return None

    def run(self, prompts: list[str], seeds: list[int], height: int, width: int, steps: int, guidance: float,
            on_step: Callable[[int], None] | None = None, step_cache: str | None = None,
            lora: tuple[str, float] | None = None) -> list[bytes]:  # fmt: skip
        """One pipeline call: len(prompts) images, image i drawn from a generator seeded seeds[i]; PNG bytes.
        `step_cache`: the setting for this call ("off": every step computed) on a pipeline loaded with one;
        `last_calls` is then (transformer calls, computed calls) of the call. `lora`: (name, scale) merged into
        the transformer's weights for this call (None: the base weights); ConfigError when it is not loaded."""
        gens = [torch.Generator(self.device).manual_seed(s) for s in seeds]
        if self.loras is None and lora is not None:
            raise omni_compile.ConfigError("this server's model takes no LoRA (fp8)")
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
            out = self.pipe(prompt=prompts, height=height, width=width, num_inference_steps=steps,
                            guidance_scale=guidance, max_sequence_length=self.text_len, generator=gens,
                            output_type="pil", callback_on_step_end=callback)  # fmt: skip
        if cache is not None:
            after = cache.stats.snapshot()
            self.last_calls = (after[0] - before[0], after[1] - before[1])
        pngs = []
        for img in out.images:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            pngs.append(buf.getvalue())
        return pngs


def check_family(manifest, artifact) -> None:
    family = manifest.model.family
    if family != "flux":
        raise omni_compile.ConfigError(f"{artifact} holds a {family!r} model; `omni-compile serve` runs FLUX "
                                       "text-to-image pipelines only")  # fmt: skip


def pipeline_dir(config: ServeConfig, source: str) -> Path | None:
    """The diffusers pipeline directory to read the other parts from, or None for a preset's random one;
    `source` is the artifact's model source."""
    if config.pipeline:
        d = Path(config.pipeline)
        if not (d / "model_index.json").is_file():
            raise omni_compile.ConfigError(f"--pipeline {d} is not a diffusers pipeline directory (no model_index.json)")
        return d
    if source.startswith("preset:"):
        return None
    d = Path(source)
    for cand in (d, d.parent):
        if (cand / "model_index.json").is_file():
            return cand
    raise omni_compile.ConfigError(
        f"the artifact was built from {source}, which is not inside a diffusers pipeline directory; pass "
        "--pipeline DIR (a directory with model_index.json, text encoders, tokenizers, VAE and scheduler)"
    )


def weights_dir(path: str) -> Path:
    """The transformer directory of --weights: the directory itself, or a pipeline directory's transformer/."""
    d = Path(path)
    for cand in (d, d / "transformer"):
        if (cand / "config.json").is_file():
            return cand
    raise omni_compile.ConfigError(f"--weights {d} is not a diffusers transformer directory (no config.json in it or "
                                   "in its transformer/)")  # fmt: skip


def load_pipeline(config: ServeConfig, checked: tuple | None = None) -> LoadedPipeline:
    """The pipeline with the artifact's transformer. `checked`: `artifact.loader.check`'s result for the artifact
    (`omni-compile serve` checks before it starts): the manifest is read and the files hashed once."""
    from diffusers import FluxPipeline
    from diffusers.utils import logging as dlogging

    from omni_compile.artifact.manifest import read_manifest
    from omni_compile.config import parse_dtype
    from omni_compile.models import resolve_model
    from omni_compile.models.flux_pipeline import match_build_call, random_pipeline

    manifest = checked[0] if checked is not None else read_manifest(Path(config.artifact))
    check_family(manifest, config.artifact)
    device = config.device or manifest.build.device
    dtype = parse_dtype(manifest.build.dtype)
    root = pipeline_dir(config, manifest.model.source)
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
                                    checked=checked, **graphs)  # fmt: skip
    t2 = time.perf_counter()
    if root is None:
        pipe = random_pipeline(preset, transformer, dtype=dtype, device=device, seed=seed)
        source = f"random {preset} pipeline (seed {seed})"
    else:
        pipe = FluxPipeline.from_pretrained(root, transformer=transformer, torch_dtype=dtype, local_files_only=True)
        pipe = pipe.to(device)
        match_build_call(transformer)
        source = str(root)
    seconds = {"transformer_weights": t1 - t0, "artifact_load": t2 - t1, "other_parts": time.perf_counter() - t2}
    seconds = {k: round(v, 3) for k, v in seconds.items()}
    pipe.set_progress_bar_config(disable=True)
    buckets = [Bucket(b.height, b.width, b.batch) for b in map(omni_compile.ShapeBucket.parse, manifest.build.buckets)]
    artifact_info = getattr(transformer, "_omni_artifact", None)
    if artifact_info is not None:
        seconds.update({f"artifact_{k}": v for k, v in artifact_info.seconds.items()})
    # the text length the transformer was compiled for (a build from a directory records none: the family's default)
    text_len = int(manifest.build.text_len or omni_compile.models.ADAPTERS["flux"].default_text_len)
    cache = None
    if config.step_cache:
        from omni_compile.runtime.step_cache import enable_step_cache

        cache = enable_step_cache(pipe, config.step_cache)
    loras = None
    from omni_compile.ops.fp8 import has_fp8

    if not has_fp8(transformer):
        from omni_compile.runtime.lora import lora_adapters

        loras = lora_adapters(transformer)
        for name, path in config.loras.items():
            loras.load(name, path)
    elif config.loras:
        raise omni_compile.ConfigError("--lora: the artifact's model is fp8, which takes no LoRA yet")
    return LoadedPipeline(pipe=pipe, manifest=manifest, device=torch.device(device), text_len=text_len,
                          buckets=buckets, compiled=artifact_info is not None, source=source,
                          seconds=seconds, step_cache=cache, loras=loras)  # fmt: skip
