"""`python -m omni_compile ...`: the `omni-compile` command, for launchers that start modules (torchrun -m)."""

import sys

from omni_compile.cli import main

sys.exit(main())
