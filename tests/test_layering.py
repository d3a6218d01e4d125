"""The import graph, read from the source: no cycle between modules, no arrow up the layer table of
docs/architecture.md, no private name imported from another package. Imports inside functions count:
they are dependencies too, taken later."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The source folders and the package each installs as (pyproject.toml's package-dir).
PACKAGES = {"omni_compile": "omni_compile", "graphs": "omni_compile.graphs", "passes": "omni_compile.passes",
            "models": "omni_compile.models", "server": "omni_compile.server"}  # fmt: skip


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, imported name or '')} for every omni_compile import, anywhere in it."""
    out = {}
    for mod, f in mods.items():
        found = set()
        package = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.startswith("omni_compile")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("omni_compile"):
                    for a in node.names:
                        sub = f"{target}.{a.name}"
                        found.add((sub, "") if sub in mods else (target, a.name))
        out[mod] = {(t, n) for t, n in found if t != mod}
    return out


def layers() -> dict[str, int]:
    """Module prefix -> layer, from the table under '## Layers' in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Layers", 1)[1]
    table = {}
    for row in re.finditer(r"^\| (\d+) \| (.+?) \|", text, re.MULTILINE):
        for prefix in re.findall(r"`([\w.]+)`", row.group(2)):
            table[prefix] = int(row.group(1))
    return table


def layer_of(mod: str, table: dict[str, int]) -> int:
    prefixes = [p for p in table if mod == p or mod.startswith(p + ".")]
    assert prefixes, f"{mod} is in no row of the layer table in docs/architecture.md"
    return table[max(prefixes, key=len)]


def test_no_cycle_between_modules():
    mods = modules()
    graph = {m: {t for t, _ in deps if t in mods} for m, deps in imports(mods).items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_go_down_the_layer_table():
    mods, table = modules(), layers()
    assert len(table) >= 15
    wrong = []
    for mod, deps in imports(mods).items():
        for target, _ in deps:
            if layer_of(target, table) > layer_of(mod, table):
                wrong.append(f"{mod} (layer {layer_of(mod, table)}) imports {target} (layer {layer_of(target, table)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_private_name_from_another_package():
    mods = modules()
    wrong = []
    for mod, deps in imports(mods).items():
        package = mod if mods[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]
        for target, name in deps:
            owner = target if target in mods and mods[target].name == "__init__.py" else target.rsplit(".", 1)[0]
            private = name.startswith("_") or target.rsplit(".", 1)[-1].startswith("_") and not name
            if private and owner != package and target.rsplit(".", 1)[0] != package:
                wrong.append(f"{mod} imports {target}{'.' + name if name else ''}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_checks_see_real_arrows():
    """The graph holds what the code imports (top-level and inside functions, absolute and relative), and every
    module has a layer."""
    mods = modules()
    deps = imports(mods)
    assert ("omni_compile.build.pipeline", "BuildPipeline") in deps["omni_compile.builder"]  # top-level
    assert ("omni_compile.compiler", "compile") in deps["omni_compile.build.compilers.jit"]  # inside a function
    table = layers()
    assert all(layer_of(m, table) is not None for m in mods)
    assert layer_of("omni_compile.cache.command", table) == 14 and layer_of("omni_compile.cache.store", table) == 7
    assert layer_of("omni_compile.errors", table) < layer_of("omni_compile.cli", table)
