"""Multi-turn benchmark; same as `hicache bench multiturn` (see hicache/cli/benchmarks)."""

from __future__ import annotations

import sys

from hicache.cli.benchmarks.multiturn import main

if __name__ == "__main__":
    sys.exit(main())
