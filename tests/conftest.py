import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

# Without a GPU the Triton kernels run under Triton's interpreter; triton.jit reads TRITON_INTERPRET when
# a kernel module is imported, so it must be set before anything imports omni_compile.ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor proves each CPU vector ISA the CPU reports by compiling and loading a probe into its cache directory,
# about 7 s per process with a fresh one (every "node" of a store test, every build subprocess): the suite takes
# the CPU's report as is (torch.compile picks the same ISA; the probe only guards a broken toolchain). Read by
# torch._inductor.config when first imported, and inherited by every subprocess.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# Whether the Triton kernels were imported for the interpreter (fixed when the first kernel module loads).
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

import pytest

import omni_compile

TESTS = Path(__file__).parent


def require_triton_interpreter():
    """Skip a test that runs our Triton kernels on CPU tensors where they were imported for the GPU (a GPU
    machine: TRITON_INTERPRET unset at import); there their CUDA tests (`-m gpu`) cover them. Where it does not
    skip, TRITON_INTERPRET=1 is set."""
    if not TRITON_INTERPRETED:
        pytest.skip("runs Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 when the kernels are "
                    "imported (set by tests/conftest.py only without a GPU)")  # fmt: skip


def with_tests_dir_on_path(env: dict, **extra: str) -> dict:
    """`env` with this directory ahead of its PYTHONPATH (for `generic_model:...`, `dit_zoo:...` in a CLI
    subprocess), plus `extra` variables."""
    path = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    return dict(env, PYTHONPATH=path, **extra)


def pytest_collection_modifyitems(config, items):
    # Tiers: `unit` is every test marked neither `compile` (an Inductor compile, a build) nor `gpu`:
    # `pytest -m unit tests` is the fast tier, `-m compile` the slow one, `-m gpu` the GPU machine's.
    for item in items:
        if "compile" not in item.keywords and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.unit)
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


def selected(request, test_name: str) -> bool:
    """Whether this session runs the test function `test_name` of the requesting module (any parameters)."""
    return any(getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == test_name
               for item in request.session.items)  # fmt: skip


class BackgroundRun:
    """A command started in a subprocess now and collected later with `result()`; its output goes to files
    (a pipe nobody reads could fill and stop it). For the slow build one test needs: started with its
    module's first test, it runs beside the module's other tests (a build runs mostly one compiler process
    at a time, and CI has 2 cores). `stop()` kills it if it still runs."""

    def __init__(self, args: list[str], env: dict, log_dir: Path, timeout: float = 900):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.args, self.timeout = args, timeout
        self._out, self._err = open(log_dir / "stdout", "w+"), open(log_dir / "stderr", "w+")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(args, env=env, stdout=self._out, stderr=self._err, text=True)
        self.seconds: float | None = None  # how long the command ran, once it has ended
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.seconds = time.perf_counter() - self.started

    def result(self) -> subprocess.CompletedProcess:
        """Wait for the command (at most `timeout` seconds from its start): its exit status and output."""
        try:
            self.proc.wait(timeout=max(self.timeout - (time.perf_counter() - self.started), 0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self._waiter.join()
        self._out.seek(0)
        self._err.seek(0)
        return subprocess.CompletedProcess(self.args, self.proc.returncode, self._out.read(), self._err.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


# The session's one flux-tiny artifact (`flux_artifact`): two shape buckets, so that what is per bucket
# (one file per region and bucket, dispatch, the supported list in errors) is exercised.
FLUX_ARTIFACT_BUCKETS = ["64x64", "64x128"]


class BuiltArtifact(NamedTuple):
    path: Path  # the artifact directory
    store: Path  # the file store the build published every file into (first node of tests/test_cache_build.py)
    stderr: str  # the build's progress and summary


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}  # fmt: skip


@pytest.fixture(scope="session")
def flux_artifact(tmp_path_factory, subprocess_env) -> BuiltArtifact:
    """flux-tiny built ahead of time (`omni-compile build`, AOTInductor packages) at FLUX_ARTIFACT_BUCKETS
    into an empty file store, once per session, in a subprocess with its own empty Inductor cache (minutes
    on 2 CPU cores).

    Shared by the tests that read, load, verify, inspect or serve it (tests/test_artifact.py,
    tests/test_inspect.py, tests/test_server.py) and by tests/test_cache_build.py as a first node's build.
    Read-only: a test that changes the artifact or the store works on a copy (shutil.copytree into its
    tmp_path); at the end of the session every file must be as built."""
    root = tmp_path_factory.mktemp("flux-artifact")
    out, store = root / "flux-tiny", root / "store"
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    proc = subprocess.run([sys.executable, "-P", "-m", "omni_compile.cli", "build", "flux-tiny", "--shapes",
                           ",".join(FLUX_ARTIFACT_BUCKETS), "--store", f"file://{store}", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in root.iterdir() if ".partial-" in p.name] == []
    built = {d: _tree_digest(d) for d in (out, store)}
    yield BuiltArtifact(out, store, proc.stderr)
    for d, before in built.items():
        after = _tree_digest(d)
        changed = sorted(f for f in before.keys() | after.keys() if before.get(f) != after.get(f))
        assert not changed, f"a test changed the session's {d.name} (copy it to change it): {changed[:10]}"


class BuiltJit(NamedTuple):
    path: Path  # the output directory: build_report.json, inductor_cache.bin
    report: dict  # its build_report.json
    stderr: str  # the build's progress and summary


@pytest.fixture(scope="session")
def flux_jit_build(tmp_path_factory, subprocess_env) -> BuiltJit:
    """flux-tiny built JIT (`omni-compile build --mode jit`) at 64x64, once per session, in a subprocess with
    its own empty Inductor cache (two region compiles, under a minute on 2 CPU cores). Shared by
    tests/test_cli.py (the warm start from its bundle) and tests/test_build_pipeline.py (the report schema).
    Read-only."""
    import json

    root = tmp_path_factory.mktemp("flux-jit")
    out = root / "cold"
    env = dict(subprocess_env, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    proc = subprocess.run([sys.executable, "-P", "-m", "omni_compile.cli", "build", "flux-tiny", "--mode", "jit",
                           "--shapes", "64x64", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in root.iterdir() if ".partial-" in p.name] == []
    return BuiltJit(out, json.loads((out / "build_report.json").read_text()), proc.stderr)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


__all__ = ["FLUX_ARTIFACT_BUCKETS", "BackgroundRun", "BuiltArtifact", "BuiltJit", "rel_l2", "selected", "omni_compile"]
