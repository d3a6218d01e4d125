"""Every environment variable omni-compile reads, in one place.

Other modules call these functions; none of them touches `os.environ` for our variables directly.
"""

import os

ENV_VARS = {
    "OMNI_COMPILE_PASSES": "Pass switches applied on top of the config, e.g. '-rms_norm' or '+rms_norm'.",
    "OMNI_COMPILE_DUMP_DIR": "Directory for graph dumps when the config sets none (off when unset).",
    "OMNI_COMPILE_LOG_LEVEL": "Log level of the CLI's logging (default WARNING); INFO shows per-compile pass lines.",
}


def passes_override() -> str | None:
    return os.environ.get("OMNI_COMPILE_PASSES") or None


def dump_dir() -> str | None:
    return os.environ.get("OMNI_COMPILE_DUMP_DIR") or None


def log_level() -> str | None:
    return os.environ.get("OMNI_COMPILE_LOG_LEVEL") or None
