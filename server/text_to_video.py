"""Text-to-video: diffusers' `WanPipeline` around a Wan artifact, behind the video jobs of /v1/videos (`videos.py`).

A video is `frames` frames at HEIGHTxWIDTH, one of the artifact's buckets HxWxF; it is encoded as H.264 in an
MP4 container by PyAV (`encode_mp4`), `fps` frames a second (Wan 2.1: 16, so 81 frames play 5 s).
"""

from __future__ import annotations

import io

import numpy as np
import torch

from omni_compile.server.pipeline import ServedPipeline


class VideoPipeline(ServedPipeline):
    """Wan text-to-video: prompts checked against the UMT5 tokenizer (the artifact's text length); MP4 out."""

    task = "text-to-video"
    pipeline_class = "WanPipeline"
    default_guidance = 5.0  # Wan2.1-T2V's classifier-free guidance (above 1: two transformer calls a step)
    fps: int = 16

    def configure(self, config) -> None:
        self.fps = config.video_fps

    def token_limits(self):
        return [("tokenizer", "UMT5", self.text_len)]

    def duration(self, frames: int) -> float:
        """How long `frames` frames play: (frames - 1) / fps, as Wan counts (81 frames at 16 fps: 5 s)."""
        return (frames - 1) / self.fps

    def generate(self, prompts, generators, height, width, steps, guidance, frames, callback) -> list[bytes]:
        assert frames is not None, "a video job always says its frames"
        out = self.pipe(prompt=prompts, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                        guidance_scale=guidance, max_sequence_length=self.text_len, generator=generators,
                        output_type="np", callback_on_step_end=callback)  # fmt: skip
        videos = np.asarray(out.frames)  # (batch, frames, height, width, 3), floats in [0, 1]
        return [encode_mp4(to_uint8(v), self.fps) for v in videos]

    @classmethod
    def random_pipeline(cls, preset, transformer, *, text_len, dtype: torch.dtype, device, seed):
        from omni_compile.models.wan_pipeline import random_pipeline

        return random_pipeline(preset, transformer, text_len=text_len, dtype=dtype, device=device, seed=seed)

    @classmethod
    def match_build_call(cls, transformer) -> None:
        from omni_compile.models.wan_pipeline import match_build_call

        match_build_call(transformer)


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Floats in [0, 1] as 8-bit RGB, rounded."""
    return (np.clip(frames, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def encode_mp4(frames: np.ndarray, fps: int, crf: int = 18) -> bytes:
    """(frames, height, width, 3) uint8 RGB as an H.264 MP4 (yuv420p, so that every player takes it; height and
    width must be even, which Wan's multiples of 16 are)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return buf.getvalue()
