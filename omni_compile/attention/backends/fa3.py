"""FA3_ATTN: FlashAttention-3's forward on Hopper (sm90), from the fa3-fwd wheel (module
`fa3_fwd_interface`, bf16 only) or FA3's own hopper build (`flash_attn_interface`). It goes through the
build's `_flash_attn_forward` (what `flash_attn_func` calls under its autograd function) with no causal
mask and no window. Key-padding masks go through its `seqused_k` (the keys each batch row attends to are
its first seqused_k[b]; the attention pass puts the kept keys first), as its KV-cache path uses it."""

import torch

from omni_compile.attention.backends.flash_build import FlashBuild, flash_backend
from omni_compile.ops.registry import register


def _forward(module):
    fwd = module._flash_attn_forward

    def fa3(q, k, v, scale):
        return fwd(q, k, v, softmax_scale=scale, causal=False)[0]

    return fa3


def _seqused_forward(module):
    fwd = module._flash_attn_forward

    def fa3_seqused(q, k, v, seqused_k, scale):
        return fwd(q, k, v, seqused_k=seqused_k, softmax_scale=scale, causal=False)[0]

    return fa3_seqused


BUILD = FlashBuild(
    backend="FA3_ATTN",
    op_name="fa3",
    label="FlashAttention-3",
    description="FlashAttention-3's forward (the fa3-fwd wheel, or FA3's own hopper build)",
    modules=("fa3_fwd_interface", "flash_attn_interface"),
    majors=(9,),
    install="pip install 'omni-compile[fa3]' (the fa3-fwd wheel: FlashAttention-3's forward)",
    dtypes=(("fa3_fwd_interface", (torch.bfloat16,)),),  # fa3-fwd is built without fp16 kernels
    forwards=(("fa3_fwd_interface", _forward), ("flash_attn_interface", _forward)),
    seqused_forwards=(("fa3_fwd_interface", _seqused_forward), ("flash_attn_interface", _seqused_forward)),
)

BACKEND = register(flash_backend(BUILD, priority={"cuda": 40}))
