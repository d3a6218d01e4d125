"""`ServeConfig`: everything `omni-compile serve` can set, one field per flag."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeConfig:
    artifact: str
    """The artifact directory written by `omni-compile build`."""
    pipeline: str | None = None
    """A diffusers pipeline directory (text encoders, tokenizers, VAE, scheduler); default: the one the
    artifact was built from, or a seeded random pipeline for a preset artifact."""
    device: str | None = None
    """Device to run on (default: the one the artifact was built for)."""
    api_key: str | None = None
    """When set, every route but /health needs `Authorization: Bearer API_KEY`."""
    max_queue: int = 16
    """Requests waiting for the worker at most; one more is answered 429 at once."""
    max_batch: int = 1
    """Images of compatible requests (same size, steps, guidance) run together, up to this many, when the
    artifact has a bucket of that batch size."""
    max_n: int = 4
    """Images per request at most."""
    max_steps: int = 100
    """Denoising steps per request at most."""
    default_steps: int = 28
    """Steps when a request does not say."""
    timeout_s: float = 600.0
    """Per-request deadline: a request not finished by then fails with 504, and its work stops at the next step."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies are answered 413."""
    jit_fallback: bool = False
    """Load the artifact on another platform by compiling just in time (sizes are then not limited to
    the artifact's buckets); without it such an artifact is refused."""
    warmup_steps: int = 2
    """Steps of the warm-up run per bucket at start (captures CUDA graphs on a GPU)."""
    model_name: str | None = None
    """The model id in /v1/models and responses (default: the artifact directory's name)."""
    step_cache: str | None = None
    """Lossy step caching (`first_block[:THRESHOLD]`, `schedule[:FRACTION[:WARMUP]]` or `taylor[:FRACTION[:WARMUP]]`),
    the setting of requests that do not give one; requests may give their own or "off". None: off, and requests
    cannot ask for it.
    Whole-step CUDA graphs are off when it is on."""
    weights: str | None = None
    """A diffusers transformer directory (or a pipeline directory, whose transformer/ is taken) to serve instead of
    the weights the artifact was built from: any checkpoint of the architecture, zero compiles (the config is
    checked against the artifact's)."""
    loras: dict[str, str] = field(default_factory=dict)
    """LoRA adapters loaded at start, name -> safetensors file (`--lora NAME=PATH`); requests pick one with
    `lora: {"name": NAME, "scale": S}`, and /v1/loras adds and removes them at run time (zero compiles)."""
    max_video_jobs: int = 16
    """Video jobs held at most (queued, running and finished ones not yet expired); to make room for a new one the
    oldest finished job is removed, and when every one is queued or running a new one is answered 429."""
    video_ttl_s: float = 3600.0
    """A finished video job (and its MP4) is removed this many seconds after it finished."""
    video_dir: str | None = None
    """Where the MP4s are written: a directory the server makes inside this one at start and removes at shutdown
    (default: inside the system's temporary directory)."""
    video_max_bytes: int = 1 << 30
    """The MP4s on disk take at most this many bytes together; the oldest finished jobs are removed to make room."""
    video_fps: int = 16
    """Frames a second of the MP4s, and how `seconds` turns into frames: frames = seconds * fps + 1 (Wan 2.1: 16)."""
