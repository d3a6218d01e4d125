"""`omni-compile inspect TARGET`: its options and the command (the CLI module only wires them in)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def add_arguments(p) -> None:
    from omni_compile.argtypes import region_list

    p.add_argument("target", nargs="?", default=None,
                   help="an artifact directory (read from its stored dumps), or a model: preset, diffusers directory "
                   "or module:Class (compiled once here; default flux-tiny)")  # fmt: skip
    p.add_argument("--shapes", help="buckets HxW[xFRAMES][@BATCH] for a model target (default: the preset's)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default: the preset's)")
    p.add_argument("--device", help="cuda, cpu or xpu (default: the preset's, else cuda when available)")
    p.add_argument("--passes", action="append", default=[], help="pass switches, as for build")
    p.add_argument("--kernels", action="append", default=[], metavar="OP=IMPL",
                   help="fused-op implementations, as for build")
    p.add_argument("--attention-backend", metavar="NAME", help="default attention backend, as for build")
    p.add_argument("--precision", choices=["lossless", "fp8"], default=None,
                   help="fp8: the lossy weight transform fp8, as for build (its cost is reported)")
    p.add_argument("--config", help="CompileConfig as JSON (inline or a file)")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and example inputs")
    p.add_argument("--text-len", type=int, help="text tokens per prompt in the example inputs")
    p.add_argument("--model-config", help="model config overrides as JSON (presets, module:Class)")
    p.add_argument("--example-inputs", metavar="MODULE:FN", help="example inputs for models without an adapter")
    p.add_argument("--regions", metavar="CLASS,...", type=region_list, help="block classes to compile, as for build")
    p.add_argument("--profile", action="store_true",
                   help="profile one step per bucket: time per region and per kernel category")
    p.add_argument("--no-dynamo", action="store_true", help="skip the Dynamo view (explain, depyf)")
    p.add_argument("--out", metavar="DIR", help="write every dump as files (graphs, diffs, kernels, inspect.json)")
    p.add_argument("--html", metavar="FILE", help="write one self-contained HTML report")
    p.add_argument("--json", metavar="FILE",
                   help="write the report as JSON (schema omni-compile/inspect/1); - for stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress and no terminal summary")


def run(args, console) -> int:
    from omni_compile.config import compile_config_from_flags, json_arg
    from omni_compile.inspect import InspectOptions, inspect
    from omni_compile.inspect.html import write_html
    from omni_compile.inspect.report import print_summary, write_json, write_out

    opts = InspectOptions(
        target=args.target, shapes=args.shapes, dtype=args.dtype, device=args.device, seed=args.seed,
        text_len=args.text_len, model_config=json_arg(args.model_config, "--model-config"),
        example_inputs=args.example_inputs, regions=args.regions, compile=compile_config_from_flags(args), profile=args.profile,
        dynamo=not args.no_dynamo,
    )  # fmt: skip
    log = (lambda *a, **k: None) if args.quiet else console.print
    with tempfile.TemporaryDirectory(prefix="omni-inspect-") as tmp:
        work = Path(args.out) if args.out else Path(tmp)
        report = inspect(opts, work, on_stage=lambda m: log(f"[bold]>[/] {m}"))
        if args.out:
            write_out(report, Path(args.out))
            log(f"wrote {args.out}/ (graphs, diffs, kernels, inspect.json)")
    if args.html:
        write_html(report, Path(args.html))
        log(f"wrote {args.html}")
    if args.json == "-":
        print(json.dumps(report, indent=1))
    elif args.json:
        write_json(report, Path(args.json))
        log(f"wrote {args.json}")
    if not args.quiet:
        print_summary(console, report)
    sys.stdout.flush()
    return 0
