"""The ``hicache`` command: demo, replay, trace, bench, stress.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing a module when its
subcommand runs so that ``hicache --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command, module, help)
_COMMANDS = [
    ("demo", "hicache.demo", "the main job: an agentic workload through no cache, device cache "
     "and the hierarchy, with a comparison table"),
    ("replay", "hicache.replay", "replay a trace through the cache (bookkeeping only) and report "
     "hit ratios"),
    ("trace", "hicache.traces", "make synthetic traces in the shared JSONL format"),
    ("stress", "hicache.stress", "concurrent requests with random delays and faults; verifies "
     "every KV read"),
]

# (bench name, module, help)
_BENCHES = [
    ("transfer", "hicache.benchmarks.transfer", "backup/load bandwidth vs a contiguous copy"),
    ("recompute", "hicache.benchmarks.recompute", "recompute vs reload latency per prefix length"),
    ("multiturn", "hicache.benchmarks.multiturn", "TTFT and computed tokens: none / device / "
     "hierarchical (+ small host, + storage tier)"),
    ("tiers", "hicache.benchmarks.tiers", "host tier in replay: hit ratio and req/s against "
     "device-only on one trace"),
    ("vllm", "hicache.benchmarks.vllm", "vLLM alone vs with the hicache connector (host tier, "
     "+ storage): TTFT, tokens computed per tier, req/s"),
]


def _add(subparsers, name: str, module: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    mod = importlib.import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, module, help_text in _COMMANDS:
        if wanted in (None, name) or wanted.startswith("-"):
            _add(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks (each ends with one JSON line)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, module, help_text in _BENCHES:
        if wanted_bench == name:
            _add(bench_sub, name, module, help_text)
        else:
            bench_sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
