"""User-facing errors.

`OmniCompileError` carries a message written for the person running the tool: what was wrong, what
was expected, and what to do. The CLI prints it on one line and exits non-zero; everything else that
escapes is a bug in omni-compile and keeps its traceback.
"""


class OmniCompileError(Exception):
    """A problem with the user's input or environment, explained in the message."""


class ConfigError(OmniCompileError, ValueError):
    """A configuration value or key that omni-compile does not accept."""


def find_user_error(exc: BaseException) -> OmniCompileError | None:
    """The OmniCompileError behind `exc`, if torch wrapped one (a pass raising inside Inductor surfaces as
    Dynamo's BackendCompilerFailed, with ours as its cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OmniCompileError):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None
