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


class MiniBlock(torch.nn.Module):
    """Pre-norm self-attention with a residual: an RMSNorm, one qkv projection, SDPA, an output projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(b, s, -1))


class MiniDiT(torch.nn.Module):
    """The smallest model a build goes through whole: one block class (two instances) between two glue
    projections, so three compiled files per bucket (flux-tiny has eight). For tests of a mechanism (a store,
    a race, a failure mid-build) that any model shows: `generic_model:MiniDiT` with `mini_inputs`."""

    _repeated_blocks = ["MiniBlock"]

    def __init__(self, in_channels: int = 8, dim: int = 32, heads: int = 2, num_layers: int = 2):
        super().__init__()
        self.in_channels = in_channels
        self.proj_in = torch.nn.Linear(in_channels, dim)
        self.blocks = torch.nn.ModuleList(MiniBlock(dim, heads) for _ in range(num_layers))
        self.proj_out = torch.nn.Linear(dim, in_channels)

    def forward(self, hidden_states, return_dict: bool = False):
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x = block(x)
        return (self.proj_out(x),)


def mini_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """A 16x16-patch image's tokens: [B, H/16 * W/16, in_channels]."""
    g = torch.Generator().manual_seed(seed)
    tokens = (bucket.height // 16) * (bucket.width // 16)
    x = torch.randn(bucket.batch, tokens, model.in_channels, generator=g)
    return {"hidden_states": x.to(device, dtype), "return_dict": False}
