"""What a host tier buys in replay, and what it costs in bookkeeping speed.

The regime: bookkeeping only (no KV; transfers complete at once), one trace,
the configurations below in the same run, interleaved over ``--repeats``
rounds (medians quoted):

* ``unbounded``: device-only with room for every unique token (the best hit ratio);
* ``device``: device-only at ``--device-fraction`` of the unique tokens (the tree
  and allocator alone: what ``hicache replay`` without ``--host-tokens`` runs);
* ``device-hicache``: the same device tier through HiCache with no host tier, so
  the ratio below it isolates what the host tier itself costs;
* ``hierarchical``: the same device plus a host tier holding every unique token,
  through the real HiCache (write-through, LRU), whose lifecycle runs in C++
  when the tree is native (``CacheConfig.lifecycle="auto"``);
* ``hierarchical-py``: the same with ``lifecycle="python"``: HiCache's Python
  lifecycle over the same tree (identical hits, tested).

Targets (issue 4): hierarchical hit ratio >= 0.99 x unbounded; hierarchical
req/s >= 0.5 x device-only req/s.

    hicache bench tiers TRACE [--tree python|native|auto] [--repeats N]
    (bench/replay_tiers.py runs the same)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from hicache.cli.args import TRACE_HELP, add_json, fraction, load_user_trace, positive_int
from hicache.cli.benchmarks import standalone_main
from hicache.config import WritePolicy
from hicache.sim.replay import (
    replay_arrays,
    replay_device,
    replay_hicache_device_only,
    replay_hierarchical,
)
from hicache.sim.traces import trace_stats
from hicache.tree import make_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help=TRACE_HELP)
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    parser.add_argument("--device-fraction", type=fraction, default=0.25,
                        help="device tier as a fraction of the trace's unique tokens")
    parser.add_argument("--tree", default="auto", choices=["python", "native", "auto"],
                        help="radix tree implementation (auto: native when it is available)")
    parser.add_argument("--write-policy", default="write_through",
                        choices=[p.value for p in WritePolicy],
                        help="when a device page gets its host copy")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="interleaved rounds (medians)")
    add_json(parser)


def run(args: argparse.Namespace) -> int:
    say = (lambda *_a, **_k: None) if args.json else print
    P = args.page_size
    trace = load_user_trace(args.trace, arrays=True)
    unique = trace_stats(trace, P).working_set_tokens
    requests = replay_arrays(trace, P)
    device_tokens = max(P, int(unique * args.device_fraction) // P * P)
    host_tokens = unique + 64 * P  # every unique page, plus slack for partial turns

    def unbounded():
        return replay_device(requests, P, 2 * unique, tree=make_tree(args.tree, P, "lru"))

    def device():
        return replay_device(requests, P, device_tokens, tree=make_tree(args.tree, P, "lru"))

    def hierarchical(lifecycle: str = "auto"):
        return replay_hierarchical(
            requests, P, device_tokens, host_tokens, args.write_policy, tree=args.tree,
            lifecycle=lifecycle,
        )

    def device_hicache():
        return replay_hicache_device_only(requests, P, device_tokens, args.tree)

    runs = {"unbounded": unbounded, "device": device, "device-hicache": device_hicache,
            "hierarchical": hierarchical,
            "hierarchical-py": lambda: hierarchical("python")}
    for fn in runs.values():
        fn()  # warm-up
    rps: dict[str, list[float]] = {k: [] for k in runs}
    last = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            last[name] = fn()
            rps[name].append(last[name].req_per_s)

    say(f"trace {os.path.basename(args.trace)}: {unique} unique tokens, device "
        f"{device_tokens} ({args.device_fraction:.0%}), host {host_tokens}, tree {args.tree}")
    say(f"{'config':<16}{'req/s (median)':>16}{'hit ratio':>11}{'device hits':>13}"
        f"{'host hits':>11}")
    out = {}
    for name, r in last.items():
        med = statistics.median(rps[name])
        out[name] = {"req_per_s": round(med, 1), "hit_ratio": round(r.hit_ratio, 6),
                     "device_hit_tokens": r.device_hit_tokens, "host_hit_tokens": r.host_hit_tokens}
        say(f"{name:<16}{med:>16.0f}{r.hit_ratio:>11.4f}{r.device_hit_tokens:>13}"
            f"{r.host_hit_tokens:>11}")
    hit_vs_unbounded = out["hierarchical"]["hit_ratio"] / out["unbounded"]["hit_ratio"]
    speed_vs_device = out["hierarchical"]["req_per_s"] / out["device"]["req_per_s"]
    speed_vs_hicache = out["hierarchical"]["req_per_s"] / out["device-hicache"]["req_per_s"]
    say(f"hierarchical hit ratio / unbounded:        {hit_vs_unbounded:.4f} (target >= 0.99)")
    per_round = statistics.median(
        h / d for h, d in zip(rps["hierarchical"], rps["device"], strict=True)
    )
    say(f"hierarchical req/s / device-only:          {speed_vs_device:.2f} (target >= 0.50; "
        f"median of per-round ratios {per_round:.2f})")
    say(f"hierarchical req/s / HiCache device-only:  {speed_vs_hicache:.2f}")
    py_vs_device = out["hierarchical-py"]["req_per_s"] / out["device"]["req_per_s"]
    say(f"hierarchical-py req/s / device-only:       {py_vs_device:.2f} (Python lifecycle)")
    print(json.dumps({"trace": os.path.basename(args.trace), "unique_tokens": unique,
                      "device_tokens": device_tokens, "host_tokens": host_tokens,
                      "tree": args.tree, "configs": out,
                      "hit_vs_unbounded": round(hit_vs_unbounded, 4),
                      "speed_vs_device": round(speed_vs_device, 3),
                      "speed_vs_device_per_round": round(per_round, 3),
                      "speed_vs_hicache_device": round(speed_vs_hicache, 3),
                      "python_lifecycle_vs_device": round(py_vs_device, 3)}))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
