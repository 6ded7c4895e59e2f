"""Benchmarks behind ``hicache bench``: each prints a table and ends with one JSON line
(with ``--json``, only that line)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Protocol


class MainFn(Protocol):
    """A benchmark module's ``main``: the command line (default: ``sys.argv[1:]``) to
    an exit status."""

    def __call__(self, argv: list[str] | None = None) -> int: ...


def standalone_main(
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> MainFn:
    """A benchmark module's ``main(argv)``: its own parser (``doc``'s first line), then ``run``."""

    def main(argv: list[str] | None = None) -> int:
        from hicache.cli.args import Parser, run_guarded

        parser = Parser(description=doc.splitlines()[0])
        add_arguments(parser)
        return run_guarded(run, parser.parse_args(argv), parser.prog)

    return main
