"""``hicache replay``: run a trace through the cache's bookkeeping and report hit ratios.

The options, their checks and the table or JSON line; the replays themselves are
:mod:`hicache.sim.replay`.
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache.cli.args import (
    TRACE_HELP,
    UsageError,
    add_json,
    check_tier_memory,
    load_user_trace,
    positive_int,
    require_matplotlib,
    user_input,
)
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, WritePolicy
from hicache.sim.replay import (
    ReplayResult,
    make_tree,
    replay_arrays,
    replay_device,
    replay_hierarchical,
    tree_bytes_per_cached_token,
)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 0:
        raise argparse.ArgumentTypeError(f"expected token counts >= 0, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help=TRACE_HELP)
    parser.add_argument("--page-size", type=positive_int, default=16,
                        help="tokens per page, the unit of caching")
    parser.add_argument("--device-tokens", type=positive_int, required=True,
                        help="device tier capacity in tokens (at least one page)")
    parser.add_argument("--host-tokens", type=positive_int,
                        help="host tier capacity in tokens; runs the real HiCache in "
                        "bookkeeping-only mode with a host tier (default: device tier only)")
    parser.add_argument(
        "--write-policy", choices=[p.value for p in WritePolicy], default="write_through",
        help="when a device page gets its host copy (with a host tier)",
    )
    parser.add_argument("--eviction", choices=[p.value for p in EvictionPolicy], default="lru",
                        help="which unlocked leaf is evicted first")
    parser.add_argument(
        "--tree", choices=["python", "native", "auto"], default="auto",
        help="radix tree implementation (auto: native when it is available)",
    )
    parser.add_argument(
        "--sweep-host", type=_sizes, metavar="A,B,C",
        help="replay once per host tier capacity (tokens; 0: no host tier) and report the hit "
        "ratio of each, for capacity planning",
    )
    parser.add_argument("--plot", metavar="FILE.png",
                        help="with --sweep-host: draw hit ratio against host capacity "
                        "(needs matplotlib)")
    add_json(parser)


def _print_table(out: dict) -> None:
    print(f"{'metric':<28}{'value':>16}")
    for k, v in out.items():
        print(f"{k:<28}{v:>16}")


def _sweep(args: argparse.Namespace, requests) -> dict:
    rows = []
    say = (lambda _line: None) if args.json else print
    say(f"{'host_tokens':>12}{'hit_ratio':>11}{'device_hits':>13}{'host_hits':>11}{'req/s':>9}")
    for host_tokens in args.sweep_host:
        r = replay_hierarchical(
            requests, args.page_size, args.device_tokens, host_tokens or None, args.write_policy,
            args.eviction, args.tree,
        )
        rows.append({
            "host_tokens": host_tokens, "hit_ratio": round(r.hit_ratio, 6),
            "device_hit_tokens": r.device_hit_tokens, "host_hit_tokens": r.host_hit_tokens,
            "req_per_s": round(r.req_per_s, 1),
        })
        say(f"{host_tokens:>12}{r.hit_ratio:>11.4f}{r.device_hit_tokens:>13}"
            f"{r.host_hit_tokens:>11}{r.req_per_s:>9.0f}")
    if args.plot:
        _plot_sweep(rows, args)
        say(f"plot written to {args.plot}")
    return {"device_tokens": args.device_tokens, "sweep": rows}


def _plot_sweep(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["host_tokens"] for r in rows], [r["hit_ratio"] for r in rows], marker="o")
    ax.set_xlabel("host tier capacity (tokens)")
    ax.set_ylabel("hit ratio (device + host)")
    ax.set_title(f"{args.trace.split('/')[-1]}: device {args.device_tokens} tokens")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def _check_args(args: argparse.Namespace) -> None:
    """Every option checked before the trace is read (one line and exit 2 on a mistake)."""
    P = args.page_size
    if args.device_tokens < P:
        raise UsageError(f"--device-tokens: expected at least one page ({P} tokens), "
                         f"got {args.device_tokens}")
    if args.host_tokens is not None and args.host_tokens < P:
        raise UsageError(f"--host-tokens: expected at least one page ({P} tokens), "
                         f"got {args.host_tokens}")
    if args.sweep_host:
        if args.host_tokens is not None:
            raise UsageError("--sweep-host replaces --host-tokens; give one of them")
        small = [n for n in args.sweep_host if 0 < n < P]
        if small:
            raise UsageError(f"--sweep-host: expected 0 (no host tier) or at least one page "
                             f"({P} tokens), got {small[0]}")
    if args.plot:
        if not args.sweep_host:
            raise UsageError("--plot draws a --sweep-host curve; give --sweep-host too")
        require_matplotlib()
    if args.tree == "native":
        from hicache.tree.native import load_native

        load_native()  # NativeBuildError (a RuntimeError) would be a traceback: say why
    _check_memory(args)


def _check_memory(args: argparse.Namespace) -> None:
    """The page allocators of the largest replay fit in memory, checked before the trace
    is read. The device-only replay builds its own allocator, so the check is made
    here, on the config a replay with a host tier would use."""
    host_sizes = args.sweep_host or [args.host_tokens or 0]
    kv = KVConfig(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16",
                  page_size=args.page_size)
    with user_input():
        config = CacheConfig(kv, device_tokens=args.device_tokens,
                             host_tokens=max(host_sizes) or None, allocate_kv=False)
    check_tier_memory(config, host_option="--sweep-host" if args.sweep_host else "--host-tokens")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    requests = replay_arrays(load_user_trace(args.trace, arrays=True), args.page_size)
    if args.sweep_host:
        out = _sweep(args, requests)
    elif args.host_tokens is not None:
        r = replay_hierarchical(
            requests, args.page_size, args.device_tokens, args.host_tokens, args.write_policy,
            args.eviction, args.tree,
        )
        out = _result_dict(r)
        out.update(
            device_hit_tokens=r.device_hit_tokens, host_hit_tokens=r.host_hit_tokens,
            host_evicted_tokens=r.host_evicted_tokens, write_policy=args.write_policy,
            lifecycle=r.lifecycle,
        )
    else:
        tree = make_tree(args.tree, args.page_size, args.eviction)
        r = replay_device(requests, args.page_size, args.device_tokens, args.eviction, tree=tree)
        out = _result_dict(r)
        out["device_hit_tokens"] = r.device_hit_tokens
        out["host_hit_tokens"] = 0
        out["tree"] = type(tree).__name__
        out["tree_bytes_per_cached_token"] = round(
            tree_bytes_per_cached_token(
                requests, args.page_size, args.device_tokens, args.eviction, args.tree
            ), 2,
        )
    if args.json:
        print(json.dumps(out))
    elif not args.sweep_host:
        _print_table(out)
    sys.stdout.flush()
    return 0


def _result_dict(r: ReplayResult) -> dict:
    return {
        "requests": r.requests,
        "seconds": round(r.seconds, 6),
        "req_per_s": round(r.req_per_s, 1),
        "prompt_tokens": r.prompt_tokens,
        "hit_tokens": r.hit_tokens,
        "hit_ratio": round(r.hit_ratio, 6),
        "evicted_tokens": r.evicted_tokens,
        "skipped_inserts": r.skipped_inserts,
    }
