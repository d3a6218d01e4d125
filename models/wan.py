"""Wan 2.1 (`WanTransformer3DModel`): regions, roles, example inputs, presets.

Latents are 16 channels at 1/8 of the pixel size and (frames - 1)/4 + 1 latent frames, patched
1x2x2, so 480x832x81 is 21 * 30 * 52 = 32,760 tokens.
"""

from __future__ import annotations

import torch

from omni_compile.config import ShapeBucket
from omni_compile.models.base import ModelAdapter, Preset, randn, require


class WanAdapter(ModelAdapter):
    family = "wan"
    attention_roles = {"wan.self": "video self-attention", "wan.cross": "cross-attention to the text tokens"}
    default_text_len = 512
    _ROLES = {"attn1": "wan.self", "attn2": "wan.cross"}

    def attention_role(self, module_path: str) -> str:
        return self._ROLES.get(module_path.rsplit(".", 1)[-1], super().attention_role(module_path))

    def model_class(self):
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel

    def check_bucket(self, bucket: ShapeBucket) -> None:
        require(bucket.frames is not None, f"Wan takes video: shape {bucket} needs frames, e.g. 480x832x81")
        require(bucket.frames % 4 == 1, f"Wan needs frames = 4k+1 (1, 5, ..., 81); got {bucket.frames}")
        require(
            bucket.height % 16 == 0 and bucket.width % 16 == 0,
            f"Wan needs height and width divisible by 16 (8x VAE, 2x2 patches); got {bucket}",
        )

    def example_inputs(self, model, bucket, *, dtype, device, text_len=None, seed=0):
        self.check_bucket(bucket)
        cfg = model.config
        g = torch.Generator().manual_seed(seed)
        frames = (bucket.frames - 1) // 4 + 1
        t = text_len or self.default_text_len
        return {
            "hidden_states": randn(
                g,
                bucket.batch,
                cfg.in_channels,
                frames,
                bucket.height // 8,
                bucket.width // 8,
                dtype=dtype,
                device=device,
            ),
            # fp32 whatever the model's dtype, as WanPipeline's schedulers give it (UniPC's integer steps are exact
            # in fp32; in bf16 999 would round to 1000)
            "timestep": torch.full((bucket.batch,), 500.0, dtype=torch.float32, device=device),
            "encoder_hidden_states": randn(g, bucket.batch, t, cfg.text_dim, dtype=dtype, device=device),
            "return_dict": False,
        }


PRESETS = [
    Preset(
        name="wan-1.3b",
        family="wan",
        description="Wan2.1-T2V-1.3B transformer (30 blocks, 12x128 heads), random weights",
        config=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        ),
        default_shapes="480x832x81",
        text_len=512,
    ),
    Preset(
        name="wan-tiny",
        family="wan",
        description="tiny Wan (2 blocks, 2x16 heads), random weights; builds on a CPU",
        config=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=64,
        ),
        default_shapes="64x64x5,64x96x9",
        text_len=8,
        default_dtype="fp32",
        default_device="cpu",
    ),
]
