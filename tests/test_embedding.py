"""The GPU lowering path of the Triton kernels, traced on the CPU: every fused op of the real block
graphs becomes a `triton_kernel_wrapper_functional` launch of its kernel (what Inductor embeds), the
launches clone nothing but their own fresh output buffers, and no fused-op call is left. Runs in a
subprocess without TRITON_INTERPRET (interpreted kernels cannot be traced)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

EXPECTED = {
    "flux-tiny-transformer_blocks": {"_rms_norm_rope_kernel": 2, "_adaln_kernel": 4, "_gated_residual_kernel": 4},
    "flux-tiny-single_transformer_blocks": {
        "_rms_norm_rope_kernel": 2,
        "_adaln_kernel": 1,
        "_gated_residual_kernel": 1,
    },
    "wan-tiny-blocks": {
        "_rms_norm_kernel": 2,
        "_rms_norm_rope_kernel": 2,
        "_adaln_kernel": 2,
        "_gated_residual_kernel": 2,
    },
    # fp8 GEMMs: each activation an fp8 GEMM reads is quantized once: by the adaln kernel for the two modulated
    # norms (norm1, norm3: `adaln_quant`), by a quant_rows launch for the rest (norm2's affine LayerNorm, the text
    # states for cross-attention's k and v, both attentions' outputs, the FFN's GELU folded in)
    "wan-tiny-blocks-fp8": {
        "_rms_norm_kernel": 2,
        "_rms_norm_rope_kernel": 2,
        "_adaln_kernel": 2,
        "_gated_residual_kernel": 2,
        "_quant_rows_kernel": 5,
    },
}


@pytest.fixture(scope="module")
def lowered(subprocess_env):
    env = {k: v for k, v in subprocess_env.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(TESTS)
    env["OMNI_COMPILE_FP8_ANY_DEVICE"] = "1"  # the fp8 case's transform on this CPU (its graph is traced, not run)
    proc = subprocess.run(
        [sys.executable, str(TESTS / "embed_check.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("block", list(EXPECTED))
def test_every_fused_op_becomes_an_embedded_launch(lowered, block):
    got = lowered[block]
    assert got["kernels"] == EXPECTED[block]
    assert got["omni_ops"] == []
    # cat_gemm's linear_parts (FLUX's single-block proj_out) stays a call, as a GEMM does
    linear = ["omni_compile.linear_parts.default"] if block == "flux-tiny-single_transformer_blocks" else []
    assert got["extern_ops"] == linear
    # the launches clone only their fresh outputs (quant_rows and adaln_quant write two: e4m3 rows and scales)
    assert got["clones"] == (["out_ptr", "q_ptr", "qs_ptr", "s_ptr"] if block.endswith("-fp8") else ["out_ptr"])
    assert {r["implementation"] for r in got["resolutions"].values()} == {"triton (embedded)"}
    counts = {op: r["count"] for op, r in got["resolutions"].items()}
    assert sum(counts.values()) == sum(EXPECTED[block].values())
