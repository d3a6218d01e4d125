"""Multi-process inference: Ulysses sequence parallelism over torch.distributed (docs/parallel.md).

A model compiled with `omni_compile.compile(model, parallel=ParallelConfig(ulysses=N))` runs one request on N
processes (ranks, one GPU each; gloo processes on a CPU). Each rank holds the whole model and a 1/N share of the
tokens:

- the model's inputs are split along the sequence and its output gathered by the model's context-parallel plan
  (diffusers' `_cp_plan`, applied with diffusers' own hooks, outside the compiled regions);
- every attention call of a region becomes `omni_compile::ulysses_attention` (`parallel/ulysses.py`): an
  all-to-all turns the rank's tokens of all heads into all tokens of its 1/N of the heads, the chosen attention
  backend runs, and a second all-to-all turns it back. The op is opaque to Inductor and its output has the shape
  of its query, so a rank's compiled region is the region of a single process at the rank's token count: no
  collective inside generated code, and no compile more than one process would make.

`init_parallel` starts the process group (from torchrun's environment) and makes the groups; everything else
reads them from here. (torch is imported only when a group starts: the CLI's help reads `ParallelConfig`.)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from omni_compile.errors import ConfigError

_ITEM_RE = re.compile(r"^\s*(ulysses|cfg)\s*=\s*(\d+)\s*$")


@dataclass(frozen=True)
class ParallelConfig:
    """How one request spreads over processes: `ulysses` ranks split its tokens (sequence parallelism); the world
    size is their product with `cfg` (classifier-free guidance branches on ranks of their own; only 1 for now)."""

    ulysses: int = 1
    cfg: int = 1

    def __post_init__(self):
        for name in ("ulysses", "cfg"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"parallel {name}={value!r}: a degree is a positive integer")
        if self.cfg != 1:
            raise ConfigError(f"parallel cfg={self.cfg}: CFG-parallel is not available yet; use ulysses=N alone")

    @property
    def world_size(self) -> int:
        return self.ulysses * self.cfg

    @classmethod
    def parse(cls, value: ParallelConfig | dict | str | None) -> ParallelConfig | None:
        """A ParallelConfig from itself, a dict ({"ulysses": 2}) or text ("ulysses=2"); None stays None."""
        if value is None or isinstance(value, ParallelConfig):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"ulysses", "cfg"})
            if unknown:
                raise ConfigError(f"unknown parallel key(s) {unknown}; valid keys are ['cfg', 'ulysses']")
            return cls(**value)
        items = {}
        for part in (p for p in str(value).split(",") if p.strip()):
            m = _ITEM_RE.match(part)
            if not m:
                raise ConfigError(f"malformed parallel setting {part.strip()!r} in {value!r}: expected ulysses=N")
            items[m.group(1)] = int(m.group(2))
        if not items:
            raise ConfigError(f"empty parallel setting {value!r}: expected ulysses=N")
        return cls(**items)

    def __str__(self) -> str:
        return ",".join(f"{k}={getattr(self, k)}" for k in ("ulysses", "cfg") if getattr(self, k) != 1) or "ulysses=1"


@dataclass
class ParallelState:
    config: ParallelConfig
    rank: int
    world_size: int
    sp_group: object  # the ProcessGroup of this rank's sequence-parallel ranks
    device_type: str
    mesh: object = None  # the DeviceMesh ("ring", "ulysses") of the sequence-parallel ranks


_STATE: ParallelState | None = None


def sp_group():
    """This rank's sequence-parallel process group, or None when there is none (or it has one rank)."""
    return _STATE.sp_group if _STATE is not None and _STATE.config.ulysses > 1 else None


def _backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_parallel(config: ParallelConfig, device_type: str = "cpu") -> ParallelState:
    """Start torch.distributed for `config` (once per process; an existing process group is used as it is) and make
    the sequence-parallel groups. The world size must be `config.world_size`: run under torchrun with as many
    processes (`torchrun --nproc-per-node N ...`)."""
    global _STATE
    import torch
    import torch.distributed as dist

    if _STATE is not None:
        if _STATE.config != config:
            raise ConfigError(f"this process already runs with parallel {_STATE.config}; {config} cannot be added "
                              "(one parallel setting per process)")  # fmt: skip
        return _STATE
    if not dist.is_available():
        raise ConfigError("parallel inference needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError(f"parallel {config} needs {config.world_size} processes started together: run under "
                              f"torchrun --nproc-per-node {config.world_size} (RANK and WORLD_SIZE are not set)")  # fmt: skip
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(_backend_for(device_type))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != config.world_size:
        raise ConfigError(f"parallel {config} needs a world of {config.world_size} processes; this one has {world} "
                          f"(start it with torchrun --nproc-per-node {config.world_size})")  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh

    # diffusers' context-parallel hooks read this mesh's layout (a ring dimension, unused here, and the ulysses one)
    mesh = init_device_mesh(device_type, (1, config.ulysses), mesh_dim_names=("ring", "ulysses"))
    group = mesh["ulysses"].get_group()
    _STATE = ParallelState(config=config, rank=rank, world_size=world, sp_group=group, device_type=device_type,
                           mesh=mesh)  # fmt: skip
    return _STATE
