"""A whole Wan 2.1 text-to-video pipeline with seeded random weights, for presets and tests (no hub).

`random_pipeline(preset, transformer, ...)` builds the parts around a transformer: a UMT5 text encoder,
a Wan VAE (`AutoencoderKLWan`), the UniPC flow-matching scheduler of Wan2.1-T2V and a tokenizer made
here (the word-level one of `flux_pipeline.make_tokenizer`: no download; words outside its small
vocabulary become `<unk>`). `wan-tiny` gets tiny parts sized to its transformer (text_dim 32,
in_channels 4 → a 4-channel VAE latent); `wan-1.3b` gets Wan2.1-T2V-1.3B-sized ones (UMT5-XXL, the
16-channel VAE). The VAE keeps Wan's compression (8x in space, 4x in time), so a bucket HxWxF of the
transformer is a video of F frames at HxW.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_compile.errors import ConfigError
from omni_compile.models.flux_pipeline import make_tokenizer

# Parts per preset: UMT5 encoder and Wan VAE. The transformer is the preset's (models/wan.py).
PARTS: dict[str, dict[str, Any]] = {
    "wan-tiny": {
        "umt5": {"vocab_size": 1000, "d_model": 32, "d_ff": 64, "d_kv": 16, "num_layers": 2, "num_heads": 2,
                 "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 8},
        "vae": {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "attn_scales": [],
                "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4},
    },
    "wan-1.3b": {  # Wan2.1-T2V-1.3B's text encoder (UMT5-XXL) and VAE (diffusers' defaults are Wan 2.1's)
        "umt5": {"vocab_size": 256384, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_layers": 24, "num_heads": 64,
                 "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32},
        "vae": {"base_dim": 96, "z_dim": 16},
    },
}
# Wan2.1-T2V's sampler: UniPC on flow-matching sigmas; flow_shift 3.0 is the value for 480p (5.0 for 720p).
SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "num_train_timesteps": 1000, "flow_shift": 3.0}
FPS = 16  # Wan 2.1 makes 16 frames a second: 81 frames are a 5-second clip


def random_components(preset: str, *, text_len: int, dtype: torch.dtype, device: str | torch.device,
                      seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Text encoder, VAE, scheduler and tokenizer of `preset`'s pipeline, seeded random weights; the tokenizer
    pads to `text_len`, the text length the transformer was built for."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    if preset not in PARTS:
        raise ConfigError(f"no pipeline parts for {preset!r}; pipelines exist for {', '.join(PARTS)}. "
                          "Pass a diffusers pipeline directory (--pipeline DIR) instead")  # fmt: skip
    parts = PARTS[preset]
    tokenizer = make_tokenizer(text_len)
    torch.manual_seed(seed)
    with torch.device(device):
        umt5 = UMT5EncoderModel(UMT5Config(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                           decoder_start_token_id=tokenizer.pad_token_id, **parts["umt5"]))  # fmt: skip
        vae = AutoencoderKLWan(**parts["vae"])
    return {
        "text_encoder": umt5.to(dtype).eval().requires_grad_(False),
        # the VAE stays in fp32, as in diffusers' Wan examples (the pipeline casts the latents to its dtype)
        "vae": vae.eval().requires_grad_(False),
        "scheduler": UniPCMultistepScheduler(**SCHEDULER),
        "tokenizer": tokenizer,
    }


def random_pipeline(preset: str, transformer, *, text_len: int, dtype: torch.dtype, device: str | torch.device,
                    seed: int = 0):  # fmt: skip
    """A `WanPipeline` around `transformer` with `preset`'s random parts (see `random_components`)."""
    from diffusers import WanPipeline

    parts = random_components(preset, text_len=text_len, dtype=dtype, device=device, seed=seed)
    pipe = WanPipeline(transformer=transformer, **parts)
    match_build_call(transformer)
    return pipe


def _timestep_as_built(module, args, kwargs):
    t = kwargs.get("timestep")
    if isinstance(t, torch.Tensor) and not t.is_floating_point():
        kwargs["timestep"] = t.to(torch.float32)
    return args, kwargs


def match_build_call(transformer) -> None:
    """Make `WanPipeline`'s transformer call match the one the artifact was built from.

    Wan's UniPC scheduler gives integer (int64) timesteps; the build's example inputs give an fp32 timestep (what
    the flow-matching schedulers give), and the compiled `condition_embedder` is looked up by dtype. A forward
    pre-hook casts an integer timestep to fp32, exactly (the eager pipeline's embedding upcasts it the same way).
    A floating-point timestep is left alone.
    """
    if not getattr(transformer, "_omni_call_hook", False):
        transformer.register_forward_pre_hook(_timestep_as_built, with_kwargs=True)
        transformer._omni_call_hook = True


def save_pipeline(preset: str, out: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write `preset`'s whole random pipeline (its transformer included) as a diffusers directory."""
    from omni_compile.models.registry import resolve_model

    spec = resolve_model(preset)
    transformer = spec.load(dtype=dtype, device="cpu", seed=seed)
    pipe = random_pipeline(preset, transformer, text_len=spec.text_len or 512, dtype=dtype, device="cpu", seed=seed)
    out = Path(out)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
