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

# q's and k's rms_norm_rope share their rotary tables: one paired launch serves both (2 calls, 1 launch)
EXPECTED = {
    "flux-tiny-transformer_blocks": {"_rms_norm_rope_kernel": 1, "_adaln_kernel": 4, "_gated_residual_kernel": 4},
    "flux-tiny-single_transformer_blocks": {
        "_rms_norm_rope_kernel": 1,
        "_adaln_kernel": 1,
        "_gated_residual_kernel": 1,
    },
    "wan-tiny-blocks": {
        "_rms_norm_kernel": 2,
        "_rms_norm_rope_kernel": 1,
        "_adaln_kernel": 2,
        "_gated_residual_kernel": 2,
    },
    # fp8 GEMMs: each activation an fp8 GEMM reads is quantized once: by the adaln kernel for the two modulated
    # norms (norm1, norm3: `adaln_quant`), by a quant_rows launch for the rest (norm2's affine LayerNorm, the text
    # states for cross-attention's k and v, both attentions' outputs, the FFN's GELU folded in)
    "wan-tiny-blocks-fp8": {
        "_rms_norm_kernel": 2,
        "_rms_norm_rope_kernel": 1,
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
    # the launches clone only their fresh outputs (quant_rows and adaln_quant write two: e4m3 rows and scales; the
    # paired rms_norm_rope two: q's and k's)
    fp8 = ["q_ptr", "qs_ptr", "s_ptr"] if block.endswith("-fp8") else []
    assert got["clones"] == sorted(["out_ptr", "outy_ptr", *fp8])
    assert {r["implementation"] for r in got["resolutions"].values()} == {"triton (embedded)"}
    counts = {op: r["count"] for op, r in got["resolutions"].items()}
    assert counts["rms_norm_rope"] == 2 and got["resolutions"]["rms_norm_rope"]["paired"] == 2
    assert sum(counts.values()) == sum(EXPECTED[block].values()) + 1


# graph -> [launches, calls paired] with the default options, and with the pass option pair=False (embed_check.py)
PAIRING = {
    "qk": [1, 2],
    "qk_views": [1, 2],  # the tables reach q and k through two equal views: still the same tables
    "k_needs_q": [2, 0],
    "q_used_between": [2, 0],
    "q_viewed_between": [1, 2],  # k's views move up: the launch stands where q's call was
    "q_viewed_k_computed": [1, 2],  # k's input computed in between: it moves up too
    "q_used_k_computed": [1, 2],
    "k_random": [2, 0],  # random numbers never change place
    "other_tables": [2, 0],
    "three": [2, 2],
}


@pytest.mark.parametrize("graph", list(PAIRING))
def test_q_and_k_share_one_launch_only_where_it_is_sound(lowered, graph):
    assert lowered["pairing"][graph] == PAIRING[graph]
    calls = {"three": 3}.get(graph, 2)
    assert lowered["pairing"][graph + "-nopair"] == [calls, 0]
