"""``hicache stress``: many concurrent requests against a small, constantly evicting cache.

The options and the report; the run itself is :class:`hicache.sim.stress.StressRun`
(the regime and what is verified: :mod:`hicache.sim.stress`). The last stdout line
is one JSON object (with ``--json``, the only one); the exit status is 1 when a
corruption, leak, invariant violation or unexpected error was seen.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from hicache.cli.args import (
    Parser,
    UsageError,
    add_json,
    add_metrics_port,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    probability,
    run_guarded,
    start_metrics,
    user_input,
)
from hicache.config import EvictionPolicy
from hicache.sim.engine import request_pages
from hicache.sim.stress import StressOptions, StressRun, longest_request_tokens

_D = StressOptions()  # the defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=positive_float, default=_D.seconds,
                        help="how long to issue requests")
    parser.add_argument("--seed", type=nonneg_int, default=_D.seed,
                        help="seeds the workload, the delays and the faults")
    add_json(parser)
    parser.add_argument("--concurrency", type=positive_int, default=_D.concurrency,
                        help="requests in flight at once")
    parser.add_argument("--write-policy", default=_D.write_policy,
                        choices=["write_through", "write_through_selective", "write_back"],
                        help="when a device page gets its host copy")
    parser.add_argument("--eviction", default=_D.eviction, choices=[p.value for p in EvictionPolicy],
                        help="lfu (default) evicts once-hit nodes first: fresh loads and backups, the "
                        "nodes with IO in flight, are then the first candidates")
    parser.add_argument("--fault-rate", type=probability, default=_D.fault_rate,
                        help="probability that one page copy call fails")
    parser.add_argument("--max-delay-ms", type=nonneg_float, default=_D.max_delay_ms,
                        help="random delay before each page copy, up to this")
    parser.add_argument("--page-size", type=positive_int, default=_D.page_size, help="tokens per page")
    parser.add_argument("--device-pages", type=positive_int, default=_D.device_pages,
                        help="device pool pages (small, so that requests keep evicting; at least "
                        "the pages of the longest request)")
    parser.add_argument("--host-pages", type=positive_int, default=_D.host_pages, help="host pool pages")
    parser.add_argument("--conversations", type=positive_int, default=_D.conversations,
                        help="conversations the requests continue, in three namespaces")
    parser.add_argument("--max-tokens", type=positive_int, default=_D.max_tokens,
                        help="a conversation longer than this starts over")
    parser.add_argument("--verify-every", type=positive_int, default=_D.verify_every,
                        help="verify every readable page of the cache each N steps")
    parser.add_argument("--components", default=_D.components, metavar="SPEC",
                        help="a hybrid model's layout: window and state components beside "
                        "full attention, e.g. 'window:9,state' (a window of 9 tokens, a "
                        "recurrent state); every window page and checkpoint is verified too "
                        "(default: none)")
    add_metrics_port(parser)


def options(args: argparse.Namespace) -> StressOptions:
    """The run's shape from the parsed command line."""
    return StressOptions(**{f.name: getattr(args, f.name) for f in fields(StressOptions)})


def check_args(args: argparse.Namespace) -> None:
    """Refuse a run that cannot test anything (every request would be aborted)."""
    with user_input():  # StressOptions names the option it refuses
        opts = options(args)
        longest = longest_request_tokens(opts)
        kv = opts.kv_config()
    # (a hybrid request also owns its window pages, its state and two checkpoints)
    need = request_pages(kv, -(-longest // args.page_size))
    if args.device_pages < need:
        raise UsageError(
            f"--device-pages: expected at least {need} (the pages of the longest request, "
            f"{longest} tokens), got {args.device_pages}"
        )


def run(args: argparse.Namespace) -> int:
    check_args(args)
    metrics = start_metrics(args, "hicache stress")
    try:
        stress_run = StressRun(options(args), metrics)
        report = stress_run.run()
    finally:
        if metrics is not None:
            metrics.close()
    if stress_run.first_traceback is not None:
        print(stress_run.first_traceback, end="", file=sys.stderr)
    for line in report.pop("first_problems"):
        print(line, file=sys.stderr)
    if not args.json:
        width = max(len(k) for k in report)
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    ok = (
        report["corruptions"] == 0 and report["leaked_pages"] == 0
        and report["invariant_violations"] == 0 and report["errors"] == 0
    )
    print(json.dumps(report))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hicache stress", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_guarded(run, parser.parse_args(argv), parser.prog)


if __name__ == "__main__":
    sys.exit(main())
