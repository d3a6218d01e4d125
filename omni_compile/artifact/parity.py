"""What an artifact's output is checked against: eager on the same weights and inputs, within a bound per
dtype. Used by the build before it publishes and by `verify`."""

from __future__ import annotations

import torch

# Relative L2 of a bucket's compiled output against eager (same weights, same inputs) that an artifact must meet.
PARITY_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `got` against `ref`, in float64 (the parity checks' and lossy costs' measure)."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def bucket_output(output) -> torch.Tensor:
    """The sample of a transformer forward's output (a tuple or a diffusers output object), as one tensor: a sample
    that is a list of tensors (one per image, as ZImageTransformer2DModel returns) is their values flattened and
    concatenated, which is what the parity checks compare."""
    sample = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
    if isinstance(sample, (tuple, list)):
        if not sample or not all(isinstance(t, torch.Tensor) for t in sample):
            kinds = sorted({type(t).__name__ for t in sample}) or ["nothing"]
            raise TypeError(f"the model's output sample is a {type(sample).__name__} of {', '.join(kinds)}; "
                            "omni-compile compares a tensor or a list of tensors")  # fmt: skip
        return torch.cat([t.reshape(-1) for t in sample])
    return sample
