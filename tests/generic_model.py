"""Models omni-compile has no adapter for (diffusers LTX-Video, Chroma, Qwen-Image), built tiny.

Each `*_inputs` is the user-supplied example-input function the generic adapter needs
(`--example-inputs generic_model:ltx_inputs` with this directory on PYTHONPATH).
"""

import torch

LTX_TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    num_layers=2,
    caption_channels=16,
)


def ltx_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    frames = (bucket.frames - 1) // 8 + 1 if bucket.frames else 1
    h, w = bucket.height // 32, bucket.width // 32
    t = text_len or 8
    return {
        "hidden_states": torch.randn(bucket.batch, frames * h * w, model.config.in_channels, generator=g).to(
            device, dtype
        ),
        "encoder_hidden_states": torch.randn(bucket.batch, t, model.config.caption_channels, generator=g).to(
            device, dtype
        ),
        "timestep": torch.full((bucket.batch,), 500, dtype=torch.long, device=device),
        "encoder_attention_mask": torch.ones(bucket.batch, t, dtype=dtype, device=device),
        "num_frames": frames,
        "height": h,
        "width": w,
        "return_dict": False,
    }


CHROMA_TINY = dict(
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
    approximator_num_channels=8,
    approximator_hidden_dim=32,
    approximator_layers=1,
)


def chroma_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Chroma (a FLUX-like model, no pooled text): packed 2x2 latent patches, 8x VAE."""
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 16, bucket.width // 16
    t = text_len or 8
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {
        "hidden_states": torch.randn(bucket.batch, h * w, model.config.in_channels, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(bucket.batch, t, model.config.joint_attention_dim, generator=g).to(
            device, dtype
        ),
        "timestep": torch.full((bucket.batch,), 0.5, dtype=dtype, device=device),
        "img_ids": img_ids.reshape(h * w, 3).to(device, dtype),
        "txt_ids": torch.zeros(t, 3, dtype=dtype, device=device),
        "return_dict": False,
    }


QWEN_TINY = dict(
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)


def qwen_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Qwen-Image: packed 2x2 latent patches (8x VAE); its rotary embedding takes a torch.device."""
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 16, bucket.width // 16
    t = text_len or 8
    return {
        "hidden_states": torch.randn(bucket.batch, h * w, model.config.in_channels, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(bucket.batch, t, model.config.joint_attention_dim, generator=g).to(
            device, dtype
        ),
        "encoder_hidden_states_mask": torch.ones(bucket.batch, t, dtype=torch.long, device=device),
        "timestep": torch.full((bucket.batch,), 0.5, dtype=dtype, device=device),
        "img_shapes": [[(1, h, w)]] * bucket.batch,
        "return_dict": False,
    }


# (class, tiny config, example-input function, a small bucket): the models with no adapter that CI builds.
GENERIC_MODELS = {
    "ltx-video": ("diffusers:LTXVideoTransformer3DModel", LTX_TINY, "generic_model:ltx_inputs", "64x64x9"),
    "chroma": ("diffusers:ChromaTransformer2DModel", CHROMA_TINY, "generic_model:chroma_inputs", "64x64"),
    "qwen-image": ("diffusers:QwenImageTransformer2DModel", QWEN_TINY, "generic_model:qwen_inputs", "64x64"),
}
