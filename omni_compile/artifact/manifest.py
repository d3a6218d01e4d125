"""The artifact's `manifest.json`: schema, platform record, checksums and the compatibility check.

docs/artifact.md documents every field. The platform record is what a load compares against the
machine it runs on: the compiled files are machine code for one device kind, compute capability and
set of library versions, so any difference refuses the load (listing every one) unless the caller asks
for a JIT fallback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from omni_compile.errors import OmniCompileError
from omni_compile.platform import Platform

SCHEMA = "omni-compile/artifact/1"
MANIFEST = "manifest.json"
# Platform fields that must be equal for the compiled files to run here, with how a difference reads.
PLATFORM_KEYS = {
    "kind": "device kind",
    "device_name": "device",
    "capability": "compute capability",
    "torch_version": "torch version",
    "triton_version": "Triton version",
    "cuda_version": "CUDA version",
    "hip_version": "HIP version",
}


class ArtifactError(OmniCompileError):
    """An artifact that cannot be used here: corrupt, incomplete, for another platform, or bad weights."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def platform_record(platform: Platform) -> dict[str, Any]:
    return {k: v for k, v in platform.to_json().items() if k in PLATFORM_KEYS or k == "arch"}


def platform_differences(recorded: dict[str, Any], platform: Platform) -> list[str]:
    """Each field of the manifest's platform that differs from `platform`, as 'field: artifact X, here Y'."""
    here = platform_record(platform)
    out = []
    for key, what in PLATFORM_KEYS.items():
        a, b = recorded.get(key), here.get(key)
        if a != b:
            out.append(f"{what}: artifact {a!r}, here {b!r}")
    return out


def weights_summary(model: torch.nn.Module) -> dict[str, list]:
    """name -> [shape, dtype] of every parameter and buffer the artifact's regions read."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = [list(t.shape), str(t.dtype).removeprefix("torch.")]
    return out


def weights_differences(expected: dict[str, list], model: torch.nn.Module, limit: int = 8) -> list[str]:
    """What differs between the manifest's weights summary and `model`'s (missing, unexpected, shape,
    dtype); at most `limit` lines plus a count of the rest."""
    got = weights_summary(model)
    diffs = []
    for name in expected.keys() - got.keys():
        diffs.append(f"missing {name} (expected {expected[name][0]} {expected[name][1]})")
    for name in got.keys() - expected.keys():
        diffs.append(f"unexpected {name} {got[name][0]} {got[name][1]}")
    for name in expected.keys() & got.keys():
        (es, ed), (gs, gd) = expected[name], got[name]
        if es != gs:
            diffs.append(f"{name}: shape {gs}, the artifact was built for {es}")
        elif ed != gd:
            diffs.append(f"{name}: dtype {gd}, the artifact was built for {ed}")
    diffs.sort()
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... and {len(diffs) - limit} more"]
    return diffs


def model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The public fields of a diffusers model's config (`model.config` without `_`-prefixed entries such
    as `_name_or_path`), as JSON values; None for a module without a diffusers config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "items"):
        return None
    public = {k: v for k, v in config.items() if not str(k).startswith("_")}
    return json.loads(json.dumps(public, sort_keys=True, default=str))


def config_differences(recorded: dict[str, Any], model: torch.nn.Module) -> list[str]:
    """Each config field whose value differs between the artifact's model and `model`, as
    'field: artifact X, model Y'. Every public field of a diffusers config sets the architecture
    (sizes, rotary axes, norms, flags), and the compiled regions bake it in: weights of the same shapes
    under another config would run and return wrong numbers. A module without a config is not compared."""
    got = model_config(model)
    if got is None:
        return []
    missing = object()
    out = []
    for key in sorted(recorded.keys() | got.keys()):
        a, b = recorded.get(key, missing), got.get(key, missing)
        if a != b:
            show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
            out.append(f"{key}: artifact {show(a)}, model {show(b)}")
    return out


# ------------------------------------------------------------------ the typed manifest


def _record(cls, data: Any, where: str):
    """`cls` (a dataclass) from its JSON object: an unknown field or a missing required one is an error naming it."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{where} must be a JSON object, not {type(data).__name__}; the artifact is corrupt, rebuild it")
    fields = {f.metadata.get("json", f.name): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ArtifactError(f"{where} has unknown field(s) {unknown} (written by a newer omni-compile?); rebuild the "
                            "artifact with this one")  # fmt: skip
    values = {}
    for key, f in fields.items():
        if key in data:
            values[f.name] = f.metadata.get("read", lambda v, w: v)(data[key], f"{where}.{key}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ArtifactError(f"{where} has no field {key!r} (the artifact was built by an older omni-compile); "
                                "rebuild it")  # fmt: skip
    return cls(**values)


def _json(record) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.metadata.get("optional") and value is None:
            continue
        out[f.metadata.get("json", f.name)] = f.metadata.get("write", lambda v: v)(value)
    return out


def _field(json_name: str | None = None, read=None, write=None, optional: bool = False, **kwargs):
    meta = {k: v for k, v in (("json", json_name), ("read", read), ("write", write)) if v is not None}
    if optional:
        meta["optional"] = True
        kwargs.setdefault("default", None)
    return dataclasses.field(metadata=meta, **kwargs)


@dataclasses.dataclass(frozen=True)
class CompiledFileEntry:
    """One compiled file of a region: the call signature it serves and how to check and load it."""

    signature: str
    call: str  # readable: the call's shapes and values
    key: list  # the full call signature
    file: str  # relative to the artifact
    sha256: str
    graph_hash: str
    instances: list[str]  # module paths whose calls it serves
    passes: dict[str, int]
    compile_seconds: float
    cache_key: str | None
    region_identity: str | None
    source: str  # "compiled" or "store"
    pytree: dict[str, str] | None = _field(optional=True)  # inductor-standalone: input and output tree specs
    dynamic: dict[str, Any] | None = _field(optional=True)  # build --dynamic: symbolic dims (artifact.dynamic)


def _files(value, where):
    return {b: [_record(CompiledFileEntry, e, f"{where}[{b!r}][{i}]") for i, e in enumerate(es)]
            for b, es in value.items()}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RegionEntry:
    """A region (a block class, or a piece of glue) with its compiled files per bucket."""

    name: str
    kind: str  # "block" or "glue"
    cls: str = _field("class")
    instances: list[str] = _field()
    buckets: dict[str, list[CompiledFileEntry]] = _field(read=_files, write=lambda v: {
        b: [_json(e) for e in es] for b, es in v.items()})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    source: str  # "preset:NAME", a directory, or "module:Class"
    family: str
    cls: str = _field("class")
    config: dict[str, Any] = _field()  # every public field of the built model's diffusers config
    config_hash: str = _field()


@dataclasses.dataclass(frozen=True)
class BuildRecord:
    mode: str
    format: str  # the compiled-file format (artifact.aot.FORMATS)
    region_call: str  # how a compiled region is called (aot.REGION_CALL)
    dtype: str
    device: str
    buckets: list[str]
    text_len: int | None
    seed: int  # of the random weights and the example inputs
    example_inputs: str | None  # module:function for a model with no adapter
    compile_config: dict[str, Any]
    compile_config_hash: str
    dynamic: dict[str, Any] | None = _field(optional=True)  # build --dynamic: min, max, step, checked sizes

    @property
    def dynamic_range(self):
        """The `config.DynamicRange` of a --dynamic build, else None."""
        from omni_compile.config import DynamicRange

        return DynamicRange.from_json(self.dynamic)


def _regions(value, where):
    return [_record(RegionEntry, r, f"{where}[{i}]") for i, r in enumerate(value)]


@dataclasses.dataclass
class Manifest:
    """`manifest.json`, read and checked once (`read_manifest`); docs/artifact.md documents every field."""

    schema: str
    omni_compile_version: str
    created: str
    model: ModelRecord = _field(read=lambda v, w: _record(ModelRecord, v, w), write=_json)
    weights: dict[str, Any] = _field()  # reference, seed or files, tensors: name -> [shape, dtype]
    build: BuildRecord = _field(read=lambda v, w: _record(BuildRecord, v, w), write=_json)
    platform: dict[str, Any] = _field()  # the build machine (platform_record)
    pass_uuid: str = _field()
    regions: list[RegionEntry] = _field(read=_regions, write=lambda v: [_json(r) for r in v])
    attention: dict[str, Any] = _field()  # config, per_role, backends
    fusion: dict[str, Any] = _field()  # passes, matches, fused_op_implementations
    parity: dict[str, Any] = _field()  # bucket -> the check against eager
    timing: dict[str, Any] = _field()
    compilations: dict[str, int] = _field()
    store: dict[str, Any] | None = _field(optional=True)  # --store: hits, misses, published

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST) -> Manifest:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ArtifactError(f"{where}: schema {got!r}, this omni-compile reads {SCHEMA!r}; rebuild the artifact")
        return _record(cls, data, where)

    def to_json(self) -> dict[str, Any]:
        return _json(self)

    def files(self) -> list[CompiledFileEntry]:
        """Every compiled file, once each."""
        seen: dict[str, CompiledFileEntry] = {}
        for region in self.regions:
            for entries in region.buckets.values():
                for entry in entries:
                    seen.setdefault(entry.file, entry)
        return list(seen.values())


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root} is not an artifact directory (expected a directory written by `omni-compile build`)")
    if not path.is_file():
        raise ArtifactError(f"{root}: no {MANIFEST}; not an omni-compile artifact, or an incomplete copy")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); the artifact is corrupt, rebuild it") from None
    return Manifest.from_json(data, str(path))


def verify_files(root: Path, manifest: Manifest) -> None:
    """Refuse when a listed file is missing or its sha256 differs (naming the file)."""
    for entry in manifest.files():
        path = root / entry.file
        if not path.is_file():
            raise ArtifactError(f"{root}: compiled file {entry.file} is missing; the artifact is incomplete, rebuild it")
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise ArtifactError(
                f"{root}: compiled file {entry.file} fails its checksum (sha256 {digest[:16]}..., manifest "
                f"{entry.sha256[:16]}...); the file was changed or corrupted, rebuild the artifact"
            )
