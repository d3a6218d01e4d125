"""The package-dir mapping works from a built wheel (the editable install is what the suite runs on)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_subpackages_under_omni_compile(tmp_path):
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
            str(ROOT),
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
    code = (
        "import omni_compile, omni_compile.graphs, omni_compile.passes, omni_compile.models, "
        "omni_compile.server, omni_compile.attention.triton_attn, omni_compile.runtime.cuda_graphs, "
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
