"""The package-dir mapping works from a built wheel (the editable install is what the suite runs on)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


TOP = {"omni_compile": "omni_compile", "graphs": "omni_compile.graphs", "passes": "omni_compile.passes",
       "models": "omni_compile.models", "server": "omni_compile.server"}


def _source_packages():
    """Every folder with an __init__.py under the installed top-level folders, as the module it installs as."""
    for folder, name in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            yield ".".join((name, *rel))


def _clean_copy(dest: Path) -> Path:
    """The source tree without build outputs: setuptools reuses a stale `build/lib`, which can hold a subpackage
    that the package list no longer names, so a wheel built in place may pass where a fresh clone's fails."""
    import shutil

    top = {"build", "dist", ".git", ".whl", ".fa4", "out", ".pytest_cache", ".benchmarks", "docs", "bench"}

    def ignore(folder, names):
        here = Path(folder) == ROOT
        return [n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (here and n in top)]

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def test_wheel_installs_subpackages_under_omni_compile(tmp_path):
    src = _clean_copy(tmp_path / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("omni_compile-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # every package of the source tree (a subpackage missing from pyproject's list is missing from the wheel)
    packages = sorted(_source_packages())
    assert "omni_compile.build.compilers" in packages
    code = (
        f"import importlib; [importlib.import_module(p) for p in {packages!r}]; "
        "import omni_compile.attention.triton_attn, omni_compile.runtime.cuda_graphs, "
        "omni_compile.artifact.loader, omni_compile.build.session; from omni_compile.ops import FUSED_OPS; "
        "assert all('triton' in op.kernels for op in FUSED_OPS.values()), 'kernels not installed'; "
        "print(omni_compile.passes.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    # -P: do not put the working directory (the source tree) on sys.path.
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(target / "omni_compile" / "passes"))
    assert not (target / "passes").exists() and not (target / "graphs").exists()  # no bare top-level packages
