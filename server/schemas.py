"""Request and response bodies (OpenAI images and videos APIs plus our extensions), and the checks that need the
loaded model (sizes, prompt length). Types are checked by pydantic (422); values by `validate` and
`videos.validate_video` (400)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr


class LoraRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    scale: StrictFloat | StrictInt = 1.0


class ImageRequest(BaseModel):
    """POST /v1/images/generations. Unknown OpenAI fields (quality, style, user) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: StrictStr
    n: StrictInt = 1
    size: StrictStr | None = None
    response_format: StrictStr = "b64_json"
    model: StrictStr | None = None
    seed: StrictInt | None = None
    num_inference_steps: StrictInt | None = None
    guidance_scale: StrictFloat | StrictInt = 3.5
    step_cache: StrictStr | None = None  # "off", first_block[...], schedule[...], taylor[...]
    lora: LoraRef | None = None  # a LoRA the server has loaded, merged for this request (zero compiles)


class VideoRequest(BaseModel):
    """POST /v1/videos, as JSON or as OpenAI's client sends it (multipart/form-data, every value a string): a JSON
    body is validated strictly, a form's numbers are read from their text. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: str | None = None
    size: str | None = Field(None, description="WIDTHxHEIGHT, one of /v1/models' sizes (default: the first)")
    seconds: str | int | float | None = Field(None, description="clip length; frames = seconds * fps + 1")
    seed: int | None = Field(None, description="extension: the generator's seed (default: random)")
    num_inference_steps: int | None = Field(None, description="extension: denoising steps")
    guidance_scale: float | int | None = Field(None, description="extension: classifier-free guidance (Wan: 5)")
    num_frames: int | None = Field(None, description="extension: frames (instead of seconds), one served at the size")
    lora: LoraRef | None = Field(None, description="extension (JSON bodies): a loaded LoRA merged for this job")
    step_cache: str | None = Field(None, description="extension: step caching for this job ('off', "
                                   "'schedule:0.5', ...); the server's --step-cache when absent")  # fmt: skip
    input_reference: object | None = Field(None, description="image-to-video: not supported (400)")


class StepCacheReport(BaseModel):
    setting: str = Field(description="the step cache setting the request ran with ('off': every step computed)")
    fraction_computed: float | None = Field(description="transformer calls that ran every block, over all its "
                                            "calls (None: a video job that has not run yet)")  # fmt: skip


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """A video job, as OpenAI's video object, plus our extensions (seed, num_frames, fps, steps)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = Field(description="0-100: denoising steps done over steps; 100 once the MP4 is written")
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = Field(None, description="when a finished job and its MP4 are removed (--video-ttl)")
    size: str
    seconds: str
    prompt: str
    error: VideoError | None = None
    seed: int
    num_frames: int
    fps: int
    num_inference_steps: int
    steps_done: int
    guidance_scale: float
    step_cache: StepCacheReport | None = Field(None, description="with --step-cache: the setting, and once the job "
                                               "ran, the share of transformer calls computed")  # fmt: skip


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class LoraLoad(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    path: StrictStr = Field(description="a safetensors file on the server's machine (diffusers/PEFT or kohya layout)")


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None
    seed: int = Field(description="the seed this image was drawn with (request seed + index)")


class ImageResponse(BaseModel):
    created: int
    data: list[ImageData]
    step_cache: StepCacheReport | None = None  # present when the server runs with --step-cache


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "authentication_error", "server_error", "overloaded_error",
                  "timeout_error", "not_found_error", "conflict_error"]  # fmt: skip
    param: str | None = None
    code: str | None = None


class RequestError(Exception):
    """A request the server refuses; `app` turns it into `{"error": ErrorBody}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)
        self.headers = headers


def parse_size(size: str) -> tuple[int, int]:
    """OpenAI's "WIDTHxHEIGHT" as (height, width); our buckets are HEIGHTxWIDTH."""
    w, sep, h = size.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise RequestError(400, f"size {size!r} is not WIDTHxHEIGHT, e.g. '1024x1024'", param="size")
    return int(h), int(w)


def step_cache_setting(req: ImageRequest, default: str | None) -> str | None:
    """The request's step cache setting in canonical text ("off" for none), or None where the server runs without
    step caching; raises RequestError (400)."""
    from omni_compile.errors import ConfigError
    from omni_compile.runtime.step_cache import StepCacheConfig

    text = req.step_cache
    if default is None:
        if text not in (None, "off"):
            raise RequestError(400, "step_cache: this server runs without step caching; start it with --step-cache "
                               "to allow it", param="step_cache")  # fmt: skip
        return None
    text = default if text is None else text
    if text.strip() == "off":
        return "off"
    try:
        config = StepCacheConfig.parse(text)
    except ConfigError as e:
        raise RequestError(400, f"step_cache: {e}, or 'off'", param="step_cache") from None
    return config.text()


def step_cache_report(job) -> StepCacheReport | None:
    """What a job (`engine.Job`) ran with: its step cache setting and the share of its transformer calls computed
    (None before it ran); None where the server runs without step caching."""
    if job.step_cache is None:
        return None
    calls = sum(c for c, _ in job.computed)
    done = sum(k for _, k in job.computed)
    return StepCacheReport(setting=job.step_cache, fraction_computed=round(done / calls, 4) if calls else None)


def lora_setting(req: ImageRequest, loras) -> tuple[str, float] | None:
    """The request's (LoRA name, scale), checked against the loaded adapters (`loras`, a LoraSet or None); raises
    RequestError (400)."""
    if req.lora is None:
        return None
    loaded = sorted(loras.adapters) if loras is not None else []
    if req.lora.name not in loaded:
        raise RequestError(400, f"lora: no LoRA named {req.lora.name!r} is loaded (loaded: {', '.join(loaded) or 'none'}"
                           "; POST /v1/loras loads one)", param="lora.name")  # fmt: skip
    scale = float(req.lora.scale)
    if not -10 <= scale <= 10:
        raise RequestError(400, f"lora: scale must be from -10 to 10, not {req.lora.scale!r}", param="lora.scale")
    return req.lora.name, scale


def check_model(req, model_name: str) -> None:
    if req.model is not None and req.model != model_name:
        raise RequestError(400, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip


def check_common(req, *, max_steps: int, default_steps: int, seed_room: int) -> int:
    """The checks an image and a video request share (prompt, steps, guidance, seed); the steps. A seed leaves
    room for `seed_room` more outputs (seed + i); raises RequestError (400)."""
    if not req.prompt.strip():
        raise RequestError(400, "prompt is empty", param="prompt")
    steps = default_steps if req.num_inference_steps is None else req.num_inference_steps
    if not 1 <= steps <= max_steps:
        raise RequestError(400, f"num_inference_steps must be between 1 and {max_steps}, got {steps}",
                           param="num_inference_steps")  # fmt: skip
    if req.guidance_scale is not None and not 0.0 <= float(req.guidance_scale) <= 100.0:
        raise RequestError(400, f"guidance_scale must be between 0 and 100, got {req.guidance_scale}",
                           param="guidance_scale")  # fmt: skip
    if req.seed is not None and not 0 <= req.seed < 2**63 - seed_room:
        raise RequestError(400, f"seed must be between 0 and 2**63 - {seed_room + 1}, got {req.seed}", param="seed")
    return steps


def check_size(size: str, sizes: list[str], any_size: bool, dynamic=None) -> tuple[int, int]:
    """`size` (WIDTHxHEIGHT) as (height, width) when served (any multiple of 16 from 16 to 4096 with `any_size`;
    every size of `dynamic`, a `config.DynamicRange`, besides `sizes`); raises RequestError (400)."""
    height, width = parse_size(size)
    served = f"{width}x{height}" in sizes or (dynamic is not None and dynamic.contains(height, width))
    if not served and not any_size:
        also = (f", and every width and height from {dynamic.low} to {dynamic.high} in steps of {dynamic.step}"
                if dynamic is not None else "")  # fmt: skip
        raise RequestError(400, f"size {size!r} is not served: the artifact was compiled for "
                           f"{', '.join(sizes)} (WIDTHxHEIGHT){also}. Ask for one of them, or rebuild the artifact "
                           "with the size added to --shapes (or within --dynamic)", param="size",
                           code="unsupported_size")  # fmt: skip
    if any_size and (height % 16 or width % 16 or not 16 <= height <= 4096 or not 16 <= width <= 4096):
        raise RequestError(400, f"size {size!r}: width and height must be multiples of 16 between 16 and 4096",
                           param="size")  # fmt: skip
    return height, width


def validate(req: ImageRequest, *, sizes: list[str], default_size: str, max_n: int, max_steps: int,
             default_steps: int, model_name: str, any_size: bool, dynamic=None) -> tuple[int, int, int]:  # fmt: skip
    """The request's (height, width, steps) after the value checks; raises RequestError (400)."""
    check_model(req, model_name)
    if req.response_format != "b64_json":
        raise RequestError(400, f"response_format {req.response_format!r} is not supported: images are returned "
                           "inline only; use 'b64_json'", param="response_format")  # fmt: skip
    if not 1 <= req.n <= max_n:
        raise RequestError(400, f"n must be between 1 and {max_n}, got {req.n}", param="n")
    steps = check_common(req, max_steps=max_steps, default_steps=default_steps, seed_room=max_n)
    height, width = check_size(req.size or default_size, sizes, any_size, dynamic)
    return height, width, steps
