"""Backup/load bandwidth benchmark; same as ``hicache bench transfer``."""

from hicache.cli.benchmarks.transfer import main

if __name__ == "__main__":
    raise SystemExit(main())
