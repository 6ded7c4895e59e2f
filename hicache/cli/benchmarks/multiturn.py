"""Multi-turn / agentic replay through the engine: no cache vs device cache vs the hierarchy.

Every request of a workload runs through :class:`hicache.sim.engine.Engine`, one at
a time in trace order, in each configuration of :data:`CONFIGS` at the same
device capacity (default: a quarter of the workload's working set, so the
device tier thrashes) with a host tier big enough for the whole working set.
Prompts are taken as given; ``max_new_tokens = len(output)``; generation is
greedy, and the three configurations must produce the same tokens (checked).

Third tier (:data:`STORAGE_CONFIGS`, picked with ``--configs``): the same device
tier over a host tier too small for the working set (``--storage-host-tokens``,
default a quarter of the full host tier), without (``hierarchical-small-host``)
and with (``hierarchical+storage``) a storage tier under it (``--storage SPEC``,
default a fresh temporary ``file:`` store). Requests are announced one ahead
(``Engine.prefetch`` for request i+1 before request i runs, as if it arrived while
i computes), so its stored pages reach host memory in the background; under the
default ``wait_complete`` a request waits only for what has not arrived yet.

What is measured per configuration: TTFT (call to first generated token:
match, load waits and prefill), hit ratios per tier (prompt tokens found on the
device / loaded from the host, over all prompt tokens; "storage" is the part of
the host hits read from the third tier first), prompt tokens computed,
and requests per second (decode included). A warm-up request runs first on a
throwaway engine so one-time kernel set-up is not charged to the first config.

The regime: on a CPU the "device" pool is host memory too, so a reload is a
memory copy while recompute runs the model on a couple of cores; recompute
costs far more than on a GPU, relative to a load. The computed-token ratio
carries over to a GPU; the TTFT ratio shrinks there (see ``bench recompute``).
A forward of a few dozen tokens also has a fixed cost here (~20-40 ms: the
32k-vocabulary head, per-op overhead), which keeps the TTFT ratio below the
computed-token ratio.

This module is the workload and the command line; the configurations (:data:`CONFIGS`,
:data:`STORAGE_CONFIGS`) and the replay are :mod:`hicache.cli.benchmarks.multiturn_runs`,
the metrics and the table :mod:`hicache.cli.benchmarks.multiturn_report`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

import psutil
import torch

from hicache.checks import check_bounds
from hicache.cli import args as cliargs
from hicache.cli.args import (
    UsageError,
    add_json,
    add_metrics_port,
    check_tier_memory,
    load_user_trace,
    nonneg_float,
    nonneg_int,
    positive_int,
    start_metrics,
    user_input,
)
from hicache.cli.benchmarks import standalone_main
from hicache.cli.benchmarks.multiturn_report import (
    conclusion,
    format_table,
    storage_conclusion,
    summarize,
)
from hicache.cli.benchmarks.multiturn_runs import (
    ALL_CONFIGS,
    CONFIGS,
    STORAGE_CONFIGS,
    Request,
    StorageSetup,
    capacities,
    max_request_tokens,
    run_configs,
    to_requests,
)
from hicache.cli.progress import ProgressBar
from hicache.config import CacheConfig
from hicache.sim.model import PRESET_NAMES, Model, preset
from hicache.sim.traces import Request as TraceRequest
from hicache.sim.workloads import generate
from hicache.storage import parse_storage_spec

# The default workload: agentic sessions over two shared 1k-token system prompts,
# each starting with a 512-token task (retrieved context) and appending a 32-token
# tool result and an 8-token reply per turn; all sessions open at once, interleaved.
# A device tier of 25% of the working set holds about one session: it thrashes.
DEFAULT_WORKLOAD = {
    "kind": "agentic",
    "num_system_prompts": 2,
    "system_tokens": 1024,
    "num_sessions": 8,
    "num_turns": 10,
    "first_turn_tokens": 512,
    "turn_tokens": 32,
    "output_tokens": 8,
}

# (flag, parameter of the agentic generator, help)
_WORKLOAD_OPTIONS = [
    ("--system-prompts", "num_system_prompts", "shared system prompts"),
    ("--system-tokens", "system_tokens", "tokens per system prompt"),
    ("--sessions", "num_sessions", "agent sessions, interleaved"),
    ("--turns", "num_turns", "turns per session"),
    ("--first-turn-tokens", "first_turn_tokens", "task tokens of a session's first turn"),
    ("--turn-tokens", "turn_tokens", "tool-result tokens appended per later turn"),
    ("--output-tokens", "output_tokens", "tokens generated per turn"),
]


def add_workload_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """Shape options of the generated agentic workload (``defaults`` override the bench's)."""
    for flag, name, help_text in _WORKLOAD_OPTIONS:
        default = defaults.get(name, DEFAULT_WORKLOAD[name])
        parser.add_argument(flag, dest=name, type=positive_int, default=default, metavar="N",
                            help=f"{help_text} (default: {default})")


def workload_from_args(args: argparse.Namespace) -> dict:
    """The generator parameters chosen on the command line, checked."""
    shape = {"kind": DEFAULT_WORKLOAD["kind"]}
    for flag, name, _ in _WORKLOAD_OPTIONS:
        value = getattr(args, name)
        with user_input():
            shape[name] = check_bounds(flag, value, minimum=1)
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None,
                        help="trace file, JSON Lines (format: docs/workloads.md); default: a "
                        "generated agentic workload shaped by the options below")
    add_workload_arguments(parser)
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="replay only the first N requests")
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES,
                        help="model shapes (default: small)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    parser.add_argument("--device-tokens", type=positive_int, default=None,
                        help="device pool capacity in tokens (default: 25%% of the working set, "
                        "at least one request)")
    parser.add_argument("--host-tokens", type=positive_int, default=None,
                        help="host tier capacity in tokens (default: 2x the working set)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {list(ALL_CONFIGS)} (default: "
                        f"{','.join(CONFIGS)})")
    parser.add_argument("--storage", default=None, metavar="SPEC",
                        help="third tier of hierarchical+storage: 'file:DIR' or "
                        "'mooncake://HOST:PORT?metadata=URL' (default: a fresh temporary "
                        "file: store); pages are namespaced per run")
    parser.add_argument("--storage-host-tokens", type=positive_int, default=None, metavar="N",
                        help="host tier of hierarchical-small-host and hierarchical+storage "
                        "(default: 25%% of --host-tokens, at least one request)")
    parser.add_argument("--prefetch-policy", default="wait_complete",
                        choices=["best_effort", "wait_complete", "timeout"],
                        help="how long a request waits for its stored pages (default "
                        "wait_complete: the pages announced ahead are usually there already; "
                        "best_effort recomputes what is still on its way)")
    parser.add_argument("--prefetch-timeout-s", type=nonneg_float, default=0.05, metavar="S",
                        help="wait of the 'timeout' prefetch policy (default 0.05)")
    parser.add_argument("--lookahead", type=nonneg_int, default=1, metavar="N",
                        help="requests announced ahead of the running one, so their stored "
                        "pages are prefetched while it computes (default 1; 0: none)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads (default 1: the other core runs the "
                        "transfer threads, as a GPU's copy engines run beside its SMs)")
    parser.add_argument("--device", type=cliargs.device, default="cpu",
                        help="where the model and the device pool live: 'cpu' or 'cuda[:N]'")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="workload and model weights")
    add_json(parser)
    add_metrics_port(parser)


# ------------------------------------------------------------------ workload
def generated_trace(seed: int, workload: dict | None = None) -> list[TraceRequest]:
    """A trace of ``workload`` (default :data:`DEFAULT_WORKLOAD`) from :mod:`hicache.sim.workloads`."""
    params = dict(DEFAULT_WORKLOAD if workload is None else workload)
    kind = params.pop("kind")
    return generate(kind, seed=seed, **params)


# ---------------------------------------------------------------------- main
def prepare(args: argparse.Namespace) -> tuple[list[Request], int, int, int]:
    """The requests and the (working set, device, host) token capacities."""
    if args.trace is not None:
        trace = load_user_trace(args.trace, "--trace")
    else:
        with user_input():  # the generator names the shape parameter it refuses
            trace = generated_trace(args.seed, workload_from_args(args))
    if args.requests is not None:
        with user_input():
            check_bounds("--requests", args.requests, minimum=1)
        trace = trace[: args.requests]
    if not trace:
        raise UsageError("workload: expected at least one request, got none")
    requests = to_requests(trace)
    with user_input("--page-size"):  # a hybrid model's state must fit a page
        kv = preset(args.preset).kv_config(args.page_size)
    ws, device_tokens, host_tokens = capacities(
        trace, requests, args.page_size, args.device_tokens, args.host_tokens, kv=kv
    )
    return requests, ws, device_tokens, host_tokens


def storage_setup(
    args: argparse.Namespace, requests: Sequence[Request], host_tokens: int
) -> StorageSetup:
    """The storage configurations' settings; the small host tier defaults to 25% of the
    full one (whole pages), but holds at least the largest request."""
    small = args.storage_host_tokens
    if small is None:
        small = max(host_tokens // 4 // args.page_size * args.page_size,
                    max_request_tokens(requests, args.page_size))
    elif small < args.page_size:
        raise UsageError(
            f"--storage-host-tokens: expected >= page size ({args.page_size}), got {small}"
        )
    with user_input():
        check_bounds("--prefetch-timeout-s", args.prefetch_timeout_s, minimum=0)
    return StorageSetup(small, args.storage, args.prefetch_policy, args.prefetch_timeout_s,
                        args.lookahead)


def check_engine_tiers(model: Model, page_size: int, device_tokens: int,
                       host_tokens: int) -> None:
    """The largest tiers the configurations build hold a page each and fit this machine
    (one line naming --device-tokens / --host-tokens otherwise), checked before the work."""
    for option, tokens in (("--device-tokens", device_tokens), ("--host-tokens", host_tokens)):
        if tokens < page_size:
            raise UsageError(f"{option}: expected at least one page ({page_size} tokens), "
                             f"got {tokens}")
    config = CacheConfig(model.kv_config(page_size), device_tokens=device_tokens,
                         host_tokens=host_tokens, device=str(model.device))
    check_tier_memory(config)


def _check_storage(args: argparse.Namespace, names: list[str]) -> None:
    """``--storage`` is a well-formed spec, and one a chosen configuration uses."""
    if args.storage is None:
        return
    with user_input("--storage"):
        parse_storage_spec(args.storage)
    if not any(n in STORAGE_CONFIGS for n in names):
        raise UsageError(f"--storage: the third tier of {', '.join(STORAGE_CONFIGS)}, but "
                         f"--configs runs only {','.join(names)}; add one of them or drop "
                         "--storage")


def measure(args: argparse.Namespace, log: Callable[[str], None], metrics=None) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown or not names:
        raise UsageError(
            f"--configs: expected names from {list(ALL_CONFIGS)}, got {args.configs!r}"
        )
    with user_input():
        check_bounds("--lookahead", args.lookahead, minimum=0)
    _check_storage(args, names)
    requests, ws, device_tokens, host_tokens = prepare(args)
    storage = storage_setup(args, requests, host_tokens)
    cfg = preset(args.preset)
    model = Model(cfg, device=args.device, seed=args.seed)
    check_engine_tiers(model, args.page_size, device_tokens, host_tokens)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    log(f"workload: {len(requests)} requests, {prompt_tokens} prompt tokens "
        f"(mean {prompt_tokens / len(requests):.0f}), working set {ws} tokens; "
        f"{args.trace or 'generated ' + json.dumps(workload_from_args(args))}")
    log(f"preset {cfg.name}, page size {args.page_size}, device {device_tokens} tokens "
        f"({device_tokens / ws:.0%} of the working set), host {host_tokens} tokens, "
        f"{torch.get_num_threads()} torch threads, load average {psutil.getloadavg()[0]:.1f}")
    if any(n in STORAGE_CONFIGS for n in names):
        log(f"small host tier {storage.host_tokens} tokens ({storage.host_tokens / ws:.0%} of "
            f"the working set); storage {storage.spec or 'a fresh temporary file: store'}, "
            f"prefetch {storage.prefetch_policy}, lookahead {storage.lookahead}")

    # A bar per configuration on a terminal (a run takes minutes); nothing with --json.
    progress = None if args.json else ProgressBar(len(requests), sys.stdout).update
    runs = run_configs(model, requests, names, device_tokens, host_tokens, args.page_size,
                       progress, storage, metrics)
    summaries = {name: summarize(res, requests) for name, res in runs.items()}
    log("")
    for line in format_table(summaries):
        log(line)
    log(conclusion(summaries))
    note = storage_conclusion(summaries)
    if note is not None:
        log(note)
    return {
        "preset": cfg.name,
        "page_size": args.page_size,
        "trace": args.trace,
        "workload": None if args.trace else workload_from_args(args),
        "seed": args.seed,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "working_set_tokens": ws,
        "device_tokens": device_tokens,
        "host_tokens": host_tokens,
        "storage_host_tokens": storage.host_tokens,
        "storage": storage.spec,
        "prefetch_policy": storage.prefetch_policy,
        "lookahead": storage.lookahead,
        "torch_threads": torch.get_num_threads(),
        "load_average": psutil.getloadavg()[0],
        "configs": summaries,
    }


def run(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    metrics = start_metrics(args, "hicache bench multiturn")
    try:
        result = measure(args, log, metrics)
    finally:
        if metrics is not None:
            metrics.close()
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
