"""``hicache trace make KIND ...`` and ``hicache trace stats FILE``: the command line of traces.

``make`` turns each generator's keyword options (:mod:`hicache.sim.workloads`) into
flags whose defaults are the generator's own; ``stats`` prints
:func:`hicache.sim.traces.trace_stats` as a table or one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.cli.args import (
    TRACE_HELP,
    add_json,
    load_user_trace,
    nonneg_float,
    nonneg_int,
    positive_int,
    user_input,
)
from hicache.sim.traces import trace_stats, write_trace
from hicache.sim.workloads import GENERATOR_DEFAULTS, PRESETS, generate

# (flag, parameter, type, help) per kind; every default comes from the generator.
_OPTIONS: dict[str, list[tuple[str, str, type, str]]] = {
    "agentic": [
        ("--num-system-prompts", "num_system_prompts", int, "shared system prompts"),
        ("--system-tokens", "system_tokens", int, "tokens per system prompt (+ tool schemas)"),
        ("--sessions", "num_sessions", int, "agent sessions"),
        ("--turns", "num_turns", int, "turns per session"),
        ("--first-turn-tokens", "first_turn_tokens", int, "task tokens of the first turn"),
        ("--turn-tokens", "turn_tokens", int, "new tool-result/user tokens per later turn"),
        ("--output-tokens", "output_tokens", int, "tokens generated per turn"),
        ("--concurrency", "concurrency", int, "sessions open at once (0: all)"),
        ("--jitter", "jitter", float, "relative spread of every length (0: exact)"),
    ],
    "multiturn": [
        ("--clients", "num_clients", int, "chat clients (sessions)"),
        ("--min-rounds", "min_rounds", int, "fewest rounds per client"),
        ("--max-rounds", "max_rounds", int, "most rounds per client"),
        ("--system-tokens", "system_tokens", int, "shared system prompt tokens"),
        ("--user-tokens", "user_tokens", int, "user tokens per round"),
        ("--output-tokens", "output_tokens", int, "reply tokens per round"),
        ("--concurrency", "concurrency", int, "clients open at once (0: all)"),
        ("--jitter", "jitter", float, "relative spread of every length"),
    ],
    "fewshot": [
        ("--questions", "num_questions", int, "questions (one request each)"),
        ("--example-blocks", "num_example_blocks", int, "distinct example blocks"),
        ("--example-tokens", "example_tokens", int, "tokens per example block"),
        ("--question-tokens", "question_tokens", int, "tokens per question"),
        ("--output-tokens", "output_tokens", int, "answer tokens"),
        ("--jitter", "jitter", float, "relative spread of question/answer lengths"),
    ],
    "longdoc": [
        ("--docs", "num_docs", int, "documents"),
        ("--min-doc-tokens", "min_doc_tokens", int, "shortest document"),
        ("--max-doc-tokens", "max_doc_tokens", int, "longest document"),
        ("--questions-per-doc", "questions_per_doc", int, "questions per document"),
        ("--instruction-tokens", "instruction_tokens", int, "shared instruction tokens"),
        ("--question-tokens", "question_tokens", int, "tokens per question"),
        ("--output-tokens", "output_tokens", int, "answer tokens"),
        ("--jitter", "jitter", float, "relative spread of question/answer lengths"),
    ],
    "mcts": [
        ("--trees", "num_trees", int, "independent search trees"),
        ("--root-tokens", "root_tokens", int, "tokens of each root context"),
        ("--branching", "branching", int, "children per node"),
        ("--depth", "depth", int, "levels below the root"),
        ("--step-tokens", "step_tokens", int, "new tokens per child"),
        ("--output-tokens", "output_tokens", int, "tokens generated per node"),
        ("--order", "order", str, "node order within a tree: bfs or dfs"),
    ],
    "noreuse": [
        ("--requests", "num_requests", int, "requests"),
        ("--min-prompt-tokens", "min_prompt_tokens", int, "shortest prompt"),
        ("--max-prompt-tokens", "max_prompt_tokens", int, "longest prompt"),
        ("--output-tokens", "output_tokens", int, "tokens generated per request"),
    ],
}


# One line per kind for `trace make --help` (a generator's docstring is for the API).
_KIND_HELP = {
    "agentic": "agent loops: shared system prompts, sessions appending tool results and thoughts",
    "multiturn": "chat: a shared system prompt, per-client history growing round by round",
    "fewshot": "one long example block shared by many short questions",
    "longdoc": "long documents, several questions each, documents interleaved",
    "mcts": "tree search: a root context expanded into branches of branches",
    "noreuse": "random prompts that share nothing (the cache must not slow these down)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hicache trace make KIND ...`` and ``hicache trace stats FILE``."""
    sub = parser.add_subparsers(dest="trace_command", required=True, metavar="{make,stats}")
    make = sub.add_parser(
        "make", help="generate a trace (JSON Lines to stdout or -o FILE)",
        description="Generate a synthetic trace of one workload kind from a seed. Format and "
        "kinds: docs/workloads.md.",
    )
    kinds = make.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, options in _OPTIONS.items():
        p = kinds.add_parser(kind, help=_KIND_HELP[kind], description=_KIND_HELP[kind] + ".")
        p.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
        p.add_argument("--vocab", dest="vocab_size", type=positive_int, default=32000,
                       help="token ids are drawn from [0, VOCAB)")
        p.add_argument("--rate", type=nonneg_float, default=0.0,
                       help="add Poisson arrival times 't' at this many requests/s (0: none)")
        p.add_argument("-o", "--output", dest="out", default="-",
                       help="output file ('-': stdout)")
        if kind in PRESETS:
            p.add_argument("--preset", choices=sorted(PRESETS[kind]),
                           help="a named shape; explicit options override it")
        for flag, dest, typ, help_text in options:
            kw: dict[str, Any] = {"choices": ["bfs", "dfs"]} if dest == "order" else {}
            parse = nonneg_float if typ is float else nonneg_int if typ is int else typ
            default = GENERATOR_DEFAULTS[kind].get(dest)
            p.add_argument(flag, dest=dest, type=parse, default=None, **kw,
                           help=f"{help_text} (default: {default})")
    stats = sub.add_parser("stats", help="sizes, working set and ideal hit ratio of a trace",
                           description="Sizes, working set and ideal hit ratio of a trace.")
    stats.add_argument("trace", help=TRACE_HELP)
    stats.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    add_json(stats)


def _make_params(args: argparse.Namespace) -> dict[str, int | float | str]:
    params: dict[str, int | float | str] = dict(PRESETS.get(args.kind, {}).get(
        getattr(args, "preset", None) or "", {}))
    for _, dest, _, _ in _OPTIONS[args.kind]:
        value = getattr(args, dest)
        if value is not None:
            params[dest] = value
    params.update(seed=args.seed, vocab_size=args.vocab_size, rate=args.rate)
    return params


def run(args: argparse.Namespace) -> int:
    if args.trace_command == "make":
        with user_input():  # the generator names the parameter the options gave it
            requests = generate(args.kind, **_make_params(args))
        if args.out == "-":
            write_trace(requests, sys.stdout)
        else:
            write_trace(requests, args.out)
        return 0
    s = trace_stats(load_user_trace(args.trace), args.page_size)
    if args.json:
        print(json.dumps({
            "requests": s.num_requests, "sessions": s.num_sessions,
            "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
            "min_prompt_len": s.min_prompt_len, "max_prompt_len": s.max_prompt_len,
            "page_size": s.page_size, "working_set_tokens": s.working_set_tokens,
            "ideal_hit_tokens": s.ideal_hit_tokens,
            "ideal_hit_ratio": round(s.ideal_hit_ratio, 6),
        }))
        return 0
    rows = [
        ("requests", s.num_requests), ("sessions", s.num_sessions),
        ("prompt tokens", s.prompt_tokens), ("output tokens", s.output_tokens),
        ("prompt length min/mean/max",
         f"{s.min_prompt_len} / {s.mean_prompt_len:.0f} / {s.max_prompt_len}"),
        (f"working set (page {s.page_size}), tokens", s.working_set_tokens),
        ("ideal hit ratio (unbounded cache)", f"{s.ideal_hit_ratio:.4f}"),
    ]
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    return 0
