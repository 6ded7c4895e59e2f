"""Recompute vs reload benchmark; same as `hicache bench recompute` (see hicache/cli/benchmarks)."""

from __future__ import annotations

import sys

from hicache.cli.benchmarks.recompute import main

if __name__ == "__main__":
    sys.exit(main())
