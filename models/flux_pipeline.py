"""A whole FLUX text-to-image pipeline with seeded random weights, for presets and tests (no hub).

`random_pipeline(preset, transformer, ...)` builds the parts around a transformer: a CLIP text encoder,
a T5 encoder, a FLUX VAE, the flow-matching scheduler and two tokenizers this module makes itself
with the `tokenizers` library (a word-level vocabulary, no download). `flux-tiny` gets tiny parts
sized to its transformer (joint_attention_dim 32, in_channels 16 → 4 VAE latent channels);
`flux-dev` gets FLUX.1-dev-sized ones (CLIP-L, T5-XXL, the 16-channel VAE).
`save_pipeline(pipe, out)` writes it as a diffusers pipeline directory that `omni-compile build DIR`
and `omni-compile serve --pipeline DIR` read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni_compile.errors import ConfigError

# Parts per preset: CLIP text model, T5 encoder, VAE. The transformer is the preset's (models/flux.py).
PARTS: dict[str, dict[str, Any]] = {
    "flux-tiny": {
        "clip": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     max_position_embeddings=77, projection_dim=32),
        "t5": dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, feed_forward_proj="gated-gelu"),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=4,
                    block_out_channels=(4, 8, 8, 8), scaling_factor=0.3611, shift_factor=0.1159,
                    use_quant_conv=False, use_post_quant_conv=False,
                    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
    },
    "flux-dev": {  # FLUX.1-dev's text encoders and VAE
        "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu"),
        "t5": dict(d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu",
                   relative_attention_num_buckets=32),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, norm_num_groups=32,
                    block_out_channels=(128, 256, 512, 512), scaling_factor=0.3611, shift_factor=0.1159,
                    use_quant_conv=False, use_post_quant_conv=False,
                    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
    },
}
VOCAB_SIZE = {"flux-tiny": 1000, "flux-dev": 49408}
T5_VOCAB_SIZE = {"flux-tiny": 1000, "flux-dev": 32128}
CLIP_MAX_TOKENS = 77

# The tokenizers' vocabulary: specials, then these words, then single characters; anything else is [UNK].
_SPECIALS = ["<pad>", "</s>", "<unk>", "<s>"]
_WORDS = (
    "a an the of and with in on at by for to from under over red green blue yellow black white orange purple "
    "cat dog bird fish horse tree flower house car boat city sky sea mountain river forest street night day sun "
    "moon star cloud rain snow portrait photo painting drawing of style big small old young happy sad bright dark "
    "sitting standing running flying watercolor oil digital art detailed high quality"
).split()


def make_tokenizer(max_length: int):
    """A word-level tokenizer (lowercase, split on whitespace and punctuation) ending every text with
    `</s>`, wrapped as transformers' fast tokenizer, padding to `max_length`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys([*_SPECIALS, *_WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789"]))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>", bos_token="<s>")  # fmt: skip


def random_components(preset: str, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> dict[str, Any]:
    """Text encoders, VAE, scheduler and tokenizers of `preset`'s pipeline, seeded random weights."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if preset not in PARTS:
        raise ConfigError(f"no pipeline parts for {preset!r}; pipelines exist for {', '.join(PARTS)}. "
                          "Pass a diffusers pipeline directory (--pipeline DIR) instead")  # fmt: skip
    parts = PARTS[preset]
    tokenizer = make_tokenizer(CLIP_MAX_TOKENS)
    tokenizer_2 = make_tokenizer(512)
    torch.manual_seed(seed)
    with torch.device(device):
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB_SIZE[preset], eos_token_id=tokenizer.eos_token_id,
                                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                            **parts["clip"]))  # fmt: skip
        t5 = T5EncoderModel(T5Config(vocab_size=T5_VOCAB_SIZE[preset], **parts["t5"]))
        vae = AutoencoderKL(**parts["vae"])
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return {
        "text_encoder": clip.to(dtype).eval().requires_grad_(False),
        "text_encoder_2": t5.to(dtype).eval().requires_grad_(False),
        "vae": vae.to(dtype).eval().requires_grad_(False),
        "scheduler": scheduler,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
    }


def random_pipeline(preset: str, transformer, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A `FluxPipeline` around `transformer` with `preset`'s random parts (see `random_components`)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(transformer=transformer, **random_components(preset, dtype=dtype, device=device, seed=seed))
    match_build_call(transformer)
    return pipe


def _no_empty_attention_kwargs(module, args, kwargs):
    if kwargs.get("joint_attention_kwargs") == {}:
        kwargs["joint_attention_kwargs"] = None
    return args, kwargs


def match_build_call(transformer) -> None:
    """Make `FluxPipeline`'s transformer call match the one the artifact was built from.

    The pipeline passes `joint_attention_kwargs={}` where the build's example inputs leave it None; the
    blocks receive it as an argument, so their call signature (and the compiled file looked up) would
    differ. A forward pre-hook turns the empty dict back into None; a non-empty one is left alone.
    """
    if not getattr(transformer, "_omni_call_hook", False):
        transformer.register_forward_pre_hook(_no_empty_attention_kwargs, with_kwargs=True)
        transformer._omni_call_hook = True


def save_pipeline(preset: str, out: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write `preset`'s whole random pipeline (its transformer included) as a diffusers directory."""
    from omni_compile.models.registry import resolve_model

    spec = resolve_model(preset)
    transformer = spec.load(dtype=dtype, device="cpu", seed=seed)
    pipe = random_pipeline(preset, transformer, dtype=dtype, device="cpu", seed=seed)
    out = Path(out)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
