"""The `omni-compile` command line.

    omni-compile build [MODEL] --shapes 1024x1024 --dtype bf16 --device cuda --out DIR
    omni-compile models
    omni-compile passes

User errors print one line (`omni-compile: error: ...`) and exit 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from omni_compile.errors import ConfigError, OmniCompileError, find_user_error


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"omni-compile: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    from omni_compile.argtypes import region_list

    p = _Parser(prog="omni-compile", description="Compile diffusion transformers region by region.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    b = sub.add_parser("build", help="compile a model for shape buckets and write the build output")
    b.add_argument(
        "model",
        nargs="?",
        default=None,
        help="preset name (see `omni-compile models`), local diffusers directory, or module:Class (default: flux-tiny)",
    )
    b.add_argument(
        "--shapes",
        help="comma-separated buckets HxW[xFRAMES][@BATCH], e.g. 1024x1024,512x512@2 (default: the preset's)",
    )
    b.add_argument(
        "--dynamic",
        metavar="LOW-HIGH[:STEP]",
        help="serve every height and width from LOW to HIGH pixels in steps of STEP (default 64), e.g. 512-1536:64, "
        "from regions compiled once with symbolic sequence lengths (--shapes then sets frames and batch)",
    )
    b.add_argument("--dtype", help="bf16, fp16 or fp32 (default: the preset's)")
    b.add_argument("--device", help="cuda, cpu or xpu (default: the preset's, else cuda when available)")
    b.add_argument("--out", help="output directory (default: out/MODEL)")
    b.add_argument("--force", action="store_true", help="replace an existing output directory")
    b.add_argument(
        "--passes",
        action="append",
        default=[],
        help="pass switches, e.g. -rms_norm, +rms_norm, none, all (repeatable; see `omni-compile passes`)",
    )
    b.add_argument(
        "--kernels",
        action="append",
        default=[],
        metavar="OP=IMPL",
        help="fused-op implementations, e.g. rms_norm=triton or *=native (auto: kernel where it runs, else native)",
    )
    b.add_argument(
        "--weight-transforms",
        metavar="NAMES",
        help="load-time weight transforms, run once when weights are bound: fuse_projections (attention q/k/v "
        "projections as one GEMM), fp8 (lossy: the blocks' Linears as fp8 GEMMs, sm89+ GPUs, bf16; the build "
        "reports its cost); comma list",
    )
    b.add_argument(
        "--precision",
        choices=["lossless", "fp8"],
        default=None,
        help="fp8: the weight transform fp8 (lossy, opt-in; the build prints and reports its cost against the "
        "model as given); lossless (default): as the model is",
    )
    b.add_argument(
        "--fp8-keep",
        metavar="PATTERNS",
        help="with --precision fp8: Linears to keep in the model's dtype, comma list of fnmatch patterns of module "
        "paths (e.g. 'transformer_blocks.*.ff.net.2,*.attn.to_out.0')",
    )
    b.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="default attention backend: auto (on a GPU: the fastest capable one, measured), TORCH_SDPA, CUDNN_ATTN, "
        "FA3_ATTN, FA4_ATTN, FLASH_ATTN, TRITON_ATTN or SAGE_ATTN (explicit choices fail closed; see "
        "`omni-compile attention`)",
    )
    b.add_argument(
        "--attention",
        metavar="CONFIG",
        help='attention config as JSON ({"default": {...}, "per_role": {ROLE: {"backend": NAME}}}) or dotted items, '
        "e.g. per_role.wan.cross.backend=TORCH_SDPA",
    )
    b.add_argument("--config", help="CompileConfig as JSON (inline or a file); --passes apply on top")
    b.add_argument("--dump-graphs", metavar="DIR", help="write each region's graphs before/after every pass to DIR")
    b.add_argument("--cache-from", metavar="DIR", help="(--mode jit) warm-start from an earlier JIT build's cache bundle")
    b.add_argument(
        "--mode",
        choices=("aot", "jit"),
        default="aot",
        help="aot (default): a prebuilt artifact that `omni_compile.load` runs without compiling; "
        "jit: a build report and Inductor's cache bundle",
    )
    b.add_argument("--seed", type=int, default=0, help="seed for random weights and example inputs (default 0)")
    b.add_argument("--text-len", type=int, help="text tokens per prompt in the example inputs (default: the preset's)")
    b.add_argument("--model-config", help="model config overrides as JSON (presets, module:Class)")
    b.add_argument(
        "--example-inputs", metavar="MODULE:FN", help="function making example inputs for models without an adapter"
    )
    b.add_argument("--regions", metavar="CLASS,...", type=region_list,
                   help="block classes to compile as regions, comma-separated (default: the model's _repeated_blocks, "
                   "else the classes of its lists of identical blocks)")
    b.add_argument("--store", metavar="URL", help="shared store of compiled files: file://PATH or "
                   "redis://[:PASSWORD@]HOST:PORT/DB (looked up before compiling, published after; with --mode jit, "
                   "a redis:// URL for Inductor's remote FX-graph and autotune caches)")
    b.add_argument("--format", choices=("aoti-package", "inductor-standalone"),
                   help="compiled-file format (--mode aot; default: inductor-standalone on CUDA, aoti-package "
                   "elsewhere; docs/artifact.md#compiled-file-formats)")
    b.add_argument("--parity", choices=("auto", "always"), default="auto",
                   help="(--mode aot) check the artifact against eager: auto (default) skips the check when every "
                   "file came from --store and its publishing build checked the same bucket; always checks")
    b.add_argument("--json", action="store_true", help="print the build report as JSON on stdout")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress display")

    v = sub.add_parser("verify", help="check an artifact here (platform, checksums, weights) and run one step against eager")
    v.add_argument("artifact", help="an artifact directory written by `omni-compile build`")
    v.add_argument("--weights", metavar="DIR", help="the model's diffusers directory (needed when the artifact was "
                   "built from a directory; default: the artifact's seeded random weights)")
    v.add_argument("--example-inputs", metavar="MODULE:FN", help="for a model with no adapter: the example-input "
                   "function (default: the one the build recorded)")
    v.add_argument("--device", help="device to load on (default: the one it was built for)")
    v.add_argument("--jit-fallback", action="store_true", help="on a platform mismatch, compile here instead of refusing")
    v.add_argument("--no-cuda-graphs", action="store_true", help="run the parity step without CUDA graphs")
    v.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    _cache_parser(sub)
    sub.add_parser("models", help="list model presets")
    sub.add_parser("passes", help="list graph passes and their defaults")
    a = sub.add_parser("attention", help="list attention backends and what each needs on this machine")
    a.add_argument("--device", help="cuda, cpu or xpu (default: cuda when available)")
    a.add_argument("--head-dim", type=int, help="check the backends against this head size too")
    a.add_argument("--dtype", default="bf16", help="dtype to check with --head-dim (default bf16)")
    _inspect_parser(sub)
    _serve_parsers(sub)
    return p


def _serve_parsers(sub) -> None:
    """`serve` and `pipeline` (docs/serving.md); the options live with the server."""
    from omni_compile.server.serve import add_pipeline_arguments, add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="serve an artifact over HTTP (OpenAI images API for FLUX, videos "
                                       "API for Wan; docs/serving.md)"))
    add_pipeline_arguments(sub.add_parser("pipeline", help="write a preset's whole random diffusers pipeline to a directory"))
    from omni_compile.parallel.run import add_arguments as add_run_arguments

    add_run_arguments(sub.add_parser("run", help="compile a model just in time and time its step, in one process or on "
                                                 "N ranks (torchrun ... -m omni_compile run --parallel ulysses=N)"))


def _cmd_build(args, console) -> int:
    from omni_compile.config import compile_config_from_flags, json_arg
    from omni_compile.models import DEFAULT_MODEL

    config = compile_config_from_flags(args)  # flag errors before the build machinery (Inductor) is imported
    from omni_compile.builder import BuildEvents, BuildOptions, build

    if args.dump_graphs:
        config.dump_dir = args.dump_graphs
    if args.text_len is not None and args.text_len <= 0:
        raise ConfigError(f"--text-len must be positive, got {args.text_len}")
    name = args.model or DEFAULT_MODEL
    out = args.out or str(Path("out") / Path(name.replace(":", "_")).name)
    opts = BuildOptions(
        model=args.model,
        shapes=args.shapes,
        dtype=args.dtype,
        device=args.device,
        out=out,
        seed=args.seed,
        text_len=args.text_len,
        example_inputs=args.example_inputs,
        model_config=json_arg(args.model_config, "--model-config"),
        regions=args.regions,
        compile=config,
        cache_from=args.cache_from,
        store=args.store,
        format=args.format,
        parity=args.parity,
        force=args.force,
        mode=args.mode,
        dynamic=args.dynamic,
    )
    log = (lambda *a, **k: None) if args.quiet else console.print

    def region_done(rec):
        how = "cache hit" if rec.cache_hit else ", ".join(f"{k}={v}" for k, v in rec.passes.items()) or "no passes"
        log(f"  [green]compiled[/] {rec.region:<28} graph {rec.graph_hash[:10]}  {rec.seconds:6.2f}s  {how}")

    def bucket_done(bucket, seconds, compiles):
        log(f"  bucket [bold]{bucket}[/]: first call {seconds:.2f}s, {compiles} region compile(s)")

    events = BuildEvents(
        on_stage=lambda m: log(f"[bold]>[/] {m}"), on_region_compiled=region_done, on_bucket_done=bucket_done,
        on_warning=lambda m: console.print(f"[yellow]warning:[/] {m}", markup=True),
    )
    report = build(opts, events)
    if args.json:
        print(json.dumps(report, indent=2))
    elif opts.mode == "aot":
        from omni_compile.artifact.manifest import Manifest

        _print_artifact_summary(console, Manifest.from_json(report), out)
    else:
        _print_summary(console, report, out)
        st = report["compiler"]["store"]
        if st:
            state = "reachable" if st["reachable"] else "unreachable, not used"
            console.print(f"store {st['url']} (Inductor's remote caches, {state}): FX graph cache "
                          f"{st['fxgraph_cache_hit']} hit(s), {st['fxgraph_cache_miss']} miss(es)")  # fmt: skip
    return 0


def _print_artifact_summary(console, manifest, out) -> None:
    from rich.table import Table

    b = manifest.build
    t = Table(title=f"omni-compile build: {manifest.model.source} ({b.dtype}, {b.device}), artifact")
    for col in ("region", "kind", "instances", "files", "compile s", "pass matches"):
        t.add_column(col, justify="left" if col in ("region", "kind", "pass matches") else "right")
    for r in manifest.regions:
        files = {e.file: e for entries in r.buckets.values() for e in entries}
        matches: dict[str, int] = {}
        for e in files.values():
            for k, n in e.passes.items():
                matches[k] = matches.get(k, 0) + n
        t.add_row(r.name, r.kind, str(len(r.instances)), str(len(files)),
                  f"{sum(e.compile_seconds for e in files.values()):.2f}",
                  ", ".join(f"{k}={n}" for k, n in matches.items() if n) or "-")  # fmt: skip
    console.print(t)
    tm = manifest.timing
    console.print(
        f"{tm['compile_seconds']:.1f}s compiling, {tm['wall_seconds']:.1f}s total; parity vs eager: "
        + ", ".join(f"{k} rel L2 {v['rel_l2_vs_eager']:.1e}" + ("" if v.get("checked", "here") == "here" else
                                                                  " (checked by the store's publishing build)")
                    for k, v in manifest.parity.items())
    )
    if manifest.store is not None:
        st = manifest.store
        console.print(
            f"store {st['url']}: {st['hits']} hit(s), {st['misses']} miss(es), {st['published']} published"
            f" ({st['repaired']} repaired), {st['bytes_down'] / 2**20:.1f} MiB down, {st['bytes_up'] / 2**20:.1f} MiB up"
            f", {st['seconds']:.2f}s; {len(st['errors'])} error(s)"
        )
    for name, res in manifest.fusion["fused_op_implementations"].items():
        console.print(f"fused op {name}: {res['implementation']} x{res['count']} ({res['reason']})")
    for role, res in manifest.attention["per_role"].items():
        console.print(f"attention {role}: {res['implementation']} x{res['count']} ({res['reason']})")
    console.print(f"wrote {out}/manifest.json ({len(manifest.regions)} regions); load it with omni_compile.load({out!r})")


def _cache_parser(sub) -> None:
    """`cache` (docs/cache.md#commands); the options live with the cache package."""
    from omni_compile.cache.command import add_arguments

    add_arguments(sub.add_parser("cache", help="list, push, pull, remove and collect entries of a shared store"))


def _cmd_cache(args, console) -> int:
    from omni_compile.cache.command import run

    return run(args, console)


def _cmd_verify(args, console) -> int:
    from omni_compile.artifact.loader import verify

    result = verify(args.artifact, weights=args.weights, example_inputs=args.example_inputs, device=args.device,
                    jit_fallback=args.jit_fallback, cuda_graphs=False if args.no_cuda_graphs else None)  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for line in result["checks"]:
            console.print(f"[green]ok[/] {line}")
        console.print(
            "parity step vs eager: " + ", ".join(f"{k} rel L2 {v:.2e}" for k, v in result["parity"].items())
            + f" (bound {result['bound']:.0e}); {result['compilations']} compilation(s) while loading and running"
        )
        if "lossy" in result:  # lossy options always print their error
            lossy = result["lossy"]
            console.print(f"{', '.join(lossy['transforms'])} (lossy): rel L2 against the model as given "
                          + ", ".join(f"{k} {v:.2e}" for k, v in lossy["rel_l2_vs_lossless"].items()))  # fmt: skip
    return 0 if result["ok"] else 1


def _print_summary(console, report, out) -> None:
    from rich.table import Table

    t = Table(title=f"omni-compile build: {report['model']['source']} ({report['dtype']}, {report['device']})")
    for col in ("region", "instances", "compiles", "cache hits", "compile s", "pass matches"):
        t.add_column(col, justify="left" if col in ("region", "pass matches") else "right")
    for r in report["regions"]:
        comps = r["compiles"]
        t.add_row(
            r["name"],
            str(len(r["instances"])),
            str(len(comps)),
            str(sum(c["cache_hit"] for c in comps)),
            f"{sum(c['seconds'] for c in comps):.2f}",
            ", ".join(f"{k}={v}" for k, v in r["matches"].items()) or "-",
        )
    console.print(t)
    n, tm = report["compilations"], report["timing"]
    console.print(
        f"{len(report['regions'])} regions, {n['region_compiles']} compiles ({n['cache_hits']} cache hits), "
        f"{tm['compile_seconds']:.1f}s compiling, {tm['wall_seconds']:.1f}s total; "
        f"buckets: " + ", ".join(f"{b['bucket']} {b['first_call_seconds']:.2f}s" for b in report["buckets"])
        + "; parity vs eager: "
        + ", ".join(f"{k} rel L2 {v['rel_l2_vs_eager']:.1e}" for k, v in report["parity"]["buckets"].items())
    )
    for name, res in report["fused_op_implementations"].items():
        console.print(f"fused op {name}: {res['implementation']} x{res['count']} ({res['reason']})")
    for role, res in report["attention"]["per_role"].items():
        console.print(f"attention {role}: {res['implementation']} x{res['count']} ({res['reason']})")
    bundle = ", inductor_cache.bin" if report["compiler"]["cache_bundle"] else ""
    console.print(f"wrote {out}/build_report.json{bundle}")


def _cmd_models(console) -> int:
    from rich.table import Table

    from omni_compile.models import PRESETS

    t = Table(title="model presets")
    for col in ("name", "family", "default shapes", "dtype", "description"):
        t.add_column(col)
    for p in PRESETS.values():
        t.add_row(p.name, p.family, p.default_shapes, p.default_dtype, p.description)
    console.print(t)
    console.print("MODEL may also be a local diffusers directory or module:Class (any diffusers transformer; its regions are its _repeated_blocks, else the classes of its lists of identical blocks, or --regions).")
    return 0


def _cmd_passes(console) -> int:
    from omni_compile.ops import FUSED_OPS
    from omni_compile.passes import PASS_ORDER

    for cls in PASS_ORDER:
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        console.print(f"{cls.name:<18} {'on ' if cls.enabled_by_default else 'off'}  {doc}")
    console.print("\nfused ops (--kernels OP=auto|native|KERNEL):")
    for name, op in FUSED_OPS.items():
        kernels = ", ".join(
            f"{k.name} on {'/'.join(k.platforms)}" + (f" (auto on {'/'.join(k.auto_on)})" if k.auto_on else " (opt-in)")
            for k in op.kernels.values()
        )
        console.print(f"{name:<18} native everywhere; {kernels or 'no kernels'}")
    return 0


def _cmd_attention(console, args) -> int:
    from omni_compile.attention.backends import BACKENDS, AttentionCall, preference
    from omni_compile.config import parse_dtype
    from omni_compile.platform import current_platform

    platform = current_platform(args.device)
    call = AttentionCall(dtype=parse_dtype(args.dtype), head_dim=args.head_dim) if args.head_dim else None
    console.print(f"platform {platform.kind} ({platform.device_name}, {platform.arch}); automatic order: "
                  + " > ".join(preference(platform)))  # fmt: skip
    for name, backend in BACKENDS.items():
        why = backend.check(platform, call, explicit=True)
        status = "ok" if why is None else f"unavailable: {why}"
        lossy = " (lossy, explicit only)" if backend.lossy else ""
        console.print(f"{name:<12} {status}{lossy}\n             {backend.description}")
    return 0


def _cmd_serve(args, console) -> int:
    from omni_compile.server.serve import run_pipeline_command, run_serve

    return run_serve(args, console) if args.command == "serve" else run_pipeline_command(args, console)


def _inspect_parser(sub) -> None:
    """`inspect` (docs/inspect.md); the options live with the inspect package."""
    from omni_compile.inspect.command import add_arguments

    add_arguments(sub.add_parser("inspect", help="show each region's graphs before/after every pass, matches, kernels, profile"))


def _cmd_inspect(args, console) -> int:
    from omni_compile.inspect.command import run

    return run(args, console)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = _parser().parse_args(argv)
    console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 120)
    from omni_compile import envs

    level = (envs.log_level() or "WARNING").upper()
    if level not in logging.getLevelNamesMapping():
        print(
            f"omni-compile: error: OMNI_COMPILE_LOG_LEVEL={level!r} is not a log level (DEBUG, INFO, WARNING, ERROR)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "build":
            return _cmd_build(args, console)
        if args.command == "verify":
            return _cmd_verify(args, console)
        if args.command == "cache":
            return _cmd_cache(args, console)
        if args.command == "models":
            return _cmd_models(Console(highlight=False, width=None if sys.stdout.isatty() else 120))
        if args.command == "passes":
            return _cmd_passes(Console(highlight=False, width=None if sys.stdout.isatty() else 120))
        if args.command == "attention":
            return _cmd_attention(Console(highlight=False, width=None if sys.stdout.isatty() else 120), args)
        if args.command in ("serve", "pipeline"):
            return _cmd_serve(args, console)
        if args.command == "inspect":
            return _cmd_inspect(args, console)
        if args.command == "run":
            from omni_compile.parallel.run import run

            return run(args, console)
    except OmniCompileError as e:
        print(f"omni-compile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("omni-compile: interrupted; nothing was published", file=sys.stderr)
        return 130
    except Exception as e:
        user_error = find_user_error(e)
        if user_error is None:
            raise
        print(f"omni-compile: error: {user_error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
