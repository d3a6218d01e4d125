"""Record what `omni-compile inspect` reads while regions compile: graph dumps and Inductor's output code.

`recording(root)` is used by the artifact build (so an artifact carries its own dumps under
`report/inspect/`) and by `inspect` itself when it compiles a model. Inside it:

- the pass manager dumps every graph it rewrites, before and after each pass, under
  `root/REGION/KEY/{i}.{pass}.{before,after}.py` (`passes.manager.dumping`);
- Inductor's generated code for that graph (the Python wrapper with its Triton or C++ kernels, or
  AOTInductor's C++ wrapper and kernel files) is written beside them as `output_code.N.EXT`. It is
  taken from Inductor's `output_code` log artifact, so nothing in Inductor is patched; a record
  arriving outside a region compile (no current pass log) is ignored.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

from omni_compile.passes.manager import current_log, dumping

OUTPUT_CODE_LOGGER = "torch._inductor.codecache.__output_code"
_WRITTEN = re.compile(r"^(?:Output|Wrapper|Kernel|Header) code written to: (.+)$")
_MAX_FILE = 8 << 20  # generated files larger than this are not copied


class _OutputCodeHandler(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.seen: set[tuple[str, str]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        log = current_log()
        if log is None or log.dump_dir is None:
            return
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record must never break a compile
            return
        if msg.startswith("Output code: \n"):
            self._write(log.dump_dir, msg[len("Output code: \n"):], ".py")
            return
        m = _WRITTEN.match(msg)
        if m:
            path = Path(m.group(1).strip())
            if path.is_file() and path.stat().st_size <= _MAX_FILE and path.suffix in (".py", ".cpp", ".h", ".cu"):
                self._write(log.dump_dir, path.read_text(errors="replace"), path.suffix)

    def _write(self, directory: Path, text: str, suffix: str) -> None:
        key = (str(directory), str(hash(text)))
        if key in self.seen:  # the same code is logged once as text and once as a file
            return
        self.seen.add(key)
        directory.mkdir(parents=True, exist_ok=True)
        n = len(list(directory.glob("output_code.*")))
        (directory / f"output_code.{n}{suffix}").write_text(text)


@contextlib.contextmanager
def capture_output_code():
    """Write Inductor's output code of each region compile into its pass log's dump_dir."""
    logger = logging.getLogger(OUTPUT_CODE_LOGGER)
    handler = _OutputCodeHandler()
    level = logger.level
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def recording(root: Path):
    """Graph dumps and output code of every region compiled inside, under `root` (see module doc)."""
    with dumping(Path(root)), capture_output_code():
        yield
