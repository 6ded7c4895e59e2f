"""``hicache demo``: an agentic workload through no cache, a device cache and the hierarchy.

Agent sessions share a few long system prompts and grow turn by turn; they
interleave, so a device tier holding a quarter of the working set thrashes.
Every request runs through :class:`hicache.sim.engine.Engine` in the three
configurations at the same device capacity (the hierarchy adds a host tier
that holds the whole working set). Shows a progress bar per configuration,
then a comparison table and a one-line conclusion computed from the numbers;
``--plot FILE.png`` draws TTFT per request (needs matplotlib).

``hicache demo chat`` is the real-text demo instead: a short chat on a real model
through two vLLM servers, with and without hicache (:mod:`hicache.cli.demo_chat`;
needs vLLM). ``hicache demo`` alone runs the simulated workload above, offline.

This module only presents: the workload, the engines and the metrics come from
:mod:`hicache.cli.benchmarks.multiturn` (the workload and its options),
:mod:`~hicache.cli.benchmarks.multiturn_runs` and :mod:`~hicache.cli.benchmarks.multiturn_report`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hicache.cli.args import (
    UsageError,
    add_json,
    add_metrics_port,
    nonneg_int,
    positive_int,
    require_matplotlib,
    start_metrics,
    user_input,
)
from hicache.cli.benchmarks.multiturn import (
    add_workload_arguments,
    check_engine_tiers,
    generated_trace,
    workload_from_args,
)
from hicache.cli.benchmarks.multiturn_report import conclusion, format_table, summarize
from hicache.cli.benchmarks.multiturn_runs import (
    CONFIGS,
    ConfigResult,
    capacities,
    run_configs,
    to_requests,
)
from hicache.cli.plots import plot_ttft_per_request
from hicache.cli.progress import ProgressBar
from hicache.sim.model import PRESET_NAMES, Model, preset

# The bench's workload with 6 sessions x 8 turns instead of 8 x 10: 48 requests, so
# that all three configurations finish in well under two minutes on two cores.
DEMO_SESSIONS = 6
DEMO_TURNS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hicache.cli import demo_chat

    sub = parser.add_subparsers(dest="demo_command", required=False, metavar="{chat}")
    chat_help = ("a short multi-turn chat on a real model (smollm2) through vLLM's server, "
                 "with and without hicache: each turn's question, reply, TTFT and cached "
                 "share (needs vLLM)")
    chat = sub.add_parser("chat", help=chat_help, description=chat_help)
    demo_chat.add_arguments(chat)
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES,
                        help="model shapes (default: small)")
    add_workload_arguments(parser, num_sessions=DEMO_SESSIONS, num_turns=DEMO_TURNS)
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="run only the first N requests (a quick look)")
    parser.add_argument("--device-tokens", type=positive_int, default=None,
                        help="device capacity in tokens (default: 25%% of the working set)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (default 1: the other core runs transfers)")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="workload and model weights")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw TTFT per request for each configuration (needs matplotlib)")
    add_json(parser)
    add_metrics_port(parser)
    # The plain demo's options, given before "chat", would be ignored by it: refused.
    shared = {a.dest for a in chat._actions}  # the chat's own values win there
    plain = {a.dest: a.default for a in parser._actions
             if a.option_strings and a.dest not in shared}
    chat.set_defaults(_run=lambda args: _run_chat(args, plain))


def _run_chat(args: argparse.Namespace, plain: dict[str, object]) -> int:
    from hicache.cli import demo_chat

    given = sorted(dest for dest, default in plain.items() if getattr(args, dest) != default)
    if given:
        raise UsageError("expected the chat's options after 'chat' (--model, --turns, "
                         "--max-tokens, --start-timeout, --json), got the plain demo's "
                         + ", ".join("--" + d.replace("_", "-") for d in given))
    return demo_chat.run(args)


def plot_ttft(path: str, runs: dict[str, ConfigResult], title: str) -> None:
    """TTFT per request of every configuration, in trace order."""
    plot_ttft_per_request(
        path, {name: [r.ttft_s * 1e3 for r in res.results] for name, res in runs.items()}, title
    )


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.plot is not None:
        require_matplotlib()
    workload = workload_from_args(args)
    torch.set_num_threads(args.threads)
    with user_input():  # the generator names the shape parameter it refuses
        trace = generated_trace(args.seed, workload)
    if args.requests is not None:
        trace = trace[: args.requests]
    page_size = args.page_size
    requests = to_requests(trace)
    cfg = preset(args.preset)
    with user_input("--page-size"):  # a hybrid model's state must fit a page
        kv = cfg.kv_config(page_size)
    ws, device_tokens, host_tokens = capacities(trace, requests, page_size, args.device_tokens,
                                                kv=kv)
    model = Model(cfg, seed=args.seed)
    check_engine_tiers(model, page_size, device_tokens, host_tokens)
    prompt_tokens = sum(len(r.prompt) for r in requests)

    say = (lambda *_a, **_k: None) if args.json else print
    say(f"hicache demo: {len(requests)} agent requests ({workload['num_sessions']} sessions "
          f"x {workload['num_turns']} turns over {workload['num_system_prompts']} shared "
          f"{workload['system_tokens']}-token system prompts, interleaved), "
          f"{prompt_tokens} prompt tokens")
    say(f"model preset '{cfg.name}' ({cfg.num_layers} layers, hidden {cfg.hidden_size}); "
          f"device tier {device_tokens} tokens = {device_tokens / ws:.0%} of the "
          f"{ws}-token working set; host tier {host_tokens} tokens (hierarchical only)")
    bar = ProgressBar(len(requests), sys.stdout)
    metrics = start_metrics(args, "hicache demo")
    try:
        runs = run_configs(model, requests, list(CONFIGS), device_tokens, host_tokens,
                           page_size, None if args.json else bar.update, metrics=metrics)
    finally:
        if metrics is not None:
            metrics.close()
    summaries = {name: summarize(res, requests) for name, res in runs.items()}
    say()
    for line in format_table(summaries):
        say(line)
    say()
    say("all three configurations generated identical tokens")
    say(conclusion(summaries))
    if args.plot is not None:
        plot_ttft(args.plot, runs, f"TTFT per request, preset {cfg.name}, device tier "
                  f"{device_tokens / ws:.0%} of the working set")
        say(f"plot written to {args.plot}")
    say(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        print(json.dumps({
            "preset": cfg.name, "page_size": page_size, "seed": args.seed,
            "workload": workload, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
            "working_set_tokens": ws, "device_tokens": device_tokens,
            "host_tokens": host_tokens, "identical_tokens": True, "configs": summaries,
        }))
    return 0
