"""FLUX.1 (`FluxTransformer2DModel`): regions, roles, example inputs, presets.

Latents are 16 channels at 1/8 of the pixel size, packed 2x2 into 64-channel tokens, so an
HxW image is (H/16)*(W/16) image tokens; the text side is `text_len` T5 tokens.
"""

from __future__ import annotations

import torch

from omni_compile.config import ShapeBucket
from omni_compile.models.base import ModelAdapter, Preset, randn, require


class FluxAdapter(ModelAdapter):
    family = "flux"
    attention_roles = {"flux.joint": "joint text+image attention in the double and single stream blocks"}
    default_text_len = 512

    def attention_role(self, module_path: str) -> str:
        return "flux.joint"  # the one attention of both block classes: text and image tokens together

    def model_class(self):
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    def check_bucket(self, bucket: ShapeBucket) -> None:
        require(bucket.frames is None, f"FLUX takes images: shape {bucket} has frames; use HEIGHTxWIDTH")
        require(
            bucket.height % 16 == 0 and bucket.width % 16 == 0,
            f"FLUX needs height and width divisible by 16 (8x VAE, 2x2 packing); got {bucket}",
        )

    def example_inputs(self, model, bucket, *, dtype, device, text_len=None, seed=0):
        self.check_bucket(bucket)
        cfg = model.config
        g = torch.Generator().manual_seed(seed)
        b, h, w = bucket.batch, bucket.height // 16, bucket.width // 16
        t = text_len or self.default_text_len
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        inputs = {
            "hidden_states": randn(g, b, h * w, cfg.in_channels, dtype=dtype, device=device),
            "encoder_hidden_states": randn(g, b, t, cfg.joint_attention_dim, dtype=dtype, device=device),
            "pooled_projections": randn(g, b, cfg.pooled_projection_dim, dtype=dtype, device=device),
            "timestep": torch.full((b,), 0.5, dtype=dtype, device=device),
            "img_ids": img_ids.reshape(h * w, 3).to(device=device, dtype=dtype),
            "txt_ids": torch.zeros(t, 3, device=device, dtype=dtype),
            "return_dict": False,
        }
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full((b,), 3.5, dtype=dtype, device=device)
        return inputs


PRESETS = [
    Preset(
        name="flux-dev",
        family="flux",
        description="FLUX.1-dev transformer (19 double + 38 single blocks, 24x128 heads, 11.9B params), random weights",
        config={"guidance_embeds": True},
        default_shapes="1024x1024",
        text_len=512,
    ),
    Preset(
        name="flux-tiny",
        family="flux",
        description="tiny FLUX (2 double + 2 single blocks, 2x16 heads), random weights; builds on a CPU",
        config=dict(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
        default_shapes="64x64,128x128",
        text_len=8,
        default_dtype="fp32",
        default_device="cpu",
    ),
]
