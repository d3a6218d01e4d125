"""Text-to-image: diffusers' `FluxPipeline` around a FLUX artifact, answering POST /v1/images/generations."""

from __future__ import annotations

import io

import torch

from omni_compile.server.pipeline import ServedPipeline


class ImagePipeline(ServedPipeline):
    """FLUX text-to-image: prompts checked against CLIP (77 tokens) and T5 (the artifact's text length); PNG out."""

    task = "text-to-image"
    pipeline_class = "FluxPipeline"
    default_guidance = 3.5  # FLUX.1-dev's embedded guidance

    def token_limits(self):
        return [("tokenizer", "CLIP", self.pipe.tokenizer.model_max_length), ("tokenizer_2", "T5", self.text_len)]

    def generate(self, prompts, generators, height, width, steps, guidance, frames, callback) -> list[bytes]:
        out = self.pipe(prompt=prompts, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                        max_sequence_length=self.text_len, generator=generators, output_type="pil",
                        callback_on_step_end=callback)  # fmt: skip
        pngs = []
        for img in out.images:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            pngs.append(buf.getvalue())
        return pngs

    @classmethod
    def random_pipeline(cls, preset, transformer, *, text_len, dtype: torch.dtype, device, seed):
        from omni_compile.models.flux_pipeline import random_pipeline

        return random_pipeline(preset, transformer, dtype=dtype, device=device, seed=seed)

    @classmethod
    def match_build_call(cls, transformer) -> None:
        from omni_compile.models.flux_pipeline import match_build_call

        match_build_call(transformer)
