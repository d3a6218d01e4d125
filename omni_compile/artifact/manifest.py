"""The artifact's `manifest.json`: schema, platform record, checksums and the compatibility check.

docs/artifact.md documents every field. The platform record is what a load compares against the
machine it runs on: the compiled files are machine code for one device kind, compute capability and
set of library versions, so any difference refuses the load (listing every one) unless the caller asks
for a JIT fallback.
"""

from __future__ import annotations

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


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(f"{root} is not an artifact directory (expected a directory written by `omni-compile build`)")
    if not path.is_file():
        raise ArtifactError(f"{root}: no {MANIFEST}; not an omni-compile artifact, or an incomplete copy")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); the artifact is corrupt, rebuild it") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{path}: schema {got!r}, this omni-compile reads {SCHEMA!r}; rebuild the artifact")
    return manifest


def artifact_files(manifest: dict[str, Any]) -> list[dict[str, str]]:
    """Every compiled file the manifest lists, once each: {"file", "sha256", ...}."""
    seen: dict[str, dict] = {}
    for region in manifest.get("regions", []):
        for entries in region.get("buckets", {}).values():
            for entry in entries:
                seen.setdefault(entry["file"], entry)
    return list(seen.values())


def verify_files(root: Path, manifest: dict[str, Any]) -> None:
    """Refuse when a listed file is missing or its sha256 differs (naming the file)."""
    for entry in artifact_files(manifest):
        path = root / entry["file"]
        if not path.is_file():
            raise ArtifactError(f"{root}: compiled file {entry['file']} is missing; the artifact is incomplete, rebuild it")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ArtifactError(
                f"{root}: compiled file {entry['file']} fails its checksum (sha256 {digest[:16]}..., manifest "
                f"{entry['sha256'][:16]}...); the file was changed or corrupted, rebuild the artifact"
            )
