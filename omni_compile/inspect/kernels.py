"""The kernels of one compiled region, read from Inductor's output code.

Inductor's Python wrapper declares each generated kernel as `NAME = async_compile.triton('NAME', '''SRC''')`
(GPU) or `async_compile.cpp_pybinding([...], '''SRC''')` (CPU) and calls it from `call()`, next to extern
calls (`extern_kernels.mm`, `torch.ops.aten._scaled_dot_product_cudnn_attention.default`, ...). Our fused
ops' and attention's Triton kernels are user kernels Inductor embeds the same way, under their own names.
AOTInductor's C++ wrapper calls `aoti_torch_DEVICE_OP(...)` shims and `cpp_fused_*` functions.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from omni_compile.inspect.categories import kernel_category

_DECL = re.compile(r"^(\w+) = async_compile\.(triton|cpp_pybinding|cpp|cuda|rocm)\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_TORCH_OP = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.\w+\(")
_AOTI_SHIM = re.compile(r"\baoti_torch_(?:cpu|cuda|xpu)_(\w+)\(")
_CPP_DEF = re.compile(r"^(?:extern \"C\"\s+)?void (cpp_fused_\w+)\(", re.M)
_TRITON_LAUNCH = re.compile(r"\b(triton_\w+|_\w+_kernel(?:_\d+)?)\.run\(|\"(triton_\w+|_\w+_kernel\w*)\"")
# Ops in the wrapper that are bookkeeping, not kernels.
_NOT_KERNELS = ("assert_size_stride", "assert_alignment", "empty_strided", "reinterpret_tensor")


def _source_after(code: str, pos: int) -> str:
    start = code.find("'''", pos)
    if start < 0:
        return ""
    end = code.find("'''", start + 3)
    return code[start + 3 : end if end > 0 else len(code)]


def _kernel_name(code: str, var: str, kind: str, pos: int) -> str:
    if kind == "triton":
        m = re.match(r"\s*'(\w+)'", code[pos:])
        if m:
            return m.group(1)
    return var


def parse_output_code(code: str) -> dict:
    """Generated kernels (name, language, category, source, calls) and extern calls of one output code."""
    if code.startswith('r"""'):  # CUDA: a leading docstring replays the kernels for compile-time autotuning
        end = code.find('"""', 4)
        code = code[end + 3 :] if end > 0 else code
    body_start = code.find("def call(")
    body = code[body_start:] if body_start >= 0 else code
    generated = []
    for m in _DECL.finditer(code):
        var, kind = m.groups()
        name = _kernel_name(code, var, kind, m.end())
        src = _source_after(code, m.end())
        calls = len(re.findall(rf"\b{re.escape(var)}(?:\.run)?\(", body))
        lang = "triton" if kind == "triton" else "cpp" if kind.startswith("cpp") else kind
        user = lang == "triton" and not name.startswith("triton_")
        generated.append({"name": var, "kernel": name, "language": lang, "user_kernel": user,
                          "category": kernel_category(name), "calls": calls, "source": src})  # fmt: skip
    declared = bool(generated)
    for name in _CPP_DEF.findall(code):  # AOTInductor C++
        if not any(k["name"] == name for k in generated):
            generated.append({"name": name, "kernel": name, "language": "cpp", "user_kernel": False,
                              "category": "triton",
                              "calls": max(len(re.findall(rf"\b{name}\(", code)) - 1, 0), "source": ""})  # fmt: skip
    for a, b in [] if declared else _TRITON_LAUNCH.findall(code):  # AOTInductor CUDA: launched by name
        name = a or b
        if name and not any(k["name"] == name for k in generated):
            generated.append({"name": name, "kernel": name, "language": "triton",
                              "user_kernel": not name.startswith("triton_"),
                              "category": kernel_category(name), "calls": 1, "source": ""})  # fmt: skip
    extern: Counter = Counter()
    for name in _EXTERN.findall(body):
        extern[f"extern_kernels.{name}"] += 1
    for ns, op in _TORCH_OP.findall(body):
        extern[f"{ns}.{op}"] += 1
    for op in _AOTI_SHIM.findall(code):
        if not op.startswith(_NOT_KERNELS):
            extern[f"aten.{op}"] += 1
    externs = [{"name": n, "calls": c, "category": kernel_category(n)} for n, c in extern.most_common()]
    return {"generated": generated, "extern": externs}


def read_kernels(directory: Path) -> dict:
    """The kernels of the output code files in a region's dump directory, with counts per category."""
    files = sorted(directory.glob("output_code.*"), key=lambda p: int(p.name.split(".")[1]))
    generated: list[dict] = []
    extern: Counter = Counter()
    for f in files:
        parsed = parse_output_code(f.read_text(errors="replace"))
        seen = {k["name"] for k in generated}
        generated += [k for k in parsed["generated"] if k["name"] not in seen]
        for e in parsed["extern"]:
            extern[e["name"]] += e["calls"]
    externs = [{"name": n, "calls": c, "category": kernel_category(n)} for n, c in extern.most_common()]
    by_cat: Counter = Counter()
    for k in generated:
        by_cat[k["category"]] += max(k["calls"], 1)
    for e in externs:
        by_cat[e["category"]] += e["calls"]
    return {
        "output_code_files": [f.name for f in files],
        "generated": generated,
        "extern": externs,
        "calls_by_category": dict(by_cat.most_common()),
    }
