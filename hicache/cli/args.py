"""What every ``hicache`` subcommand shares: argument types, the parser, the error contract.

The contract of the command line: a user's mistake (a bad option value, a
missing or malformed file, a configuration the library refuses) is reported as
one line on stderr and exit status 2, checked before any long work starts.
``--json`` means one thing everywhere: stdout carries exactly one line, a JSON
object, and nothing else (the human table is not printed). Set
``HICACHE_DEBUG=1`` to get the traceback of an error instead of the line.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

TRACE_HELP = "trace file: JSON Lines, one request per line (format: docs/workloads.md)"


class UsageError(Exception):
    """A mistake on the command line; ``hicache`` prints the message and exits with 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help when there is a default worth naming."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, exit status 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        sys.exit(2)


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {text}")
    return value  # type: ignore[return-value]


def nonneg_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value  # type: ignore[return-value]


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def nonneg_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {text}")
    return value


def fraction(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def port(text: str) -> int:
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {text}")
    return value  # type: ignore[return-value]


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, and CUDA only where a CUDA device exists."""
    if text != "cpu" and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise argparse.ArgumentTypeError(f"expected 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if text.startswith("cuda"):
        import torch  # here: `hicache trace` imports this module and needs no torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but CUDA is not available here")
        index = int(text[5:]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                "device(s)"
            )
    return text


def require_matplotlib(option: str = "--plot") -> None:
    """Fail before the work starts when ``--plot`` cannot draw."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            f"{option} needs matplotlib, which is not installed (pip install 'hicache[plot]' "
            f"or pip install matplotlib), or run without {option}"
        )


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true",
        help="print only one JSON object (one line) on stdout, no table",
    )


def add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port", type=port, default=None, metavar="PORT",
        help="while running, serve Prometheus metrics of the caches on "
        "http://127.0.0.1:PORT/metrics (0: any free port; needs the metrics extra)",
    )


def start_metrics(args: argparse.Namespace, prog: str):
    """A serving :class:`hicache.metrics.CacheMetrics` if ``--metrics-port`` was given."""
    if getattr(args, "metrics_port", None) is None:
        return None
    try:
        from hicache.metrics import CacheMetrics
    except ImportError as exc:
        raise UsageError(f"--metrics-port: {exc}") from None
    metrics = CacheMetrics()
    bound = metrics.serve(args.metrics_port)  # OSError (port in use): one line, exit 2
    sys.stderr.write(f"{prog}: serving metrics on http://127.0.0.1:{bound}/metrics\n")
    sys.stderr.flush()
    return metrics


def run_guarded(run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace,
                prog: str) -> int:
    """``run(args)``, with a user's mistake turned into one stderr line and exit status 2.

    The library reports a caller's mistake as ``ValueError``/``TypeError`` naming the
    option or field; a missing or unreadable file is an ``OSError``; a native tree
    asked for but not buildable is ``NativeBuildError``.
    """
    from hicache.native.build import NativeBuildError

    try:
        return int(run(args) or 0)
    except (UsageError, ValueError, TypeError, OSError, NativeBuildError) as exc:
        if os.environ.get("HICACHE_DEBUG"):
            raise
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        sys.stderr.write(f"{prog}: error: {lines[0]}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
