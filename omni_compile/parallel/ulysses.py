"""Ulysses attention: `omni_compile::ulysses_attention(q, k, v, scale, backend)` on [B, S, H, D] tensors.

Each of the N ranks of the sequence-parallel group holds S/N tokens of every head. An all-to-all gives each rank
all S tokens of H/N heads; the attention backend the pass chose runs there, exactly as in one process; a second
all-to-all gives each rank its own S/N tokens of all H heads back. Attention treats every head apart, and the
gathered sequence keeps q's and k's tokens in the same order, so the result equals one process's attention over
the whole sequence (the order of keys does not matter to softmax). Keys and values that every rank holds whole
(a cross-attention to text that the plan does not split) go through the same exchange: each rank then attends
to N copies of the same keys, which gives the same softmax.

The op is opaque to Inductor (a custom op with a fake implementation of q's shape), so the compiled region does
not depend on N; without a sequence-parallel group (one process) it is the backend's attention.
"""

from __future__ import annotations

import functools

import torch

from omni_compile.parallel import sp_group


@functools.cache
def _runner(backend: str):
    from omni_compile.attention.backends import BACKENDS

    return BACKENDS[backend].runner()


def heads_to_tokens(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """[B, s, H, D] (this rank's tokens, every head) -> [B, n*s, H/n, D] (every rank's tokens, this rank's heads)."""
    import torch.distributed as dist

    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 1, 0, 3, 4).contiguous()  # [n, s, B, H/n, D]: part j to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's tokens of this rank's heads
    return recv.reshape(n * s, b, h // n, d).permute(1, 0, 2, 3)


def tokens_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """The inverse of `heads_to_tokens`: [B, n*s, H/n, D] -> [B, s, H, D]."""
    import torch.distributed as dist

    b, total, hl, d = x.shape
    s = total // n
    send = x.reshape(b, n, s, hl, d).permute(1, 2, 0, 3, 4).contiguous()  # [n, s, B, H/n, D]: rank j's tokens to j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: this rank's tokens of rank i's heads
    return recv.permute(2, 1, 0, 3, 4).reshape(b, s, n * hl, d).contiguous()


@torch.library.custom_op("omni_compile::ulysses_attention", mutates_args=())
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    from omni_compile.counters import counters

    run = _runner(backend)
    group = sp_group()
    counters.ulysses_calls += 1
    if group is None:
        return run(q, k, v, scale).contiguous()
    import torch.distributed as dist

    counters.ulysses_exchanges += 1
    n = dist.get_world_size(group)
    out = run(*(heads_to_tokens(t, group, n) for t in (q, k, v)), scale)
    return tokens_to_heads(out, group, n)


@ulysses_attention.register_fake
def _(q, k, v, scale, backend):
    return q.new_empty(q.shape)
