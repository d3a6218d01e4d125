"""Why do AOTInductor CUDA packages crash at load on the H200 image (run 8), and does Inductor's
standalone_compile artifact load there instead? Every case runs in its own `python3 -P` child so a
crash names the case and the rest go on; "clean" cases run without PYTHONPATH (the image's own
packages only, omni_compile not importable), so nothing of ours is in the process.

    python bench/diag_aoti3.py DIR        # prints one line per case, a table last; logs in DIR
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

AOTI_COMPILE = r"""
import sys, torch
from torch import nn
path, kind, dev, opt = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
class Sin(nn.Module):
    def forward(self, x):
        return x.sin() + 1
m = (nn.Linear(64, 64) if kind == "linear" else Sin()).to(dev, torch.bfloat16)
x = torch.randn(2, 64, device=dev, dtype=torch.bfloat16)
with torch.no_grad():
    ep = torch.export.export(m, (x,))
cfg = {"aot_inductor.package_constants_in_so": False} if opt == "constants_outside" else {}
p = torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=cfg)
print("compiled", flush=True)
torch.save({"x": x, "ref": m(x)}, path + ".io")
if sys.argv[5] == "load_here":
    r = torch._inductor.aoti_load_package(p)
    print("loaded", flush=True)
    print("ran", (r(x) - m(x)).abs().max().item(), flush=True)
"""

AOTI_LOAD = r"""
import sys, torch
path = sys.argv[1]
if len(sys.argv) > 2 and sys.argv[2] == "omni":
    import omni_compile.artifact.loader  # noqa: F401
torch.zeros(1, device="cuda")
r = torch._inductor.aoti_load_package(path)
print("loaded", flush=True)
d = torch.load(path + ".io", weights_only=False)
print("ran", (r(d["x"]) - d["ref"]).abs().max().item(), flush=True)
"""

SC_COMPILE = r"""
import os, sys, time, torch
from pathlib import Path
from torch.utils import _pytree as pytree
from omni_compile.artifact import aot
from omni_compile.builder import BuildOptions, resolve_build
from omni_compile.graphs import find_regions
from omni_compile.passes import PassLog
root, model_name, shapes = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
root.mkdir(parents=True, exist_ok=True)
opts = BuildOptions(model=model_name, shapes=shapes, dtype="bf16", device=os.environ.get("DIAG_DEVICE", "cuda"), out=str(root))
spec, dt, device, buckets, pm = resolve_build(opts)
model = spec.load(dtype=dt, device=device, seed=0)
regions = find_regions(model, spec.adapter.block_names(model) or None)
targets = [aot.Target(r.name, "block", list(r.instances)) for r in regions]
rec = aot.CallRecorder(targets)
with rec, torch.no_grad():
    rec.bucket = str(buckets[0])
    model(**spec.adapter.example_inputs(model, buckets[0], dtype=dt, device=device, text_len=spec.text_len, seed=0))
index = []
for t in targets:
    r = rec.records[t.name]
    sig, (args, kwargs) = next(iter(r.examples.items()))
    module = dict(t.instances)[r.instances[sig][0]]
    ep, gh = aot.export_region(module, (args, kwargs))
    gm = ep.module()
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.recompile()
    flat, _ = pytree.tree_flatten(((aot.module_state(module), args, kwargs), {}))
    log = PassLog(label=t.name)
    t0 = time.perf_counter()
    with pm.recording(log):
        art = torch._inductor.standalone_compile(gm, flat, dynamic_shapes="from_example_inputs",
                                                 options={"config_patches": {"post_grad_custom_post_pass": pm}})
    sec = time.perf_counter() - t0
    art.save(path=str(root / f"{t.name}.bin"), format="binary")
    with torch.no_grad():
        ref = module(*args, **kwargs)
    torch.save({"flat": flat, "ref": ref}, root / f"{t.name}.io")
    index.append({"name": t.name, "seconds": round(sec, 2), "matches": log.matches(),
                  "bytes": (root / f"{t.name}.bin").stat().st_size})
    print("compiled", t.name, round(sec, 1), log.matches(), flush=True)
(root / "index.json").write_text(__import__("json").dumps(index))
"""

SC_LOAD = r"""
import os, sys, time, json, torch
from pathlib import Path
import omni_compile.artifact.loader  # noqa: F401  (registers our ops)
dev = os.environ.get("DIAG_DEVICE", "cuda")
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
torch.zeros(1, device=dev); sync()
root = Path(sys.argv[1])
from torch._dynamo.utils import counters
rows = []
for e in json.loads((root / "index.json").read_text()):
    t1 = time.perf_counter()
    art = torch._inductor.CompiledArtifact.load(path=str(root / (e["name"] + ".bin")), format="binary")
    t2 = time.perf_counter()
    d = torch.load(root / (e["name"] + ".io"), weights_only=False)
    out = art(*d["flat"]); sync()
    t3 = time.perf_counter()
    ref = d["ref"] if isinstance(d["ref"], (list, tuple)) else [d["ref"]]
    out = out if isinstance(out, (list, tuple)) else [out]
    err = max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref))
    for _ in range(3):
        art(*d["flat"])
    sync(); t4 = time.perf_counter()
    for _ in range(10):
        art(*d["flat"])
    sync(); t5 = time.perf_counter()
    rows.append({"name": e["name"], "load_s": round(t2 - t1, 3), "first_call_s": round(t3 - t2, 3),
                 "step_ms": round((t5 - t4) * 100, 3), "max_abs_err": err})
    print("loaded", rows[-1], flush=True)
print("counters", json.dumps({k: dict(v) for k, v in counters.items() if v}), flush=True)
print("RESULT", json.dumps(rows), flush=True)
"""


def child(log: Path, code: str, *args: str, clean: bool, env_extra: dict | None = None, timeout: int = 300,
          wrap: list[str] | None = None) -> tuple[int, str]:  # fmt: skip
    env = dict(os.environ)
    if clean:
        env.pop("PYTHONPATH", None)
    env.update(env_extra or {})
    cmd = [*(wrap or []), sys.executable, "-P", "-X", "faulthandler", "-c", code, *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timeout after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    log.write_text(f"$ {' '.join(cmd[:4])} ... {' '.join(args)}\nrc={rc} wall={time.perf_counter() - t0:.1f}s\n{out}")
    return rc, out


def main() -> int:
    root = Path(sys.argv[1])
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = []

    def case(name, code, *args, **kw):
        rc, out = child(root / f"{name}.log", code, *args, **kw)
        last = [ln for ln in out.splitlines() if ln.startswith(("compiled", "loaded", "ran", "RESULT", "Fatal"))]
        rows.append((name, rc, last[-1][:110] if last else out.strip().splitlines()[-1:][0][:110] if out.strip() else ""))
        print(f"{name:34s} rc={rc:4d} {rows[-1][2]}", flush=True)
        return rc, out

    lin = str(root / "linear.pt2")
    case("clean compile+load linear", AOTI_COMPILE, lin, "linear", "cuda", "-", "load_here", clean=True)
    rc, _ = case("clean fresh load linear", AOTI_LOAD, lin, clean=True)
    if rc < 0 and shutil.which("cuda-gdb"):
        child(root / "cuda-gdb-backtrace.log", AOTI_LOAD, lin, clean=True, timeout=240,
              wrap=["cuda-gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args"])  # fmt: skip
        bt = (root / "cuda-gdb-backtrace.log").read_text().splitlines()
        print("cuda-gdb backtrace (first frames):", *[ln for ln in bt if ln.startswith("#")][:25], sep="\n  ")
    case("clean compile+load no-constants", AOTI_COMPILE, str(root / "sin.pt2"), "sin", "cuda", "-", "load_here", clean=True)
    case("clean compile+load consts-outside", AOTI_COMPILE, str(root / "lin2.pt2"), "linear", "cuda", "constants_outside",
         "load_here", clean=True)  # fmt: skip
    case("clean compile+load cpu linear", AOTI_COMPILE, str(root / "cpu.pt2"), "linear", "cpu", "-", "load_here", clean=True)
    case("site fresh load linear (omni)", AOTI_LOAD, lin, "omni", clean=False)
    sc = root / "sc"
    case("standalone compile flux-tiny", SC_COMPILE, str(sc), "flux-tiny", "64x64", clean=False, timeout=600)
    rc, out = case("standalone load flux-tiny (cold)", SC_LOAD, str(sc), clean=False,
                   env_extra={"TORCHINDUCTOR_CACHE_DIR": str(root / "cold-cache")})  # fmt: skip
    print("-" * 100)
    print(f"{'case':34s} {'rc':>4s}  last line")
    for name, rc, last in rows:
        print(f"{name:34s} {rc:4d}  {last}")
    (root / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
