import contextlib
import os

import torch

# Without a GPU the Triton kernels run under Triton's interpreter; triton.jit reads TRITON_INTERPRET when
# a kernel module is imported, so it must be set before anything imports omni_compile.ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import omni_compile


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """Each compile test starts from a clean Dynamo cache and leaves none behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def inductor_cache_off():
    """Inductor's FX-graph, autotune and AOTAutograd caches off, restored on exit.

    Uses torch's own config ``patch``: ``monkeypatch.setattr`` on a torch config module deletes the
    attribute on undo with current pytest (the config module has no instance ``__dict__`` entry to restore),
    which broke every later test that read it."""
    from torch._inductor import config as inductor_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False))
        if hasattr(torch._functorch.config, "enable_autograd_cache"):
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        yield


@pytest.fixture
def no_inductor_cache():
    """Make Inductor compile for real (so our passes run) instead of serving a cached graph."""
    with inductor_cache_off():
        yield


@pytest.fixture(scope="session")
def subprocess_env(tmp_path_factory):
    """Environment for CLI subprocesses: a private Inductor cache dir, quiet Python warnings."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor-cache"))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


__all__ = ["rel_l2", "omni_compile"]
