"""Graph passes over Inductor's post-grad ATen graphs. One pass per file; see README.md."""

from omni_compile.passes.base import OmniPass, PatternPass
from omni_compile.passes.manager import PASS_ORDER, PASSES, PassLog, PassManager, enabled_passes, resolve_enabled

__all__ = [
    "OmniPass",
    "PatternPass",
    "PASS_ORDER",
    "PASSES",
    "PassLog",
    "PassManager",
    "enabled_passes",
    "resolve_enabled",
]
