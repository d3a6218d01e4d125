"""A zoo of diffusers transformers omni-compile has no adapter for, each built tiny (CPU, fp32, < 2 s a forward).

Each `*_inputs` is the user-supplied example-input function the generic adapter calls
(`--example-inputs dit_zoo:sd3_inputs` with this directory on PYTHONPATH), with the contract
`fn(model, bucket, *, dtype, device, text_len=None, seed=0) -> dict of forward kwargs`.

Shared conventions: pixel sizes map to latents through an 8x VAE (latent H = bucket.height // 8,
W = bucket.width // 8); video latent frames = (bucket.frames - 1) // temporal_compression + 1; the text
length is `text_len or 8` (CogVideoX: its `max_text_seq_length`); random tensors come from
`torch.Generator().manual_seed(seed)` on the CPU; masks are all ones (no padding).
Sizes are read from `model.config`; the latent H and W must be divisible by the model's patch size.
"""

import torch

# ---------------------------------------------------------------------------------------------------------------
# SD3 (MMDiT, joint text-image blocks; the last block is context_pre_only)

SD3_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=32,  # must equal num_attention_heads * attention_head_dim
    pooled_projection_dim=16,
    out_channels=16,
    pos_embed_max_size=16,  # latent H/p and W/p must be <= this
)


def sd3_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """SD3/SD3.5: latents [B, C, H/8, W/8], T5+CLIP text states, pooled CLIP; flow-matching timestep in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    return {
        "hidden_states": torch.randn(b, model.config.in_channels, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, model.config.joint_attention_dim, generator=g).to(device, dtype),
        "pooled_projections": torch.randn(b, model.config.pooled_projection_dim, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 500.0).to(device, dtype),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# PixArt (single stream, cross-attention to T5, adaLN-single)

PIXART_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=8,  # learned sigma: 2 x in_channels
    num_layers=2,
    cross_attention_dim=32,  # = inner dim (the caption projection maps caption_channels to it)
    sample_size=8,
    patch_size=2,
    caption_channels=16,
    use_additional_conditions=False,  # PixArt-Sigma style (the 1024 Alpha uses resolution/aspect-ratio conditions)
)


def pixart_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """PixArt-Alpha/Sigma: latents [B, C, H/8, W/8], T5 states + mask; integer (DDPM-style) timestep in [0, 1000)."""
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    inputs = {
        "hidden_states": torch.randn(b, model.config.in_channels, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, model.config.caption_channels, generator=g).to(device, dtype),
        "encoder_attention_mask": torch.ones(b, t, dtype=torch.long).to(device),
        "timestep": torch.full((b,), 500, dtype=torch.long).to(device),
        "return_dict": False,
    }
    if model.use_additional_conditions:
        inputs["added_cond_kwargs"] = {
            "resolution": torch.tensor([[bucket.height, bucket.width]] * b, dtype=torch.float32).to(device, dtype),
            "aspect_ratio": torch.tensor([[bucket.height / bucket.width]] * b, dtype=torch.float32).to(device, dtype),
        }
    return inputs


# ---------------------------------------------------------------------------------------------------------------
# Sana (linear self-attention, cross-attention to Gemma states)

SANA_TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_cross_attention_heads=2,
    cross_attention_head_dim=16,
    cross_attention_dim=32,  # = inner dim (the caption projection maps caption_channels to it)
    caption_channels=16,
    sample_size=8,
    patch_size=1,
)


def sana_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Sana: latents [B, C, H/8, W/8], Gemma states + mask; flow-matching timestep in [0, 1000).

    The 8x VAE follows this zoo's convention; real Sana checkpoints use a 32x DC-AE, so a real-size bucket
    here gives 16x the tokens of the real pipeline. Guidance-embedding variants (Sana-Sprint) get `guidance`.
    """
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    inputs = {
        "hidden_states": torch.randn(b, model.config.in_channels, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, model.config.caption_channels, generator=g).to(device, dtype),
        "encoder_attention_mask": torch.ones(b, t, dtype=torch.long).to(device),
        "timestep": torch.full((b,), 500.0 * model.config.timestep_scale).to(device, dtype),
        "return_dict": False,
    }
    if model.config.guidance_embeds:
        inputs["guidance"] = torch.full((b,), 4.5 * model.config.guidance_embeds_scale).to(device, dtype)
    return inputs


# ---------------------------------------------------------------------------------------------------------------
# CogVideoX (video; text and video tokens in one sequence through "expert" adaLN blocks)

COGVIDEOX_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=8,
    out_channels=8,
    time_embed_dim=32,
    text_embed_dim=32,
    num_layers=2,
    sample_width=8,  # latent sizes the sincos position table is built for (other sizes rebuild it)
    sample_height=8,
    sample_frames=9,  # in pixel frames
    patch_size=2,
    max_text_seq_length=8,  # with sincos positions (CogVideoX-2b) the text length must equal this
)


def cogvideox_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """CogVideoX: latents [B, F, C, H/8, W/8] (frames before channels), F = (frames - 1) // 4 + 1.

    Text length defaults to `max_text_seq_length` (the pipeline pads T5 to it); with sincos positions (2b) any
    other length fails. Rotary variants (5b, 1.5) get `image_rotary_emb` as the pipeline builds it; a 1.5 model
    (patch_size_t) needs F divisible by patch_size_t. Integer (DDIM-style) timestep in [0, 1000).
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    f = (bucket.frames - 1) // cfg.temporal_compression_ratio + 1 if bucket.frames else 1
    t = text_len or cfg.max_text_seq_length
    if not cfg.use_rotary_positional_embeddings and t != cfg.max_text_seq_length:
        raise ValueError(
            f"CogVideoX with sincos positions needs text_len == max_text_seq_length ({cfg.max_text_seq_length}), got {t}"
        )
    b = bucket.batch
    inputs = {
        "hidden_states": torch.randn(b, f, cfg.in_channels, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.text_embed_dim, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 500, dtype=torch.long).to(device),
        "return_dict": False,
    }
    if cfg.use_rotary_positional_embeddings:
        from diffusers.models.embeddings import get_3d_rotary_pos_embed
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

        p, p_t = cfg.patch_size, cfg.patch_size_t
        gh, gw = h // p, w // p
        base_h, base_w = cfg.sample_height // p, cfg.sample_width // p
        if p_t is None:
            cos, sin = get_3d_rotary_pos_embed(
                embed_dim=cfg.attention_head_dim,
                crops_coords=get_resize_crop_region_for_grid((gh, gw), base_w, base_h),
                grid_size=(gh, gw),
                temporal_size=f,
            )
        else:
            cos, sin = get_3d_rotary_pos_embed(
                embed_dim=cfg.attention_head_dim,
                crops_coords=None,
                grid_size=(gh, gw),
                temporal_size=(f + p_t - 1) // p_t,
                grid_type="slice",
                max_size=(base_h, base_w),
            )
        inputs["image_rotary_emb"] = (cos.to(device), sin.to(device))
    if cfg.ofs_embed_dim:
        inputs["ofs"] = torch.full((b,), 2.0).to(device, dtype)
    return inputs


# ---------------------------------------------------------------------------------------------------------------
# HunyuanVideo (video; token refiner, double-stream then single-stream blocks, 3D RoPE)

HUNYUAN_VIDEO_TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=2,
    patch_size=2,
    patch_size_t=1,
    text_embed_dim=32,
    pooled_projection_dim=16,
    rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim
    guidance_embeds=True,
)


def hunyuan_video_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """HunyuanVideo: latents [B, C, F, H/8, W/8], F = (frames - 1) // 4 + 1; Llama states + mask, pooled CLIP;
    flow-matching timestep in [0, 1000); guidance (distilled models) = 6.0 * 1000 as the pipeline passes it."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    f = (bucket.frames - 1) // 4 + 1 if bucket.frames else 1
    t = text_len or 8
    b = bucket.batch
    inputs = {
        "hidden_states": torch.randn(b, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 500.0).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.text_embed_dim, generator=g).to(device, dtype),
        "encoder_attention_mask": torch.ones(b, t).to(device, dtype),  # the pipeline casts it to the model dtype
        "pooled_projections": torch.randn(b, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        "return_dict": False,
    }
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((b,), 6000.0).to(device, dtype)
    return inputs


# ---------------------------------------------------------------------------------------------------------------
# Stable Audio (1D latent sequence, GQA cross-attention, partial 1D RoPE)

STABLE_AUDIO_TINY = dict(
    sample_size=32,
    in_channels=8,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    num_key_value_attention_heads=1,
    out_channels=8,
    cross_attention_dim=32,
    time_proj_dim=32,
    global_states_input_dim=32,
    cross_attention_input_dim=16,
)


def stable_audio_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Stable Audio: latents [B, C, L] with L = bucket.width // 8 (bucket.height is ignored; "64x256" -> L = 32;
    the real model runs L = sample_size = 1024). One global token (seconds start/end) is prepended, so the RoPE
    table (attention_head_dim // 2 rotated dims, as the pipeline builds it, kept fp32) covers L + 1 positions.
    Timestep: a float noise level (0.5)."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    length = bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    cos, sin = get_1d_rotary_pos_embed(cfg.attention_head_dim // 2, length + 1, use_real=True, repeat_interleave_real=False)
    return {
        "hidden_states": torch.randn(b, cfg.in_channels, length, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 0.5).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.cross_attention_input_dim, generator=g).to(device, dtype),
        "global_hidden_states": torch.randn(b, 1, cfg.global_states_input_dim, generator=g).to(device, dtype),
        "rotary_embedding": (cos.to(device), sin.to(device)),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# Lumina2 (single stream over [caption, image] after context/noise refiners; 3-axis RoPE)

LUMINA2_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=2,
    num_attention_heads=2,  # head_dim = hidden_size / heads = 16
    num_kv_heads=1,
    multiple_of=16,
    axes_dim_rope=(4, 6, 6),  # sums to the head dim
    cap_feat_dim=16,
)


def lumina2_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Lumina-Image-2.0: latents [B, C, H/8, W/8], Gemma states + mask; timestep in [0, 1] (1 - t/1000)."""
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    return {
        "hidden_states": torch.randn(b, model.config.in_channels, h, w, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 0.5).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, model.config.cap_feat_dim, generator=g).to(device, dtype),
        "encoder_attention_mask": torch.ones(b, t, dtype=torch.long).to(device),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# AuraFlow (MMDiT joint blocks, then single blocks; 8 register tokens)

AURAFLOW_TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_mmdit_layers=2,
    num_single_dit_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=32,  # must equal num_attention_heads * attention_head_dim
    out_channels=4,
    pos_embed_max_size=256,  # a square: a 16x16 grid of patch positions
)


def auraflow_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """AuraFlow: latents [B, C, H/8, W/8], T5 (Pile) states; timestep in [0, 1] (the model scales it by 1000)."""
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    return {
        "hidden_states": torch.randn(b, model.config.in_channels, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, model.config.joint_attention_dim, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 0.5).to(device, dtype),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# Mochi (video; joint text+video attention, RMSNorm-zero modulation, per-sample masked SDPA loop)

MOCHI_TINY = dict(
    patch_size=2,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,  # the last block is context_pre_only
    pooled_projection_dim=16,  # the text stream's width inside the blocks
    in_channels=4,
    text_embed_dim=32,  # divisible by the pooler's 8 heads
    time_embed_dim=32,
)


def mochi_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Mochi: latents [B, C, F, H/8, W/8], F = (frames - 1) // 6 + 1; T5 states + mask; timestep in [0, 1000)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    f = (bucket.frames - 1) // 6 + 1 if bucket.frames else 1
    t = text_len or 8
    b = bucket.batch
    return {
        "hidden_states": torch.randn(b, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.text_embed_dim, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 500.0).to(device, dtype),
        "encoder_attention_mask": torch.ones(b, t, dtype=torch.long).to(device),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# Cosmos 1.0 (video; self-attn with RoPE + cross-attn, LayerNorm AdaLN-zero with LoRA modulation)

COSMOS_TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=24,  # RoPE splits the head dim into t/h/w parts (dim_h = dim_w = hd // 6 * 2)
    num_layers=2,
    text_embed_dim=32,
    adaln_lora_dim=8,
    max_size=(16, 32, 32),
    patch_size=(1, 2, 2),
    concat_padding_mask=False,  # True needs torchvision (not installed here); real checkpoints use True
)


def cosmos_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Cosmos text2world: latents [B, C, F, H/8, W/8], F = (frames - 1) // 8 + 1; T5 states; timestep [B]; fps 30."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    f = (bucket.frames - 1) // 8 + 1 if bucket.frames else 1
    t = text_len or 8
    b = bucket.batch
    inputs = {
        "hidden_states": torch.randn(b, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 0.5).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.text_embed_dim, generator=g).to(device, dtype),
        "fps": 30,
        "return_dict": False,
    }
    if cfg.concat_padding_mask:
        inputs["padding_mask"] = torch.zeros(1, 1, h, w).to(device, dtype)
    return inputs


# ---------------------------------------------------------------------------------------------------------------
# CogView4 (single stream over [text, image], LayerNorm QK-norm, AdaLN-zero, RoPE on the image part)

COGVIEW4_TINY = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    text_embed_dim=32,
    time_embed_dim=32,
    condition_dim=16,
    pos_embed_max_size=16,
    sample_size=8,
    rope_axes_dim=(16, 16),
)


def cogview4_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """CogView4: latents [B, C, H/8, W/8]; GLM states; timestep in [0, 1000); SDXL-style size conditions."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    size = torch.tensor([[bucket.height, bucket.width]] * b, dtype=dtype, device=device)
    return {
        "hidden_states": torch.randn(b, cfg.in_channels, h, w, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.text_embed_dim, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 500.0).to(device, dtype),
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": torch.zeros(b, 2, dtype=dtype, device=device),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# HunyuanDiT (U-ViT-like long skips, self + cross attention with LayerNorm QK-norm, shift-only AdaLN, 2D RoPE)

HUNYUAN_DIT_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    patch_size=2,
    sample_size=8,
    hidden_size=32,  # = heads * head_dim
    num_layers=6,  # even (skips pushed = popped): blocks 0-3 plain, 4-5 with a long skip (skip=layer > num_layers // 2)
    cross_attention_dim=32,  # BERT dim
    cross_attention_dim_t5=32,  # divisible by the pooler's 8 heads
    pooled_projection_dim=16,
    text_len=8,  # the BERT and T5 lengths must equal these (learned padding / pooler positions)
    text_len_t5=8,
)


def hunyuan_dit_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """HunyuanDiT: latents [B, C, H/8, W/8]; BERT + T5 states + masks (lengths fixed by the config); image meta
    size [B, 6]; style [B]; 2D RoPE as the pipeline builds it; float timestep (its dtype sets the embedding's)."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    b = bucket.batch
    t, t5 = cfg.text_len, cfg.text_len_t5
    gh, gw = h // cfg.patch_size, w // cfg.patch_size
    base = 512 // 8 // cfg.patch_size
    rope = get_2d_rotary_pos_embed(
        model.inner_dim // model.num_heads, get_resize_crop_region_for_grid((gh, gw), base), (gh, gw), output_type="pt"
    )
    meta = torch.tensor([[bucket.height, bucket.width, bucket.height, bucket.width, 0, 0]] * b)
    return {
        "hidden_states": torch.randn(b, cfg.in_channels, h, w, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 500.0).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.cross_attention_dim, generator=g).to(device, dtype),
        "text_embedding_mask": torch.ones(b, t, dtype=torch.long).to(device),
        "encoder_hidden_states_t5": torch.randn(b, t5, cfg.cross_attention_dim_t5, generator=g).to(device, dtype),
        "text_embedding_mask_t5": torch.ones(b, t5, dtype=torch.long).to(device),
        "image_meta_size": meta.to(device, dtype),
        "style": torch.zeros(b, dtype=torch.long).to(device),
        "image_rotary_emb": tuple(x.to(device) for x in rope),
        "return_dict": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# FLUX.2 (double + single stream, shared modulation, 4-axis RoPE, SwiGLU, fused qkv+mlp single blocks)

FLUX2_TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
    guidance_embeds=True,
)


def flux2_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """FLUX.2: packed 2x2 latent patches of the 8x VAE ([B, H/16 * W/16, C]); 4-axis ids (t, h, w, l);
    timestep and guidance as the pipeline passes them (t / 1000, guidance 4.0)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 16, bucket.width // 16
    t = text_len or 8
    b = bucket.batch
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(t))
    inputs = {
        "hidden_states": torch.randn(b, h * w, cfg.in_channels, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(b, t, cfg.joint_attention_dim, generator=g).to(device, dtype),
        "timestep": torch.full((b,), 0.5).to(device, dtype),
        "img_ids": img_ids.unsqueeze(0).expand(b, -1, -1).to(device),
        "txt_ids": txt_ids.unsqueeze(0).expand(b, -1, -1).to(device),
        "return_dict": False,
    }
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((b,), 4.0).to(device, dtype)
    return inputs


# ---------------------------------------------------------------------------------------------------------------
# Z-Image (single stream after noise/context refiners, like Lumina2)

ZIMAGE_TINY = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=32,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=16,
    axes_dims=[4, 6, 6],  # sums to dim / n_heads
    axes_lens=[64, 32, 32],
)


def zimage_inputs(model, bucket, *, dtype, device, text_len=None, seed=0):
    """Z-Image: a list of per-sample latents [C, 1, H/8, W/8]; a list of per-sample caption features [T, D];
    timestep in [0, 1] (1 - t/1000)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    h, w = bucket.height // 8, bucket.width // 8
    t = text_len or 8
    b = bucket.batch
    return {
        "x": [torch.randn(cfg.in_channels, 1, h, w, generator=g).to(device, dtype) for _ in range(b)],
        "t": torch.full((b,), 0.5).to(device, dtype),
        "cap_feats": [torch.randn(t, cfg.cap_feat_dim, generator=g).to(device, dtype) for _ in range(b)],
        "return_dict": False,
    }


# (class, tiny config, example-input function, a small bucket)
ZOO = {
    "sd3": ("diffusers:SD3Transformer2DModel", SD3_TINY, "dit_zoo:sd3_inputs", "64x64"),
    "pixart": ("diffusers:PixArtTransformer2DModel", PIXART_TINY, "dit_zoo:pixart_inputs", "64x64"),
    "sana": ("diffusers:SanaTransformer2DModel", SANA_TINY, "dit_zoo:sana_inputs", "64x64"),
    "cogvideox": ("diffusers:CogVideoXTransformer3DModel", COGVIDEOX_TINY, "dit_zoo:cogvideox_inputs", "64x64x9"),
    "hunyuan-video": (
        "diffusers:HunyuanVideoTransformer3DModel",
        HUNYUAN_VIDEO_TINY,
        "dit_zoo:hunyuan_video_inputs",
        "64x64x9",
    ),
    "stable-audio": ("diffusers:StableAudioDiTModel", STABLE_AUDIO_TINY, "dit_zoo:stable_audio_inputs", "64x256"),
    "lumina2": ("diffusers:Lumina2Transformer2DModel", LUMINA2_TINY, "dit_zoo:lumina2_inputs", "64x64"),
    "auraflow": ("diffusers:AuraFlowTransformer2DModel", AURAFLOW_TINY, "dit_zoo:auraflow_inputs", "64x64"),
    "mochi": ("diffusers:MochiTransformer3DModel", MOCHI_TINY, "dit_zoo:mochi_inputs", "64x64x7"),
    "cosmos": ("diffusers:CosmosTransformer3DModel", COSMOS_TINY, "dit_zoo:cosmos_inputs", "64x64x9"),
    "cogview4": ("diffusers:CogView4Transformer2DModel", COGVIEW4_TINY, "dit_zoo:cogview4_inputs", "64x64"),
    "hunyuan-dit": ("diffusers:HunyuanDiT2DModel", HUNYUAN_DIT_TINY, "dit_zoo:hunyuan_dit_inputs", "64x64"),
    "flux2": ("diffusers:Flux2Transformer2DModel", FLUX2_TINY, "dit_zoo:flux2_inputs", "64x64"),
    "zimage": ("diffusers:ZImageTransformer2DModel", ZIMAGE_TINY, "dit_zoo:zimage_inputs", "64x64"),
}
