"""`omni_compile.load(ARTIFACT, weights=...)`: a model whose regions run the artifact's compiled files.

Before anything runs: the manifest's schema, the platform (device kind and name, compute capability,
torch/Triton/CUDA/HIP versions; every difference is listed), the sha256 of every compiled file, and the
weights against the manifest's tensor summary (names, shapes, dtypes). Then each instance's `forward` is
pointed at a dispatcher that picks the package compiled for the call's signature and passes the
instance's own parameters and buffers. Nothing is traced or compiled: AOTInductor packages are mapped
by AOTInductor's loader, Inductor standalone files (the CUDA default) by `CompiledArtifact.load`, which
reads their compiled Triton kernels (`aot.FORMATS`). On CUDA the whole forward is then wrapped in `CudaGraphForward`
(one graph per bucket, captured on the first call), unless `cuda_graphs=False`.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_compile.artifact import aot
from omni_compile.artifact.dynamic import DynamicSpec
from omni_compile.artifact.manifest import (
    ArtifactError,
    Manifest,
    config_differences,
    platform_differences,
    read_manifest,
    verify_files,
    weights_differences,
)
from omni_compile.config import parse_dtype
from omni_compile.platform import current_platform

logger = logging.getLogger("omni_compile.artifact")


class RegionDispatch:
    """Installed as `instance.forward`: runs the package compiled for this call's signature, or the one compiled
    with symbolic sizes (`build --dynamic`) whose family the call belongs to (`artifact.dynamic.DynamicSpec`)."""

    def __init__(self, name: str, module: nn.Module, runners: dict[tuple, Any], buckets: list[str], stats: dict,
                 dynamic: list[tuple] = (), sizes: str = ""):  # fmt: skip
        self.name = name
        self.module = module
        self.runners = runners  # call key -> runner (shared by the region's instances; dynamic matches are added)
        self.dynamic = dynamic  # (DynamicSpec, example key, runner) per file with symbolic sizes
        self.buckets = buckets
        self.sizes = sizes  # "and every size of 512-1536:64" for a --dynamic artifact
        self.stats = stats
        self.state = aot.module_state(module)  # the instance's tensors, read at call time through the dict

    def __call__(self, *args, **kwargs):
        args, kwargs = aot.canonical_call(args, kwargs, aot.module_device(self.module))
        key = aot.call_key(args, kwargs)
        runner = self.runners.get(key)
        if runner is None:
            runner = next((r for spec, example, r in self.dynamic if spec.matches(example, key)), None)
            if runner is not None:
                self.runners[key] = runner  # once per size: later calls are a dict lookup
        if runner is None:
            raise ArtifactError(
                f"region {self.name}: no compiled file for this call ({aot.describe_key(key)}); the artifact "
                f"holds the shape buckets {', '.join(self.buckets)}{self.sizes}. Call the model at one of them, or "
                "rebuild with the shape added to --shapes (or load with jit_fallback=True)"
            )
        self.stats["compiled_calls"] = self.stats.get("compiled_calls", 0) + 1
        return runner(self.state, aot.tensor_leaves(args, kwargs))


@dataclass
class Installed:
    """What `install` changed on a model, so that the build's parity check can undo it."""

    model: nn.Module
    manifest: Manifest
    root: Path
    modules: list[nn.Module] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # where the load's time went: check, weights_check, packages
    cuda_graphs: Any = None

    def uninstall(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        if self.cuda_graphs is not None:
            self.model.__dict__.pop("forward", None)
        self.modules.clear()


class Preload:
    """The artifact's compiled files loaded on a background thread (`preload`), while the caller does other work
    (reading or making the weights: the weights check needs them, the files do not). `install` takes each file
    from here, waiting for it; a file that failed to load raises its error there, in the caller's thread."""

    def __init__(self, root: Path, manifest: Manifest):
        from concurrent.futures import ThreadPoolExecutor

        self.root = root
        # one thread, in the manifest's order (the order `install` asks for them); it ends after the last file
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-preload")
        fmt = manifest.build.format
        self._files = {e.file: pool.submit(load_package, root / e.file, fmt, e.pytree) for e in manifest.files()}
        pool.shutdown(wait=False)

    def get(self, file: str):
        """The loaded file (waits for it)."""
        if file not in self._files:
            raise KeyError(f"{file} is not a file of {self.root}")
        return self._files[file].result()


def preload(artifact: str | Path, checked: tuple[Manifest, list[str]]) -> Preload | None:
    """Start loading the compiled files of a checked artifact (`check`'s result) on a background thread; pass
    the result to `load(..., preloaded=)`. None when there is nothing to load (a platform mismatch: JIT)."""
    manifest, diffs = checked
    return None if diffs else Preload(Path(artifact), manifest)


def install(model: nn.Module, manifest: Manifest, root: Path, preloaded: Preload | None = None) -> Installed:
    """Load every package the manifest lists (or take it from `preloaded`) and point each instance's forward at
    its dispatcher."""
    installed = Installed(model, manifest, root)
    modules = dict(model.named_modules())
    buckets = list(manifest.build.buckets)
    dynamic_range = manifest.build.dynamic_range
    sizes = f" and every size of {dynamic_range} (HEIGHTxWIDTH)" if dynamic_range else ""
    missing = [(p, r.name) for r in manifest.regions for p in r.instances if p not in modules]
    if missing:
        path, region = missing[0]
        raise ArtifactError(f"the model has no module {path!r}, which the artifact's region {region} runs")
    # every file first: a file that fails to load leaves the model as it was
    loaded = {e.file: preloaded.get(e.file) if preloaded is not None
              else load_package(root / e.file, manifest.build.format, e.pytree) for e in manifest.files()}  # fmt: skip
    for region in manifest.regions:
        runners: dict[tuple, Any] = {}
        dynamic: dict[str, tuple] = {}
        for entries in region.buckets.values():
            for e in entries:
                runners[_as_key(e.key)] = loaded[e.file]
                if e.dynamic and e.file not in dynamic:
                    dynamic[e.file] = (DynamicSpec.from_json(e.dynamic), _as_key(e.key), loaded[e.file])
        for path in region.instances:
            m = modules[path]
            m.forward = RegionDispatch(region.name, m, runners, buckets, installed.stats, list(dynamic.values()), sizes)
            installed.modules.append(m)
    installed.stats["packages"] = len(loaded)
    return installed


def load_package(path: Path, fmt: str = "aoti-package", specs: dict[str, str] | None = None):
    """One compiled file, loaded without Dynamo and without compiling, as a callable (state, args, kwargs).

    An `inductor-standalone` file is loaded with `CompiledArtifact.load` and called through
    `aot.StandaloneRunner` (its tree specs, `specs`, come from the manifest; without them, as in the
    child-process probe, the raw artifact is returned).

    This calls AOTInductor's loader directly: `aoti_load_package` first compares the package's host
    metadata with this machine, which probes the CPU's vector ISA (about 0.1 s per file on the 2-core CPU,
    0.5 s and more with a cold cache) only to log a warning; our manifest check has already compared the
    platform (a CPU package's device name is the CPU's model, whose ISA its kernels were built for).
    """
    if fmt == "inductor-standalone":
        artifact = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
        return aot.StandaloneRunner(artifact, specs) if specs else artifact
    if fmt != "aoti-package":
        raise ArtifactError(f"{path}: unknown compiled-file format {fmt!r}; this omni-compile reads {', '.join(aot.FORMATS)}")
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except (ImportError, AttributeError, TypeError) as e:  # another torch's internals: the public path
        logger.debug("direct AOTInductor load unavailable (%s); using aoti_load_package", e)
    else:
        return AOTICompiledModel(loader)
    return torch._inductor.aoti_load_package(str(path))


_PROBE = r"""
import sys
from pathlib import Path
import omni_compile  # registers our ops, as a real load does
from omni_compile.artifact.loader import load_package
root, fmt = Path(sys.argv[1]), sys.argv[2]
for rel in sys.argv[3:]:
    print("loading " + rel, flush=True)
    load_package(root / rel, fmt)
print("all loaded", flush=True)
"""


def probe_load(root: Path, manifest: Manifest, timeout: float = 600, only: set[str] | None = None) -> None:
    """Load every compiled file of the artifact in a child process first: a package that crashes the
    loader (a native fault inside AOTInductor, which no Python error handler can catch) then fails this
    call with the file's name instead of killing the caller. Costs one Python start (a few seconds)."""
    import signal
    import subprocess
    import sys

    files = [e.file for e in manifest.files() if only is None or e.file in only]
    try:
        proc = subprocess.run([sys.executable, "-P", "-c", _PROBE, str(root), manifest.build.format, *files],
                              capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ArtifactError(f"loading the compiled files of {root} did not finish in {timeout:.0f} s (in a child process)") from None
    if proc.returncode == 0 and "all loaded" in proc.stdout:
        return
    current = [ln[len("loading "):] for ln in proc.stdout.splitlines() if ln.startswith("loading ")]
    where = f" while loading {current[-1]}" if current else ""
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        cause = f"the loader crashed ({name}){where}"
    else:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no error output"]
        cause = f"loading failed{where}: {tail[0]}"
    raise ArtifactError(
        f"{root}: {cause}. The compiled files cannot be loaded by this torch "
        f"({torch.__version__}) on this machine; nothing was run in this process. Rebuild the artifact here, "
        "or use --mode jit (a JIT build) on this machine"
    )


def _as_key(value: Any) -> tuple:
    """The call key stored in JSON (lists) back as the tuple `aot.call_key` makes."""
    if isinstance(value, list):
        return tuple(_as_key(v) for v in value)
    return value


def _model_for(manifest: Manifest, weights, device: str, dtype: torch.dtype) -> nn.Module:
    """The model to load the artifact into: `weights` itself (a module), a diffusers directory, or, for an
    artifact built with seeded random weights (a preset or module:Class), the same model made again."""
    from omni_compile.models import resolve_model

    if isinstance(weights, nn.Module):
        return weights
    source = manifest.model.source
    if weights is None:
        seed = manifest.weights.get("seed")
        if seed is None:
            raise ArtifactError(
                f"the artifact was built from the weights in {source}; pass them: weights= (the loaded transformer "
                "or its directory), or --weights DIR on the command line"
            )
        spec = resolve_model(source.removeprefix("preset:"), model_config=manifest.model.config)
        return spec.load(dtype=dtype, device=device, seed=seed)
    spec = resolve_model(str(weights))
    return spec.load(dtype=dtype, device=device)


def _adapter_for(manifest: Manifest, model: nn.Module, example_inputs: str | None):
    """The adapter that makes the example inputs `verify` runs: the family's, or for a model with no
    adapter one around the example-input function the build recorded (or `example_inputs`)."""
    from omni_compile.models import ADAPTERS
    from omni_compile.models.generic import GenericAdapter
    from omni_compile.models.registry import import_object

    family = manifest.model.family
    if family in ADAPTERS:
        return ADAPTERS[family]
    ref = example_inputs or manifest.build.example_inputs
    if not ref:
        raise ArtifactError(
            f"{manifest.model.source} has no adapter and the artifact records no example-input function; "
            "pass example_inputs= (--example-inputs module:function), the function the build used"
        )
    return GenericAdapter(type(model), import_object(ref, "--example-inputs"))


def check(
    artifact: str | Path, *, device: str | None = None, jit_fallback: bool = False
) -> tuple[Manifest, list[str]]:
    """Read the manifest, compare the platform and, when it matches, every file's sha256; returns
    (manifest, platform differences). A difference refuses the artifact unless `jit_fallback`."""
    root = Path(artifact)
    manifest = read_manifest(root)
    call = manifest.build.region_call
    if call != aot.REGION_CALL:
        raise ArtifactError(
            f"{root}: its compiled regions are called as {call}, this omni-compile calls them as {aot.REGION_CALL} "
            "(the artifact was built by an older omni-compile); rebuild it"
        )
    device = device or manifest.build.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        diffs = [f"device kind: artifact {manifest.platform.get('kind')!r}, here no CUDA GPU"]
    else:
        diffs = platform_differences(manifest.platform, current_platform(device))
    if diffs and not jit_fallback:
        raise ArtifactError(
            f"{root} was built for another platform: " + "; ".join(diffs)
            + ". Rebuild it on this machine, or load with jit_fallback=True (--jit-fallback) to compile here"
        )
    if not diffs:
        verify_files(root, manifest)
        _check_attention_backends(root, manifest, current_platform(device))
    return manifest, diffs


def _check_attention_backends(root: Path, manifest: Manifest, platform) -> None:
    """The attention backends the compiled files call must run here (an installed FlashAttention build, say):
    refuse with each one's reason and the backends that would run, never fall back silently."""
    # importing the backends defines the FlashAttention ops the compiled files call
    from omni_compile.attention.backends import BACKENDS, preference

    problems = []
    for name in manifest.attention.get("backends", []):
        if name not in BACKENDS:
            problems.append(f"{name}: unknown to this omni-compile (built by a newer one?)")
        elif (why := BACKENDS[name].check(platform, explicit=True)) is not None:
            problems.append(f"{name}: {why}")
    if problems:
        runnable = [n for n in preference(platform) if BACKENDS[n].check(platform) is None]
        raise ArtifactError(
            f"{root}: its compiled regions call attention backends that cannot run here: " + "; ".join(problems)
            + ". Install what is missing, or rebuild the artifact here (backends that would run: "
            + ", ".join(runnable) + "; --attention-backend NAME picks one)"
        )


def load(
    artifact: str | Path,
    weights: nn.Module | str | Path | None = None,
    *,
    device: str | None = None,
    jit_fallback: bool = False,
    cuda_graphs: bool | None = None,
    checked: tuple[Manifest, list[str]] | None = None,
    preloaded: Preload | None = None,
) -> nn.Module:
    """The model of `artifact` with its regions running the compiled files (see the module docstring).

    `weights`: the transformer already in memory (its tensors are used as they are), a diffusers model
    directory, or None for a preset's seeded random weights. `jit_fallback`: on a platform mismatch,
    compile the model with `omni_compile.compile` instead of refusing. `cuda_graphs`: default on for CUDA.
    `checked`: what `check(artifact, device=..., jit_fallback=...)` returned for it in this process (the
    server checks before it starts): the manifest is not read and the files are not hashed again.
    `preloaded`: `preload(artifact, checked)`, started before the weights were read (the server does): the
    compiled files are taken from it instead of being loaded here.
    """
    root = Path(artifact)
    if preloaded is not None and preloaded.root.resolve() != root.resolve():
        raise ValueError(f"preloaded= holds the files of {preloaded.root}, not of {root}")
    t0 = time.perf_counter()
    manifest, diffs = checked if checked is not None else check(root, device=device, jit_fallback=jit_fallback)
    check_s = time.perf_counter() - t0
    device = device or manifest.build.device
    model = _model_for(manifest, weights, device, parse_dtype(manifest.build.dtype))
    model = _load_checked(root, manifest, diffs, model, device, cuda_graphs, preloaded)
    if not diffs:
        model._omni_artifact.seconds["check"] = round(check_s, 4)
    return model


def _transform(model: nn.Module, manifest: Manifest) -> list[str]:
    """Run the build's weight transforms on `model` (what the compiled files are bound to: the weights after
    them; a transform already done is not done twice); returns the lossy ones."""
    from omni_compile.weights import LOSSY, apply_transforms

    transforms = manifest.build.compile_config.get("weight_transforms") or []
    if transforms:
        modules = dict(model.named_modules())  # the regions' instances: fp8 changes those blocks only
        blocks = [modules[p] for r in manifest.regions if r.kind == "block" for p in r.instances if p in modules]
        apply_transforms(model, transforms, blocks, manifest.build.compile_config.get("fp8_keep") or ())
    return [t for t in transforms if t in LOSSY]


def _load_checked(root: Path, manifest: Manifest, diffs: list[str], model: nn.Module, device: str, cuda_graphs,
                  preloaded: Preload | None = None) -> nn.Module:  # fmt: skip
    """`load` after `check`: the weights check, then the JIT fallback or the compiled files."""
    t0 = time.perf_counter()
    cdiffs = config_differences(manifest.model.config, model)
    if cdiffs:
        raise ArtifactError(
            "the model's config differs from the one the artifact was compiled for (the compiled regions would "
            "compute something else): " + "; ".join(cdiffs) + ". Load it into a model of the artifact's config, "
            "or build an artifact for this one"
        )
    _transform(model, manifest)
    wdiffs = weights_differences(manifest.weights["tensors"], model)
    if wdiffs:
        raise ArtifactError("the weights do not match the artifact's model: " + "; ".join(wdiffs))
    if diffs:
        import omni_compile
        from omni_compile.config import CompileConfig

        warnings.warn(f"{root}: platform differs ({'; '.join(diffs)}); compiling just in time instead", stacklevel=3)
        return omni_compile.compile(model, CompileConfig.from_dict(manifest.build.compile_config))
    t1 = time.perf_counter()
    installed = install(model, manifest, root, preloaded)
    installed.seconds.update(weights_check=round(t1 - t0, 4), packages=round(time.perf_counter() - t1, 4))
    use_graphs = cuda_graphs if cuda_graphs is not None else torch.device(device).type == "cuda"
    if use_graphs and torch.device(device).type == "cuda":
        from omni_compile import envs
        from omni_compile.runtime import capture_forward

        # a --dynamic artifact serves any size of its range: a bounded number of graphs, least recently used dropped
        installed.cuda_graphs = capture_forward(model, envs.cuda_graphs_max() if manifest.build.dynamic else None)
    model._omni_artifact = installed
    logger.info("loaded %s: %d compiled files", root, installed.stats["packages"])
    return model


def _compilations() -> int:
    """Graphs Dynamo compiled, regions our JIT backend compiled and graphs Inductor compiled (an FX-graph
    cache miss: loading an `inductor-standalone` file is a hit) so far in this process."""
    from torch._dynamo.utils import counters as dynamo_counters

    import omni_compile

    return (int(dynamo_counters["stats"].get("unique_graphs", 0)) + omni_compile.counters.regions_compiled
            + int(dynamo_counters["inductor"].get("fxgraph_cache_miss", 0)))  # fmt: skip


def verify(
    artifact: str | Path,
    *,
    weights: nn.Module | str | Path | None = None,
    example_inputs: str | None = None,
    device: str | None = None,
    jit_fallback: bool = False,
    cuda_graphs: bool | None = None,
) -> dict[str, Any]:
    """`omni-compile verify`: the load checks, then one step per bucket against eager on the same
    weights and seeded inputs (`weights` as in `load`; `example_inputs`, module:function, overrides the
    function recorded for a model with no adapter). Raises ArtifactError for a failed check; returns the result otherwise
    (`ok` False when a bucket's output is off by more than the build's parity bound)."""
    from omni_compile.artifact.parity import PARITY_BOUND, bucket_output, rel_l2
    from omni_compile.config import ShapeBucket
    from omni_compile.weights import LOSSY

    root = Path(artifact)
    manifest, diffs = check(root, device=device, jit_fallback=jit_fallback)
    device = device or manifest.build.device
    dtype = parse_dtype(manifest.build.dtype)
    checks = [f"manifest {manifest.schema} ({manifest.model.source}, {manifest.build.dtype})"]
    checks.append("platform matches" if not diffs else "platform differs (JIT fallback): " + "; ".join(diffs))
    if not diffs:
        checks.append(f"{len(manifest.files())} compiled files match their sha256")
        probe_load(root, manifest)
        checks.append("every compiled file loads (in a child process)")
    model = _model_for(manifest, weights, device, dtype)
    adapter = _adapter_for(manifest, model, example_inputs)
    text_len = manifest.build.text_len

    def eager_outputs() -> dict[str, tuple[dict, torch.Tensor]]:
        out = {}
        with torch.no_grad():
            for b in manifest.build.buckets + (manifest.build.dynamic or {}).get("checked", []):
                inputs = adapter.example_inputs(model, ShapeBucket.parse(b), dtype=dtype, device=device,
                                                text_len=text_len, seed=manifest.build.seed)  # fmt: skip
                out[b] = (inputs, bucket_output(model(**inputs)).clone())
        return out

    references = eager_outputs()
    lossless = {}
    lossy = [t for t in (manifest.build.compile_config.get("weight_transforms") or []) if t in LOSSY]
    if lossy:  # parity against the eager model after the same lossy transform; its cost against the model as given
        lossless = {b: ref for b, (_, ref) in references.items()}
        _transform(model, manifest)
        references = eager_outputs()
    before = _compilations()
    loaded = _load_checked(root, manifest, diffs, model, device, cuda_graphs)
    checks.append(f"config matches ({len(manifest.model.config)} fields)")
    checks.append(f"weights match ({len(manifest.weights['tensors'])} tensors, names, shapes and dtypes)")
    parity, cost = {}, {}
    with torch.no_grad():
        for b, (inputs, ref) in references.items():
            got = bucket_output(loaded(**inputs))
            parity[b] = rel_l2(got, ref)
            if b in lossless:
                cost[b] = rel_l2(got, lossless[b])
    bound = PARITY_BOUND[dtype]
    result = {
        "artifact": str(root),
        "checks": checks,
        "parity": parity,
        "bound": bound,
        "compilations": _compilations() - before,
        "ok": all(v <= bound for v in parity.values()),
    }
    if lossy:
        result["lossy"] = {"transforms": lossy, "rel_l2_vs_lossless": cost}
    return result

