"""Pass coverage across diffusers transformers: which passes match where, on tiny random models on the CPU.

    python bench/coverage.py                       # every model, a table on stdout
    python bench/coverage.py --only sd3,pixart     # some of them
    python bench/coverage.py --write               # also docs/data/coverage.json and the table in docs/passes.md
    python bench/coverage.py --only sd3 --write    # only those models' rows written again, the others kept
    python bench/coverage.py --fast                # no lowering: seconds a model (the CPU tests' mode)

For each model (FLUX and Wan presets, and diffusers classes omni-compile has no adapter for, with the tiny
configs and example-input functions of tests/generic_model.py and tests/dit_zoo.py), one process-local JIT
compile (`omni_compile.compile`, Dynamo + Inductor + our passes) of its regions at one bucket, then:

- per pass, the rewrites summed over the region compiles; for the attention pass, the SDPA calls it
  found and resolved (on the CPU it leaves them to torch: TORCH_SDPA); the GPU-only passes (`gemm_gelu`,
  `cat_gemm`) are run too, with their device check lifted, so the table shows where they match (their
  values are then those of the CPU op: `gemm_gelu`'s GELU is the erf form there);
- what occurs in the model per compiled region (`census`): RMSNorm modules, modulations (a norm's output times
  `1 + scale`, counted during the eager forward: `modulated_norms`), attention modules, tanh-GELUs. A pass
  whose pattern occurs and that matched less is a gap; `NOTES` says why where that is known;
- parity: relative L2 of the compiled output against eager on the same weights and inputs;
- compiles: region compiles, which must be one per region and call shape (regions x buckets, unless a
  region's instances run at several shapes in one bucket); more is a recompile (a layout or guard).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the example-input functions of the generic models

SHAPE_OF_PRESET = {"flux-tiny": "64x64", "wan-tiny": "64x96x9"}
PASSES = ("complex_mul", "rms_norm", "qk_norm_rope", "adaln", "gated_residual", "gemm_gelu", "cat_gemm", "attention")
# Why a pass matches less than its pattern occurs, or nothing where a reader would expect it to.
NOTES: dict[tuple[str, str], str] = {
    ("sana", "attention"): "attn1 is linear attention (no softmax, no SDPA call)",
    ("stable-audio", "adaln"): "no modulation (the conditioning is prepended to the sequence)",
}
# QK-norm + RoPE: the fused kernel reads FLUX's [S, D] per-element tables (HunyuanVideo's too, on the whole
# sequence or on the image prefix), Wan's per-pair tables, LTX-Video's interleaved [1, S, H * D] ones, the
# complex [S, D/2] ones (Qwen-Image, Lumina2, Z-Image), rotate-half ones and per-head [S, H, D/2] ones (Mochi); the
# norm an RMSNorm or a LayerNorm per head (CogView4, HunyuanDiT). In the models noted below the norm and the rotation are compiled by Inductor as they
# are.
NOTES.update({
    ("hunyuan-dit", "adaln"): "shift-only modulation, norm(x) + shift (no scale)",
    ("mochi", "attention"): "the census counts none: MochiAttention is no diffusers Attention module (it calls SDPA)",
})  # fmt: skip


def models() -> dict[str, tuple]:
    """name -> (model ref, config overrides, example-input ref or None, bucket, kind)."""
    from dit_zoo import ZOO
    from generic_model import GENERIC_MODELS

    out = {
        "flux": ("flux-tiny", {}, None, SHAPE_OF_PRESET["flux-tiny"], "image, MMDiT + single-stream (adapter)"),
        "wan": ("wan-tiny", {}, None, SHAPE_OF_PRESET["wan-tiny"], "video (adapter)"),
    }
    for name, (cls, config, inputs, shape) in {**GENERIC_MODELS, **ZOO}.items():
        out[name] = (cls, config, inputs, shape, KINDS.get(name, ""))
    return out


KINDS = {
    "ltx-video": "video",
    "chroma": "image, MMDiT + single-stream",
    "qwen-image": "image, MMDiT",
    "sd3": "image, MMDiT",
    "pixart": "image, single-stream (adaLN-single)",
    "sana": "image, linear attention",
    "cogvideox": "video, joint text+video",
    "hunyuan-video": "video, double + single stream",
    "stable-audio": "audio",
    "lumina2": "image, single-stream",
    "auraflow": "image, MMDiT + single-stream",
    "mochi": "video, joint text+video (asymmetric)",
    "cosmos": "video, self + cross attention",
    "cogview4": "image, single-stream over text + image",
    "hunyuan-dit": "image, U-ViT long skips, self + cross attention",
    "flux2": "image, MMDiT + single-stream",
    "zimage": "image, single-stream (refiners)",
}


@contextlib.contextmanager
def modulated_norms(model):
    """Count, during one eager forward, how often each norm module's output is multiplied by `1 + scale` (a
    modulation: not a gate's `gate * norm(x)`, nor a norm that feeds a linear or attention): module ->
    modulations. A module may modulate twice per call (CogVideoX's norm1 normalises the video and the text
    stream). `1 + scale` is followed through indexing, unsqueeze and views (`(1 + scale)[:, None]`)."""
    import torch
    from diffusers.models.normalization import RMSNorm
    from torch.overrides import TorchFunctionMode

    outputs: dict[int, tuple] = {}  # id(output) -> (module, output): the output is kept so its id stays unique
    counts: dict = {}

    def hook(mod, args, out):
        if isinstance(out, torch.Tensor):
            outputs[id(out)] = (mod, out)

    muls = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
    adds = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
    views = {torch.Tensor.__getitem__, torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.view,
             torch.Tensor.reshape, torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as}  # fmt: skip
    one_plus: dict[int, object] = {}  # id -> tensor: `1 + x` and views of it

    def is_one_plus(t) -> bool:
        return one_plus.get(id(t)) is t

    class Muls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in muls and len(args) >= 2:
                for a, other in ((args[0], args[1]), (args[1], args[0])):
                    hit = outputs.get(id(a))
                    if hit is not None and hit[1] is a and is_one_plus(other):
                        counts[hit[0]] = counts.get(hit[0], 0) + 1
            elif func in adds and len(args) >= 2 and any(isinstance(a, (int, float)) and a == 1 for a in args[:2]):
                one_plus[id(out)] = out
            elif func in views and args and is_one_plus(args[0]):
                one_plus[id(out)] = out
            return out

    hooks = [m.register_forward_hook(hook) for m in model.modules()
             if isinstance(m, (RMSNorm, torch.nn.RMSNorm, torch.nn.LayerNorm))]  # fmt: skip
    try:
        with Muls():
            yield counts
    finally:
        for h in hooks:
            h.remove()


def census(module, modulations: dict) -> dict[str, int]:
    """What one block holds that a pass is about: RMSNorms, the modulations of a norm's output (counted during
    the eager forward, `modulated_norms`; norms inside attention modules are QK-norms, not counted), attention
    modules, tanh-GELUs."""
    import torch
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention
    from diffusers.models.normalization import RMSNorm

    counts = {"rms_norm": 0, "adaln": 0, "attention": 0, "gemm_gelu": 0}
    attention = [p for p, m in module.named_modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    counts["attention"] = len(attention)
    for path, m in module.named_modules():
        in_attention = any(path.startswith(a + ".") for a in attention)  # a QK-norm is not an AdaLN's norm
        if isinstance(m, (RMSNorm, torch.nn.RMSNorm)):
            counts["rms_norm"] += 1
        if isinstance(m, (RMSNorm, torch.nn.RMSNorm, torch.nn.LayerNorm)) and not in_attention:
            counts["adaln"] += modulations.get(m, 0)
        if (isinstance(m, torch.nn.GELU) and m.approximate == "tanh") or (
            type(m).__name__ == "GELU" and getattr(m, "approximate", None) == "tanh"
        ):
            counts["gemm_gelu"] += 1
    return counts


@contextlib.contextmanager
def passes_only():
    """Inductor without its lowering: Dynamo's graph goes through AOTAutograd with Inductor's decompositions
    and Inductor's post-grad passes (ours among them, as in a real compile), and the rewritten ATen graph
    then runs as it is. The same matches in seconds instead of a C++ compile per region (--fast; the tests)."""
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx

    def compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._guards import detect_fake_mode
        from torch._inductor import config
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
        from torch._inductor.virtualized import V

        def forward_compiler(graph_module, inputs):
            with config.patch(config_patches or {}), V.set_fake_mode(detect_fake_mode(inputs)):
                view_to_reshape(graph_module)
                post_grad_passes(graph_module, is_inference=True)
            graph_module.recompile()
            return graph_module

        return aot_autograd(fw_compiler=forward_compiler, decompositions=select_decomp_table())(gm, example_inputs)

    compile_fx_module.compile_fx = compile_fx
    try:
        yield
    finally:
        compile_fx_module.compile_fx = real


def measure(name: str, ref: str, config: dict, inputs_ref: str | None, shape: str, fast: bool = False) -> dict:
    """Compile one model's regions at `shape` (CPU, fp32) and report matches, census, parity and compiles
    (`fast`: through `passes_only`, no lowering)."""
    import torch

    import omni_compile
    from omni_compile.artifact.parity import bucket_output
    from omni_compile.config import CompileConfig, ShapeBucket
    from omni_compile.models import resolve_model
    from omni_compile.passes import cat_gemm, gemm_gelu

    torch._dynamo.reset()
    spec = resolve_model(ref, example_inputs=inputs_ref, model_config=config or None)
    model = spec.load(dtype=torch.float32, device="cpu", seed=0)
    bucket = ShapeBucket.parse(shape)
    inputs = spec.adapter.example_inputs(model, bucket, dtype=torch.float32, device="cpu", text_len=spec.text_len,
                                         seed=1)  # fmt: skip
    with torch.no_grad(), modulated_norms(model) as modulations:
        ref_out = bucket_output(model(**inputs))
    lifted = (gemm_gelu._gelu_is_tanh_on, gemm_gelu.GemmGeluPass.is_applicable, cat_gemm.CatGemmPass.is_applicable)
    gemm_gelu._gelu_is_tanh_on = lambda device: True
    gemm_gelu.GemmGeluPass.is_applicable = cat_gemm.CatGemmPass.is_applicable = lambda self, platform, config: True
    t0 = time.perf_counter()
    try:
        omni_compile.compile(model, CompileConfig(passes=["+gated_residual"]), regions=spec.block_names(model),
                             adapter=spec.adapter)  # fmt: skip
        with torch.no_grad(), (passes_only() if fast else contextlib.nullcontext()):
            out = bucket_output(model(**inputs))
    finally:
        gemm_gelu._gelu_is_tanh_on, gemm_gelu.GemmGeluPass.is_applicable, cat_gemm.CatGemmPass.is_applicable = lifted
    seconds = time.perf_counter() - t0
    state = omni_compile.compile_state(model)
    matches = {p: 0 for p in PASSES}
    calls = 0
    for rec in state.records:
        for p, n in rec.passes.items():
            if p in matches:
                matches[p] += n
        calls += sum(r["count"] for r in rec.attention.values())
    matches["attention"] = calls  # calls found and resolved (on the CPU: left to torch's SDPA)
    occurs = {k: 0 for k in ("rms_norm", "adaln", "attention", "gemm_gelu")}
    per_region = {region.name: census(region.instances[0][1], modulations) for region in state.regions}
    for rec in state.records:  # what each compiled graph holds
        for k, v in per_region[rec.region].items():
            occurs[k] += v
    err = float((out.double() - ref_out.double()).norm() / ref_out.double().norm())
    return {
        "model": name,
        "class": type(model).__name__,
        "regions": [f"{r.name} x{len(r.instances)}" for r in state.regions],
        "bucket": shape,
        "compiles": len(state.records),
        # one compile per region and call shape: a region whose instances run at several shapes in one bucket
        # (Lumina2's refiners and layers) compiles once per shape; more than that is a recompile
        "expected_compiles": len({(r.region, repr([(i[1], i[3]) for i in r.inputs if i[0] == "tensor"]))
                                  for r in state.records}),
        "matches": matches,
        "occurs": occurs,
        "rel_l2": err,
        "compile_s": round(seconds, 1),
    }


def artifact_round_trip(name: str, ref: str, config: dict, inputs_ref: str | None, shape: str, root: Path) -> dict:
    """The CLI a user runs, on one model with no adapter: `build module:Class`, `verify`, `inspect` of the
    artifact, then another checkpoint of the architecture saved as a diffusers directory, `build DIR` (its
    files from the first build's store) and `verify --weights DIR`. Each step: ok, seconds, and the error."""
    import os
    import subprocess

    import torch

    from omni_compile.models import resolve_model

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    steps: dict[str, dict] = {}

    def cli(step: str, *args: str) -> None:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-P", "-m", "omni_compile.cli", *args], env=env, capture_output=True,
                              text=True)  # fmt: skip
        steps[step] = {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1)}
        if proc.returncode:
            steps[step]["error"] = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "no output"
        print(f"  {step}: {'ok' if proc.returncode == 0 else 'FAILED'} ({steps[step]['seconds']} s)", file=sys.stderr)

    store = f"file://{root / 'store'}"
    inputs = ["--example-inputs", inputs_ref] if inputs_ref else []
    cli("build module:Class", "build", ref, "--model-config", json.dumps(config), *inputs, "--shapes", shape,
        "--device", "cpu", "--store", store, "--out", str(root / "class"))  # fmt: skip
    cli("verify", "verify", str(root / "class"), "--json")
    cli("inspect", "inspect", str(root / "class"), "--json", str(root / "inspect.json"), "-q")
    model = resolve_model(ref, model_config=config).load(dtype=torch.float32, device="cpu", seed=7)
    model.save_pretrained(root / "weights")
    cli("build DIR", "build", str(root / "weights"), *inputs, "--shapes", shape, "--store", store, "--parity", "always",
        "--out", str(root / "dir"))  # fmt: skip
    cli("verify --weights DIR", "verify", str(root / "dir"), "--weights", str(root / "weights"), "--json")
    return {"model": name, "class": ref, "bucket": shape, "steps": steps}


def artifact_table(rows: list[dict]) -> str:
    steps = list(rows[0]["steps"]) if rows else []
    lines = ["| model | " + " | ".join(steps) + " |", "|" + "---|" * (len(steps) + 1)]
    for r in rows:
        cells = [f"ok, {v['seconds']} s" if v["ok"] else f"**failed**: {v.get('error', '')}" for v in r["steps"].values()]
        lines.append(f"| {r['model']} ({r['class'].split(':')[-1]}, {r['bucket']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The markdown coverage table: per model, per pass matches (and what occurs, as matched/occurring)."""
    head = ["model", "class (kind)", "regions", "compiles", *PASSES, "rel L2 vs eager"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for p in PASSES:
            n, occ = r["matches"][p], r["occurs"].get(p)
            cell = f"{n}" if occ is None else f"{n}/{occ}"
            if (r["model"], p) in NOTES:
                cell += f" ({NOTES[(r['model'], p)]})"
            cells.append(cell)
        compiles = f"{r['compiles']}" + ("" if r["compiles"] == r["expected_compiles"] else f" (expected {r['expected_compiles']})")
        kind = r.get("kind", "")
        lines.append(f"| {r['model']} | {r['class']} ({kind}) | {', '.join(r['regions'])} | {compiles} | "
                     + " | ".join(cells) + f" | {r['rel_l2']:.1e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma list of model names")
    ap.add_argument("--write", action="store_true", help="write docs/data/coverage.json and the docs/passes.md table "
                    "(with --only: those models' rows, the others kept)")
    ap.add_argument("--fast", action="store_true", help="our passes inside Inductor's post-grad passes, no lowering "
                    "(seconds a model; what the tests run)")
    ap.add_argument("--artifacts", action="store_true", help="instead: the CLI round trip (build module:Class, verify, "
                    "inspect, build DIR, verify --weights DIR) of each model without an adapter; with --write, into "
                    "docs/data/coverage_artifacts.json and docs/passes.md")
    args = ap.parse_args()
    todo = models()
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    if args.artifacts:
        return _artifacts_main(todo, args.write, merge=bool(args.only))
    rows = []
    for name, (ref, config, inputs_ref, shape, kind) in todo.items():
        print(f"# {name}: {ref} at {shape}", file=sys.stderr, flush=True)
        try:
            row = {**measure(name, ref, config, inputs_ref, shape, fast=args.fast), "kind": kind}
        except Exception as e:  # a model that fails is a row of the table, not the end of it
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  ERROR {row['error']}", file=sys.stderr)
        rows.append(row)
    ok = [r for r in rows if "error" not in r]
    print(table(ok))
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: {r['error']}")
    if args.write:
        rows = _merged("coverage", rows) if args.only else rows
        _write("coverage", rows, table([r for r in rows if "error" not in r]))
    return 1 if len(ok) < len(rows) else 0


def _merged(name: str, rows: list[dict]) -> list[dict]:
    """docs/data/NAME.json's rows with `rows` in place of those of the same model (new ones last): --only with
    --write updates some models' rows and keeps the others'."""
    path = ROOT / "docs" / "data" / f"{name}.json"
    old = json.loads(path.read_text()) if path.exists() else []
    new = {r["model"]: r for r in rows}
    return [new.pop(r["model"], r) for r in old] + list(new.values())


def _write(name: str, rows: list[dict], markdown: str) -> None:
    """docs/data/NAME.json, and `markdown` between the <!-- NAME:start/end --> marks of docs/passes.md."""
    (ROOT / "docs" / "data" / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    doc = ROOT / "docs" / "passes.md"
    text = doc.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start in text and end in text:
        doc.write_text(text[: text.index(start) + len(start)] + "\n" + markdown + "\n" + text[text.index(end):])


def _artifacts_main(todo: dict, write: bool, merge: bool = False) -> int:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="omni-coverage-") as tmp:
        for name, (ref, config, inputs_ref, shape, _) in todo.items():
            if inputs_ref is None:
                continue  # the FLUX and Wan presets: their round trip is the artifact tests'
            print(f"# {name}: {ref} at {shape}", file=sys.stderr, flush=True)
            rows.append(artifact_round_trip(name, ref, config, inputs_ref, shape, Path(tmp) / name))
    print(artifact_table(rows))
    if write:
        rows = _merged("coverage_artifacts", rows) if merge else rows
        _write("coverage_artifacts", rows, artifact_table(rows))
    return 0 if all(v["ok"] for r in rows for v in r["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
