"""Which AOTInductor CUDA packages load on this machine? Each load runs in its own subprocess (a crash there
names the case and the rest go on). Cases: a stock nn.Linear package; the same exported with its weights as
inputs (our `_Functional`); that plus our pass manager as Inductor's post-grad pass; then every package of
flux-tiny's 64x64 bucket (bench/diag_aoti.py compile). Each load: CUDA initialised first or not.

    python bench/diag_aoti2.py DIR
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LOAD = r"""
import sys, torch
import omni_compile  # registers our ops
from omni_compile.artifact.loader import load_package
path, init, kind = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
if init:
    torch.cuda.init(); torch.zeros(1, device="cuda")
r = load_package(path, kind)
print("loaded", flush=True)
if len(sys.argv) > 4:
    d = torch.load(sys.argv[4], weights_only=False)
    out = r(d["state"], d["args"], d["kwargs"]) if "state" in d else r(*d["args"])
    torch.cuda.synchronize()
    print("ran", flush=True)
"""


def main() -> int:
    import torch
    from torch import nn

    from omni_compile.artifact import aot
    from omni_compile.builder import BuildOptions, resolve_build

    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[2] == "--loads-only":  # packages from an earlier run of this script
        return loads(_cases(root))
    cases = []
    m = nn.Linear(64, 64).cuda().bfloat16()
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ep = torch.export.export(m, (x,))
    p = torch._inductor.aoti_compile_and_package(ep, package_path=str(root / "linear.pt2"))
    torch.save({"args": (x,)}, root / "linear.inputs")
    cases.append(("stock linear", p, root / "linear.inputs"))
    state = aot.module_state(m)
    with torch.no_grad():
        ep = torch.export.export(aot._Functional(m), (state, (x,), {}), strict=False)
    p = torch._inductor.aoti_compile_and_package(ep, package_path=str(root / "functional.pt2"))
    torch.save({"state": state, "args": (x,), "kwargs": {}}, root / "functional.inputs")
    cases.append(("functional linear", p, root / "functional.inputs"))
    *_, pm = resolve_build(BuildOptions(model="flux-tiny", shapes="64x64", dtype="bf16", device="cuda"))
    p = torch._inductor.aoti_compile_and_package(ep, package_path=str(root / "functional_pm.pt2"),
                                                 inductor_configs={"post_grad_custom_post_pass": pm})  # fmt: skip
    cases.append(("functional linear + pass manager", p, root / "functional.inputs"))
    print("compiled the linear cases", flush=True)
    tiny = root / "tiny"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("diag_aoti.py")), "compile", str(tiny)],
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    print("tiny compile rc", proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:] if proc.returncode else "",
          flush=True)  # fmt: skip
    return loads(_cases(root))


def _cases(root: Path) -> list:
    import json

    cases = [("stock linear", root / "linear.pt2", root / "linear.inputs"),
             ("functional linear", root / "functional.pt2", root / "functional.inputs"),
             ("functional linear + pass manager", root / "functional_pm.pt2", root / "functional.inputs")]  # fmt: skip
    tiny = root / "tiny"
    if (tiny / "index.json").exists():
        for e in json.loads((tiny / "index.json").read_text()):
            cases.append((f"flux-tiny {e['name']}", tiny / e["file"], tiny / f"{e['name']}-{e['sig']}.inputs"))
    return [c for c in cases if Path(c[1]).exists()]


def loads(cases: list) -> int:
    rows = []
    for name, path, inputs in cases:
        for init in ("1", "0"):
            for kind in ("cuda", "cpu"):  # cuda: our direct loader; cpu: aoti_load_package
                if init == "0" and (name.startswith("flux-tiny") or kind == "cpu"):
                    continue
                r = subprocess.run([sys.executable, "-P", "-X", "faulthandler", "-c", LOAD, str(path), init, kind, str(inputs)],
                                   capture_output=True, text=True, timeout=120)  # fmt: skip
                status = "ran" if "ran" in r.stdout else ("loaded, run failed" if "loaded" in r.stdout else "load failed")
                rows.append((name, init, kind, r.returncode, status))
                print(f"{name:<45} cuda_init={init} loader={'direct' if kind == 'cuda' else 'public'} rc={r.returncode} "
                      f"{status}", flush=True)  # fmt: skip
                if r.returncode != 0:
                    print("   " + "\n   ".join(r.stderr.strip().splitlines()[-6:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
