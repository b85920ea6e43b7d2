"""`python -m mlxserve`: the `mlxserve` command, where its script is not on PATH (or to pick the
Python that runs it)."""

import sys

from mlxserve.cli import main

sys.exit(main())
