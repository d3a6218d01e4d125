"""What an artifact's output is checked against: eager on the same weights and inputs, within a bound per
dtype. Used by the build before it publishes and by `verify`."""

from __future__ import annotations

import torch

# Relative L2 of a bucket's compiled output against eager (same weights, same inputs) that an artifact must meet.
PARITY_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `got` against `ref`, in float64 (the parity checks' and lossy costs' measure)."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def bucket_output(output):
    """The sample of a transformer forward's output (a tuple or a diffusers output object)."""
    return output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
