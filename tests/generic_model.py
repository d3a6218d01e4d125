"""A model omni-compile has no adapter for: diffusers' LTX-Video transformer, built tiny.

`ltx_inputs` is the user-supplied example-input function the generic adapter needs
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
