"""Sequence parallelism (Ulysses) over torch.distributed: N gloo processes on the CPU, started by torchrun as a user
starts them (`-m omni_compile run --parallel ulysses=N`), against the model in one process; and the refusals."""

import json
import subprocess
import sys

import pytest
import torch
from omni_compile.models import resolve_model

import omni_compile
from omni_compile.config import ShapeBucket
from omni_compile.counters import counters
from omni_compile.errors import ConfigError, find_user_error
from omni_compile.parallel import ParallelConfig

# four heads of 8, so that 2 and 4 ranks can split them (the presets have 2)
FOUR_HEADS = {
    "flux-tiny": {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": [2, 2, 4]},
    "wan-tiny": {"num_attention_heads": 4, "attention_head_dim": 8},
}


def test_parallel_config_from_text_dict_and_errors():
    assert ParallelConfig.parse("ulysses=4") == ParallelConfig(ulysses=4) == ParallelConfig.parse({"ulysses": 4})
    assert ParallelConfig.parse(None) is None and str(ParallelConfig(ulysses=2)) == "ulysses=2"
    assert ParallelConfig(ulysses=2).world_size == 2
    with pytest.raises(ConfigError, match=r"malformed parallel setting 'ring=2' in 'ring=2': expected ulysses=N"):
        ParallelConfig.parse("ring=2")
    with pytest.raises(ConfigError, match=r"parallel ulysses=0: a degree is a positive integer"):
        ParallelConfig.parse("ulysses=0")
    with pytest.raises(ConfigError, match=r"unknown parallel key\(s\) \['tp'\]"):
        ParallelConfig.parse({"tp": 2})
    with pytest.raises(ConfigError, match=r"CFG-parallel is not available yet"):
        ParallelConfig.parse("ulysses=2,cfg=2")


def test_a_model_the_ranks_cannot_split_is_refused_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    model = resolve_model("flux-tiny").load(dtype=torch.float32, device="cpu", seed=0)  # 2 heads
    with pytest.raises(ConfigError) as e:
        omni_compile.compile(model, parallel="ulysses=4")
    assert str(e.value) == ("ulysses=4 splits the heads of each attention over 4 ranks, but FluxTransformer2DModel has "
                            "attention modules of 2 heads; choose a degree that divides every head count (1, 2)")  # fmt: skip
    from generic_model import MiniDiT

    with pytest.raises(ConfigError, match=r"^MiniDiT declares no context-parallel plan \(diffusers' _cp_plan"):
        omni_compile.compile(MiniDiT(), parallel="ulysses=2")
    # splittable, but not started by torchrun
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"needs 2 processes started together: run under torchrun --nproc-per-node 2"):
        omni_compile.compile(model, parallel="ulysses=2")
    assert not dist.is_initialized() and getattr(model, "_omni_compile", None) is None


def test_the_ulysses_op_is_registered_before_inductor_cache_hits_call_it(subprocess_env):
    """A region compiled for sequence parallelism whose code comes from Inductor's cache calls the op without the
    attention pass running (the reversed-order suite met that): making the pass registers it."""
    code = ("import torch; from omni_compile.passes.attention import AttentionPass; "
            "assert not hasattr(torch.ops.omni_compile, 'ulysses_attention'); AttentionPass(sequence_parallel=True); "
            "print(torch.ops.omni_compile.ulysses_attention.default)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0 and "omni_compile.ulysses_attention.default" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.compile
def test_sequence_parallel_regions_in_one_process_are_the_attention(fresh_dynamo):
    """Without a process group the Ulysses op is the backend's attention: every call of the region goes through it
    (Wan: self- and cross-attention of both blocks), at fp32 parity with eager."""
    spec = resolve_model("wan-tiny")
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x64x5"), dtype=torch.float32, device="cpu",
                                         text_len=8, seed=1)  # fmt: skip
    with torch.no_grad():
        ref = model(**inputs)[0]
        omni_compile.compile(model, omni_compile.CompileConfig(sequence_parallel=True))
        with counters.expect(ulysses_calls=4, ulysses_exchanges=0, regions_compiled=1):
            out = model(**inputs)[0]
    assert float((out - ref).norm() / ref.norm()) < 1e-5


class _MaskedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x, keep):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return x + a.transpose(1, 2).flatten(2)


class _MaskedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MaskedBlock() for _ in range(2))

    def forward(self, x, keep):
        for b in self.blocks:
            x = b(x, keep)
        return x


@pytest.mark.compile
def test_an_attention_call_that_cannot_be_split_stops_the_compile(fresh_dynamo):
    """A rank attending with a key-padding mask it holds a share of would be wrong: the compile stops, naming the
    call and what to do."""
    model = _MaskedModel()
    omni_compile.compile(model, omni_compile.CompileConfig(sequence_parallel=True))
    keep = torch.ones(1, 6, dtype=torch.bool)
    keep[:, 4:] = False
    with pytest.raises(Exception) as e, torch.no_grad():
        model(torch.randn(1, 6, 16), keep)
    err = find_user_error(e.value)
    assert isinstance(err, ConfigError), e.value
    assert str(err) == ("sequence parallelism cannot split the attention call of a block: it has an attention mask "
                        "(key-padding); run this model in one process (parallel ulysses=1)")  # fmt: skip


class _SoftCapAttention(torch.nn.Module):
    """An attention module (heads, a processor) that computes its scores its own way: soft-capped, no SDPA."""

    def __init__(self):
        super().__init__()
        self.heads, self.processor = 2, None
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        scores = torch.tanh(q @ k.transpose(-1, -2) / 30) * 30
        return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


class _SoftCapBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _SoftCapAttention()

    def forward(self, x):
        return x + self.attn(x)


@pytest.mark.compile
def test_an_attention_the_pass_cannot_see_stops_the_compile(fresh_dynamo):
    """Attention computed without SDPA reaches no Ulysses op: under sequence parallelism the region's compile
    counts the block's attention modules against the calls the pass split and stops."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(_SoftCapBlock() for _ in range(2))
    model.forward = lambda x: model.blocks[1](model.blocks[0](x))
    omni_compile.compile(model, omni_compile.CompileConfig(sequence_parallel=True))
    with pytest.raises(Exception) as e, torch.no_grad():
        model(torch.randn(1, 6, 16))
    err = find_user_error(e.value)
    assert isinstance(err, ConfigError), e.value
    assert str(err) == ("sequence parallelism: a _SoftCapBlock holds 1 attention module(s) but its graph has 0 "
                        "attention call(s) the attention pass could split; the others would attend to one rank's "
                        "tokens only. Run this model in one process (parallel ulysses=1)")  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("model,shape,regions,attention_calls", [("flux-tiny", "64x64", 2, 4), ("wan-tiny", "64x64x5", 1, 4)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_together_give_the_one_process_output(model, shape, regions, attention_calls, ranks, subprocess_env,
                                                    tmp_path):  # fmt: skip
    """`torchrun --nproc-per-node N -m omni_compile run MODEL --parallel ulysses=N` on N gloo processes: each rank
    compiles what one process would (one region per block class) for its 1/N of the tokens, every attention call
    exchanges tokens for heads with the other ranks, and the gathered output equals the eager model's over the
    whole sequence (computed in each rank's process before the split) within fp32 rounding."""
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
           "omni_compile", "run", model, "--shapes", shape, "--model-config", json.dumps(FOUR_HEADS[model]),
           "--parallel", f"ulysses={ranks}", "--steps", "1", "--warmup", "0", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["world_size"] == ranks and summary["parallel"] == f"ulysses={ranks}"
    assert summary["compiles_per_rank"] == [regions] * ranks
    # the first call and one timed step, each through every attention call of the model
    assert summary["ulysses_exchanges_per_rank"] == [2 * attention_calls] * ranks
    assert all(r < 1e-5 for r in summary["rel_l2_vs_eager"]), summary["rel_l2_vs_eager"]


def test_run_with_parallel_outside_torchrun_is_one_line(subprocess_env):
    env = {k: v for k, v in subprocess_env.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "omni_compile", "run", "flux-tiny", "--shapes", "64x64",
                           "--parallel", "ulysses=2"], env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        ("omni-compile: error: parallel ulysses=2 needs 2 processes started together: run under torchrun "
         "--nproc-per-node 2 (RANK and WORLD_SIZE are not set)")
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "FA3_ATTN"])
def test_sequence_parallel_regions_on_cuda(backend, fresh_dynamo):
    """On a GPU in one process, the Ulysses op runs the backend the pass chose for the call (FA3 where it is
    installed) at the level of the regions compiled without it, bf16."""
    from omni_compile.attention.backends import BACKENDS
    from omni_compile.platform import current_platform

    why = BACKENDS[backend].check(current_platform("cuda"), explicit=True)
    if why:
        pytest.skip(why)
    spec = resolve_model("flux-tiny")
    model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
    inputs = spec.adapter.example_inputs(model, ShapeBucket.parse("64x64"), dtype=torch.bfloat16, device="cuda",
                                         text_len=8, seed=1)  # fmt: skip
    config = {"default": {"backend": backend}}
    with torch.no_grad():
        ref = model(**inputs)[0].double()
        omni_compile.compile(model, omni_compile.CompileConfig(attention=config))
        plain = model(**inputs)[0].double()
        omni_compile.uncompile(model)
        torch._dynamo.reset()
        omni_compile.compile(model, omni_compile.CompileConfig(attention=config, sequence_parallel=True))
        with counters.expect(ulysses_calls=4, ulysses_exchanges=0):
            sp = model(**inputs)[0].double()
    rec = omni_compile.compile_state(model).records
    assert {r["implementation"] for x in rec for r in x.attention.values()} == {backend}
    assert float((sp - ref).norm() / ref.norm()) < 1e-2
    assert float((sp - plain).norm() / plain.norm()) < 1e-2
