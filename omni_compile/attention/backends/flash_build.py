"""A FlashAttention build behind an attention backend: the modules that provide it, the GPU generations
it serves, what it takes, what to install. `flash_backend(build)` makes the backend of a build and its
custom op; each build's file (`fa3.py`, `fa4.py`, `fa2.py`) declares one and registers it.

The op, `omni_compile::attention_<op_name>` (`attention_fa3`, `attention_fa4`, `attention_fa2`), takes
[B, S, H, D] q/k/v (FlashAttention's own layout, the one diffusers' projections write) and returns
[B, S_q, H, D_v], contiguous. Inductor calls it as an external kernel, inside compiled regions in the JIT
path and in the standalone files of CUDA artifacts. A build that can stop each batch row's keys at a
length (FA3's `seqused_k`) also gets `omni_compile::attention_<op_name>_seqused(q, k, v, seqused_k, scale)`,
and so takes key-padding masks: the attention pass moves each row's kept keys to the front
(`base.keys_first`, in the graph) and passes their count. The ops are defined when the backend registers (any
import of `omni_compile.attention` does it, the artifact loader's included), and the FlashAttention
package is imported on the first call only, so a file that calls the op loads anywhere and a missing
package is an error that names it (the loader checks first, `artifact.loader`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_compile.attention.backends import base
from omni_compile.attention.backends.base import HALF, AttentionBackend, AttentionCall, dtype_name
from omni_compile.errors import OmniCompileError
from omni_compile.platform import Platform

# backend name -> its build, filled as the build files register
FLASH_BUILDS: dict[str, FlashBuild] = {}


@dataclass(frozen=True)
class FlashBuild:
    """A FlashAttention build behind one backend: the modules that provide it (the first importable one
    is used), the GPU generations it serves, and what to install."""

    backend: str  # "FA3_ATTN"
    op_name: str  # the custom op: omni_compile::attention_<op_name>
    label: str
    description: str  # the backend's line in `omni-compile attention`
    modules: tuple[str, ...]
    majors: tuple[int, ...]  # compute-capability majors it serves
    install: str
    # module -> dtypes that module's kernels take (a build compiled without fp16, say); default HALF
    dtypes: tuple[tuple[str, tuple[torch.dtype, ...]], ...] = ()
    # head sizes per compute-capability major where they differ from "multiples of 8 from 8 to 256":
    # major -> (predicate, the rule in words)
    head_dims: tuple[tuple[int, Callable[[int], bool], str], ...] = ()
    # module -> fn(module) -> forward(q, k, v, scale); default: the module's flash_attn_func
    forwards: tuple[tuple[str, Callable], ...] = ()
    # module -> fn(module) -> forward(q, k, v, seqused_k, scale): only the first seqused_k[b] keys of row b
    # are attended to. Empty: the build takes no mask.
    seqused_forwards: tuple[tuple[str, Callable], ...] = ()
    extra_module_check: Callable[[str], bool] = lambda name: True

    def module(self) -> str | None:
        """The first of `modules` that can be imported here, or None."""
        for name in self.modules:
            if base.has_module(name) and self.extra_module_check(name):
                return name
        return None

    def module_dtypes(self, module: str | None) -> tuple[torch.dtype, ...]:
        return dict(self.dtypes).get(module, HALF)

    def forward(self, module_name: str, module) -> Callable:
        """fn(q, k, v, scale) -> out for `module` (the imported build)."""
        make = dict(self.forwards).get(module_name)
        if make is not None:
            return make(module)
        func = module.flash_attn_func

        def call(q, k, v, scale):
            out = func(q, k, v, softmax_scale=scale, causal=False)
            return out[0] if isinstance(out, tuple) else out

        return call

    def seqused_forward(self, module_name: str, module) -> Callable:
        """fn(q, k, v, seqused_k, scale) -> out for `module`; raises where that build has none."""
        make = dict(self.seqused_forwards).get(module_name)
        if make is None:
            raise OmniCompileError(f"{self.label} from {module_name} cannot limit the keys per row (seqused_k)")
        return make(module)


def installed_flash_modules() -> dict[str, str | None]:
    """Backend -> the module of its FlashAttention build importable here (None: not installed); a cache
    factor, since it changes what `auto` picks."""
    return {name: build.module() for name, build in FLASH_BUILDS.items()}


def _available(build: FlashBuild) -> Callable[[Platform], str | None]:
    def check(platform: Platform) -> str | None:
        major = platform.capability[0] if platform.capability else None
        if major not in build.majors:
            serves = " and ".join(f"sm{m}x" if m != 9 else "sm90" for m in build.majors)
            return f"{build.label} serves {serves} GPUs, not {platform.arch} ({platform.device_name})"
        if build.module() is None:
            broken = [m for m in build.modules if base.found(m) and base.import_error(m) is not None]
            if broken:
                return f"{build.label} is installed but does not import here ({base.import_error(broken[0])}); {build.install}"
            return f"{build.label} is not installed ({build.install})"
        return None

    return check


def _call(build: FlashBuild) -> Callable[[Platform, AttentionCall], str | None]:
    def check(platform: Platform, call: AttentionCall) -> str | None:
        module = build.module()
        dtypes = build.module_dtypes(module)
        if call.dtype is not None and call.dtype not in dtypes:
            names = " or ".join(dtype_name(d) for d in dtypes)
            return f"dtype {dtype_name(call.dtype)} is unsupported ({module or build.label} takes {names})"
        d = call.head_dim
        if d is None:
            return None
        major = platform.capability[0] if platform.capability else None
        ok, rule = (d % 8 == 0 and 8 <= d <= 256), "multiples of 8 from 8 to 256"
        for m, predicate, words in build.head_dims:
            if major is not None and major >= m:
                ok, rule = predicate(d), words
        return None if ok else f"head_size={d} is unsupported ({build.label} takes head sizes {rule})"

    return check


def _installed(backend: str):
    build = FLASH_BUILDS[backend]
    name = build.module()
    if name is None:
        raise OmniCompileError(
            f"{backend} was compiled into this graph but {build.label} cannot be imported here ({build.install})"
        )
    return build, name, importlib.import_module(name)


@functools.cache
def forward(backend: str):
    """fn(q, k, v, scale) -> out for one backend's installed build (imported on first use)."""
    build, name, module = _installed(backend)
    return build.forward(name, module)


@functools.cache
def seqused_forward(backend: str):
    """fn(q, k, v, seqused_k, scale) -> out for one backend's installed build (imported on first use)."""
    build, name, module = _installed(backend)
    return build.seqused_forward(name, module)


def _define_op(build: FlashBuild):
    backend = build.backend

    @torch.library.custom_op(f"omni_compile::attention_{build.op_name}", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = forward(backend)(q, k, v, scale)
        return out if out.is_contiguous() else out.contiguous()

    @op.register_fake
    def _(q, k, v, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    if not build.seqused_forwards:
        return op, None

    @torch.library.custom_op(f"omni_compile::attention_{build.op_name}_seqused", mutates_args=())
    def seqused_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor,
                   scale: float) -> torch.Tensor:  # fmt: skip
        out = seqused_forward(backend)(q, k, v, seqused_k, scale)
        return out if out.is_contiguous() else out.contiguous()

    @seqused_op.register_fake
    def _(q, k, v, seqused_k, scale):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    return op, seqused_op


def flash_backend(build: FlashBuild, priority: dict[str, int]) -> AttentionBackend:
    """The attention backend of a FlashAttention build, with its custom op (registered by the build's file)."""
    FLASH_BUILDS[build.backend] = build
    op, seqused_op = _define_op(build)
    return AttentionBackend(
        name=build.backend,
        description=build.description,
        platforms=("cuda",),
        priority=priority,
        dtypes=HALF,
        layout="bshd",
        min_capability=(8, 0),
        available=_available(build),
        head_dim=_call(build),
        form="op",
        load=lambda: op,
        masks=("key_padding",) if seqused_op is not None else (),
        load_seqused=(lambda: seqused_op) if seqused_op is not None else None,
    )


def spec_is_package(name: str) -> bool:
    """`name` is a regular package with an __init__.py (flash-attn's FA2), not a namespace package (the FA4
    wheel installs flash_attn.cute under a flash_attn namespace with no FA2 in it)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None and spec.origin.endswith("__init__.py")
