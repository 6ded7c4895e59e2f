"""The ``hicache`` command: subcommands, their argument conventions, the demo and benchmarks."""

from hicache.cli.app import main

__all__ = ["main"]
