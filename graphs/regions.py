"""Find the regions of a model: its repeated block classes, grouped by structure.

A region is one block class whose instances share structure: the same module tree, the same
parameter names, shapes and dtypes, the same source code, and the same plain attributes (eps, heads, flags)
where the code of their classes reads them (an attribute no code reads, a block's index, does not count). It is traced once per shape bucket
with its parameters as graph inputs, so one compiled graph serves every instance. Instances of one
class that differ in structure (a block built with another config) form separate regions,
`Class#1`, `Class#2`, and the discovery says so.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from omni_compile.errors import OmniCompileError

logger = logging.getLogger("omni_compile.graphs")


@dataclass
class Region:
    name: str
    cls: type
    structure_hash: str
    instances: list[tuple[str, nn.Module]] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self.instances]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "class": f"{self.cls.__module__}.{self.cls.__qualname__}",
            "structure_hash": self.structure_hash,
            "instances": self.paths,
        }


@functools.cache
def _class_source_hash(cls: type) -> str:
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        src = f"{cls.__module__}.{cls.__qualname__}"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


@functools.cache
def _names_read_in(path: str | None) -> frozenset[str] | None:
    """Every name a Python source file reads as an attribute (`x.NAME`) or spells as a string (`getattr(x, "NAME")`);
    None when the file cannot be read or parsed (then nothing is known to be unread)."""
    if path is None:
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return frozenset(names)


def _attributes_read(module: nn.Module) -> frozenset[str] | None:
    """The attribute names the code of `module` could read: those read anywhere in the source files of its classes
    (torch's Module aside) and of its attention processor's. None: a file could not be read (assume all are)."""
    processor = getattr(module, "processor", None)
    return _attributes_read_by(type(module), type(processor) if processor is not None else None)


@functools.cache
def _attributes_read_by(cls: type, processor_cls: type | None) -> frozenset[str] | None:
    # per class pair, not per instance: a model's blocks share a handful of classes
    classes = [c for c in cls.__mro__ if c not in (nn.Module, object)]
    if processor_cls is not None:
        classes += [c for c in processor_cls.__mro__ if c is not object]
    names: set[str] = set()
    for c in classes:
        try:
            read = _names_read_in(inspect.getsourcefile(c))
        except TypeError:  # a built-in class
            read = None
        if read is None:
            return None
        names |= read
    return frozenset(names)


def structure_signature(module: nn.Module) -> list:
    """Everything about a block that its traced graph depends on, except the tensor values."""
    sig = []
    for path, sub in module.named_modules():
        entry = [path, f"{type(sub).__module__}.{type(sub).__qualname__}", _class_source_hash(type(sub))]
        for name, t in list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False)):
            entry.append([name, list(t.shape), str(t.dtype), t.device.type])
        # Plain attributes steer control flow inside forward (eps, heads, flags); include the simple ones that its code
        # reads. One that no code of its classes reads (a block's index kept for logging, as Z-Image's `layer_id`)
        # cannot change the graph, and would make every instance a region of its own.
        read = _attributes_read(sub)
        attrs = {
            k: v
            for k, v in vars(sub).items()
            if not k.startswith("_")
            and isinstance(v, (bool, int, float, str, tuple, type(None)))
            and (read is None or k in read)
        }
        entry.append(sorted((k, repr(v)) for k, v in attrs.items()))
        procs = getattr(sub, "processor", None)
        if procs is not None:
            entry.append(f"processor={type(procs).__qualname__}")
        sig.append(entry)
    return sig


def _hash(sig: list) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()


def discover_block_classes(model: nn.Module) -> list[str]:
    """The block classes of a model that declares none: the classes of its `nn.ModuleList`s (at any depth)
    whose two or more entries are all of one class, in model order. A list inside an instance of another
    such class is part of that block, not a region of its own."""
    lists: dict[str, list[str]] = {}  # class name -> paths of its lists
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            lists.setdefault(type(module[0]).__name__, []).append(path)
    instances = {name: [p for p, m in model.named_modules() if type(m).__name__ == name] for name in lists}

    def nested(path: str, name: str) -> bool:
        return any(path.startswith(p + ".") for other, ps in instances.items() if other != name for p in ps)

    return [name for name, paths in lists.items() if not all(nested(p, name) for p in paths)]


def block_class_names(model: nn.Module, declared: list[str] | None = None) -> list[str]:
    """The region classes: `declared` (an option), else the model's `_repeated_blocks`, else the classes of
    its lists of identical blocks (`discover_block_classes`)."""
    names = list(declared or getattr(model, "_repeated_blocks", None) or discover_block_classes(model))
    if not names:
        raise OmniCompileError(
            f"found no repeated blocks in {type(model).__name__}: it declares no `_repeated_blocks` and holds no "
            "nn.ModuleList of two or more modules of one class. Name its block classes: --regions Class1,Class2 "
            "(build, inspect), omni_compile.compile(model, regions=[...]), or `_repeated_blocks` on the class"
        )
    return names


def find_regions(model: nn.Module, block_names: list[str] | None = None) -> list[Region]:
    names = block_class_names(model, block_names)
    by_key: dict[tuple[str, str], Region] = {}
    variants: dict[str, int] = {}
    for path, module in model.named_modules():
        cls_name = type(module).__name__
        if cls_name not in names:
            continue
        # A block nested inside another region block is compiled as part of the outer one.
        if any(path.startswith(p + ".") for r in by_key.values() for p in r.paths):
            continue
        h = _hash(structure_signature(module))
        key = (cls_name, h)
        if key not in by_key:
            variants[cls_name] = variants.get(cls_name, 0) + 1
            by_key[key] = Region(name=cls_name, cls=type(module), structure_hash=h)
        by_key[key].instances.append((path, module))
    missing = [n for n in names if n not in variants]
    if len(missing) == len(names):
        raise OmniCompileError(
            f"none of the block classes {names} occurs in {type(model).__name__}; check the class names "
            f"(its lists of identical blocks hold {discover_block_classes(model) or 'none'})"
        )
    regions = list(by_key.values())
    for cls_name, count in variants.items():
        if count > 1:
            group = [r for r in regions if r.name == cls_name]
            for i, r in enumerate(group, 1):
                r.name = f"{cls_name}#{i}"
            logger.warning("%s instances differ in structure: compiled as %d separate regions", cls_name, count)
    return regions


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
