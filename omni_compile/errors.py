"""User-facing errors.

`OmniCompileError` carries a message written for the person running the tool: what was wrong, what
was expected, and what to do. The CLI prints it on one line and exits non-zero; everything else that
escapes is a bug in omni-compile and keeps its traceback.
"""


class OmniCompileError(Exception):
    """A problem with the user's input or environment, explained in the message."""


class ConfigError(OmniCompileError, ValueError):
    """A configuration value or key that omni-compile does not accept."""
