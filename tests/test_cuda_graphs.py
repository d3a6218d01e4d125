"""CudaGraphForward: pass-through on the CPU; on a GPU, one graph per bucket, replay equal to eager, outputs
cloned, and a capture failure that says how to turn CUDA graphs off."""

import pytest
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from omni_compile.runtime import CudaGraphForward
from omni_compile.runtime.cuda_graphs import _clone_outputs

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class LinearGelu(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.act = nn.GELU()

    def forward(self, hidden_states):
        return (self.act(self.proj(hidden_states)),)


class TinyTransformer(nn.Module):
    """Called like a diffusers transformer: keyword tensors, a non-tensor kwarg, a ModelOutput or a tuple."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, timestep, joint_attention_kwargs=None, return_dict=True):
        out = self.proj(hidden_states) * timestep[:, None, None]
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)


class Syncs(nn.Module):
    def forward(self, x):
        return (x * x.sum().item(),)


def test_cpu_passes_through():
    torch.manual_seed(0)
    module = LinearGelu()
    runner = CudaGraphForward(module)
    for n in (3, 5, 3):
        x = torch.randn(2, n, 64)
        out = runner(x)
        assert isinstance(out, tuple) and len(out) == 1
        assert torch.equal(out[0], module(x)[0])
    assert runner.stats == {"captures": 0, "replays": 0, "eager_calls": 3, "evictions": 0}
    assert runner.graphs == 0 and runner.keys() == []


def test_disabled_passes_through():
    runner = CudaGraphForward(LinearGelu(), enabled=False)
    runner(torch.randn(1, 2, 64))
    assert runner.stats["eager_calls"] == 1 and runner.graphs == 0


def test_key_and_description():
    runner = CudaGraphForward(TinyTransformer())
    x, t = torch.randn(1, 16, 32, dtype=torch.bfloat16), torch.ones(1)
    desc = runner._describe((x,), {"timestep": t, "joint_attention_kwargs": None, "return_dict": False})
    assert desc == "hidden_states=1x16x32 bf16, timestep=1 fp32, joint_attention_kwargs=None, return_dict=False"
    assert runner._describe((x.transpose(1, 2),), {}) == "hidden_states=1x32x16 bf16 stride 512,1,32"


def test_clone_outputs_keeps_model_output_type():
    # diffusers' BaseOutput registers its subclasses with pytree, so they rebuild as themselves.
    sample = torch.randn(2, 3)
    out = _clone_outputs(Transformer2DModelOutput(sample=sample))
    assert type(out) is Transformer2DModelOutput
    assert torch.equal(out.sample, sample) and out.sample.data_ptr() != sample.data_ptr()
    nested = _clone_outputs({"a": (sample, None, 3)})
    assert nested["a"][1:] == (None, 3) and nested["a"][0].data_ptr() != sample.data_ptr()


@gpu
@needs_cuda
def test_two_buckets_replay_matches_eager_and_outputs_are_cloned():
    torch.manual_seed(0)
    module = LinearGelu().cuda()
    runner = CudaGraphForward(module)
    shapes = [(2, 8, 64), (2, 16, 64), (2, 8, 64), (2, 16, 64)]
    outputs = []
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(shape, device="cuda")
            out = runner(x)
            assert isinstance(out, tuple) and len(out) == 1
            torch.testing.assert_close(out[0], module(x)[0])
            outputs.append((out[0], out[0].clone()))
    # Step 3 replays step 1's graph; what step 1 returned is untouched.
    for returned, snapshot in outputs:
        assert torch.equal(returned, snapshot)
    assert runner.graphs == 2
    assert runner.stats == {"captures": 2, "replays": 2, "eager_calls": 0, "evictions": 0}
    assert runner.keys() == ["hidden_states=2x8x64 fp32", "hidden_states=2x16x64 fp32"]


@gpu
@needs_cuda
def test_max_graphs_drops_the_least_recently_used():
    torch.manual_seed(0)
    module = LinearGelu().cuda()
    runner = CudaGraphForward(module, max_graphs=2)
    with torch.no_grad():
        for n in (8, 16, 8, 24, 16):  # 24 drops 16 (8 was replayed since); 16 is captured again, dropping 8
            x = torch.randn(2, n, 64, device="cuda")
            torch.testing.assert_close(runner(x)[0], module(x)[0])
    assert runner.stats == {"captures": 4, "replays": 1, "eager_calls": 0, "evictions": 2}
    assert runner.keys() == ["hidden_states=2x24x64 fp32", "hidden_states=2x16x64 fp32"]


def test_max_graphs_is_checked(monkeypatch):
    from omni_compile import envs

    with pytest.raises(ValueError, match="max_graphs must be >= 1 or None, got 0"):
        CudaGraphForward(LinearGelu(), max_graphs=0)
    monkeypatch.delenv("OMNI_COMPILE_CUDA_GRAPHS_MAX", raising=False)
    assert envs.cuda_graphs_max() == 8
    monkeypatch.setenv("OMNI_COMPILE_CUDA_GRAPHS_MAX", "3")
    assert envs.cuda_graphs_max() == 3
    monkeypatch.setenv("OMNI_COMPILE_CUDA_GRAPHS_MAX", "lots")
    with pytest.raises(ValueError, match="OMNI_COMPILE_CUDA_GRAPHS_MAX must be a positive integer, got 'lots'"):
        envs.cuda_graphs_max()


@gpu
@needs_cuda
def test_non_tensor_kwargs_are_part_of_the_key():
    torch.manual_seed(0)
    module = TinyTransformer().cuda()
    runner = CudaGraphForward(module)
    with torch.no_grad():
        for return_dict in (True, False, True):
            x, t = torch.randn(1, 16, 32, device="cuda"), torch.rand(1, device="cuda")
            out = runner(hidden_states=x, timestep=t, joint_attention_kwargs=None, return_dict=return_dict)
            ref = module(hidden_states=x, timestep=t, return_dict=False)[0]
            if return_dict:
                assert type(out) is Transformer2DModelOutput
                torch.testing.assert_close(out.sample, ref)
            else:
                assert isinstance(out, tuple)
                torch.testing.assert_close(out[0], ref)
    assert runner.graphs == 2 and runner.stats["replays"] == 1


@gpu
@needs_cuda
def test_capture_failure_says_how_to_turn_graphs_off():
    runner = CudaGraphForward(Syncs())
    with pytest.raises(RuntimeError, match="cuda_graphs=False") as info:
        runner(torch.randn(4, device="cuda"))
    assert "x=4 fp32" in str(info.value) and info.value.__cause__ is not None
    assert runner.graphs == 0
    # The device is usable afterwards, on the stream the caller had.
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert (torch.ones(2, device="cuda") + 1).sum().item() == 4
    # and its random ops too: torch can leave the generator capturing after a failed capture
    assert torch.randn(3, device="cuda").isfinite().all()


# ------------------------------------------------------------------ whole-step graphs in the JIT path


def test_jit_cuda_graphs_need_a_cuda_model():
    import omni_compile
    from omni_compile.errors import ConfigError
    from omni_compile.models import resolve_model

    model = resolve_model("flux-tiny").load(dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ConfigError, match="cuda_graphs=True needs the model on a CUDA GPU; it is on cpu"):
        omni_compile.compile(model, cuda_graphs=True)
    assert getattr(model, "_omni_compile", None) is None and "forward" not in model.__dict__


@gpu
@needs_cuda
@pytest.mark.parametrize("preset,shapes", [("flux-tiny", ("64x64", "128x128")), ("wan-tiny", ("64x96x9",))])
def test_jit_whole_step_graph_per_bucket(preset, shapes, fresh_dynamo, no_inductor_cache):
    """compile(..., cuda_graphs=True): the first call of a bucket compiles its regions and captures one graph
    around the whole forward; later calls replay it (no recompile), matching the graph-less compiled output."""
    import omni_compile
    from omni_compile.config import ShapeBucket
    from omni_compile.models import resolve_model

    spec = resolve_model(preset)
    model = spec.load(dtype=torch.bfloat16, device="cuda", seed=0)
    omni_compile.compile(model, cuda_graphs=True)
    state = omni_compile.compile_state(model)
    compiles = []
    with torch.no_grad():
        for seed in (1, 2):
            for shape in shapes:
                inputs = spec.adapter.example_inputs(model, ShapeBucket.parse(shape), dtype=torch.bfloat16,
                                                     device="cuda", text_len=spec.text_len, seed=seed)  # fmt: skip
                out = model(**inputs)[0]
                graphed = state.cuda_graphs
                del model.forward  # the same compiled regions without the graph
                ref = model(**inputs)[0]
                model.forward = graphed
                torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
            compiles.append(len(state.records))
    assert state.cuda_graphs.stats == {"captures": len(shapes), "replays": len(shapes), "eager_calls": 0, "evictions": 0}
    assert compiles[0] == compiles[1] >= len(shapes) * len(state.regions), compiles  # the second round compiled nothing
    omni_compile.uncompile(model)
    assert "forward" not in model.__dict__
