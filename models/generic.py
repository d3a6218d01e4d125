"""The generic adapter: any diffusers transformer omni-compile has no adapter for.

Its regions are the classes it declares in `_repeated_blocks`, or else the classes of its lists of
identical blocks (`graphs.regions.discover_block_classes`), or those named with `--regions`.

omni-compile knows nothing else about such a model, so its example inputs for a shape bucket come
from the user: a function `fn(model, bucket, *, dtype, device, text_len, seed) -> dict of forward kwargs`,
named on the command line as `--example-inputs module:function`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from omni_compile.errors import ConfigError
from omni_compile.models.base import ModelAdapter


class GenericAdapter(ModelAdapter):
    family = "generic"
    default_text_len = None  # the example-input function picks its own text length

    def __init__(self, cls: type[nn.Module], inputs_fn: Callable | None = None):
        self.cls = cls
        self.inputs_fn = inputs_fn

    def model_class(self):
        return self.cls

    def check_bucket(self, bucket) -> None:
        # Called before the model loads, so a build without an inputs function fails at once.
        if self.inputs_fn is None:
            raise ConfigError(
                f"omni-compile has no adapter for {self.cls.__name__}, so it cannot invent its inputs: pass "
                "--example-inputs module:function (fn(model, bucket, *, dtype, device, text_len, seed) -> kwargs)"
            )

    def example_inputs(self, model, bucket, *, dtype, device, text_len=None, seed=0):
        self.check_bucket(bucket)
        return self.inputs_fn(model, bucket, dtype=dtype, device=device, text_len=text_len, seed=seed)
