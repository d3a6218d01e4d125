"""argparse types of the command line that need no torch: the parser is built for every `omni-compile` call,
`--help` included, and stays fast only while building it imports nothing heavy."""

from __future__ import annotations

import argparse


def region_list(text: str) -> list[str]:
    """The value of --regions: 'A,B' -> ['A', 'B'], block class names (an argparse type)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or not all(n.isidentifier() for n in names):
        raise argparse.ArgumentTypeError(f"expected block class names like FluxTransformerBlock,MyBlock, got {text!r}")
    return names


__all__ = ["region_list"]
