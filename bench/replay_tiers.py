"""What a host tier buys in replay, and what it costs in bookkeeping speed.

The regime: bookkeeping only (no KV; transfers complete at once), one trace,
three configurations in the same run, interleaved over ``--repeats`` rounds
(medians quoted):

* ``unbounded``: device-only with room for every unique token (the best hit ratio);
* ``device``: device-only at ``--device-fraction`` of the unique tokens (the tree
  and allocator alone: what ``hicache replay`` without ``--host-tokens`` runs);
* ``device-hicache``: the same device tier through HiCache with no host tier, so
  the ratio below it isolates what the host tier itself costs;
* ``hierarchical``: the same device plus a host tier holding every unique token,
  through the real HiCache (write-through, LRU);
* ``calls-floor``: the tree and allocator calls that ``hierarchical`` makes per
  request (match, load-back with eviction, allocation, insert, write-through
  backup with host eviction, unlock) in a bare loop: no handle, no checks, no
  counters. What any Python lifecycle over this tree would cost at the least.

Targets (issue 4): hierarchical hit ratio >= 0.99 x unbounded; hierarchical
req/s >= 0.5 x device-only req/s.

    .venv/bin/python bench/replay_tiers.py TRACE [--tree python|native|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from hicache.allocator import PageAllocator
from hicache.native import make_tree
from hicache.replay import (
    ReplayResult,
    _prepare,
    frozen_gc,
    replay_device,
    replay_hicache_device_only,
    replay_hierarchical,
)
from hicache.traces import load_trace, trace_stats


def calls_floor(requests, P: int, device_tokens: int, host_tokens: int, tree) -> ReplayResult:
    """The host-tier lifecycle's tree and allocator calls, write-through, in a bare loop."""
    dev = PageAllocator(device_tokens // P, "device pages")
    host = PageAllocator(host_tokens // P, "host pages")
    device_hits = host_hits = prompt_total = 0

    def alloc_device(n: int):
        short = n - dev.num_free_pages
        if short > 0:
            r = tree.evict_device(short * P)
            if r.num_evicted_tokens:
                dev.free(r.device_indices)
        return dev.alloc(n)

    def attach(nodes, pages, attach_fn) -> None:
        off = 0
        for node in nodes:
            n = node.num_tokens // P
            attach_fn(node, pages[off : off + n])
            off += n

    with frozen_gc():
        start = time.perf_counter()
        for prompt, full in requests:
            m = tree.match_prefix(prompt)
            node, hit = m.last_device_node, m.device_len
            tree.lock(node)
            device_hits += hit
            if m.host_len:  # load back
                nodes = tree.host_only_path(m)
                pages = alloc_device(m.host_len // P)
                if pages is not None:
                    attach(nodes, pages, tree.attach_device)
                    tree.lock(nodes[-1])
                    tree.unlock(node)
                    node, hit = nodes[-1], hit + m.host_len
                    host_hits += m.host_len
            need = (len(full) - hit) // P
            new = alloc_device(need)
            if new is not None and need:
                r = tree.insert(full, tree.device_indices_of(node, new))
                if r.num_cached_tokens > hit:
                    dev.free(new[: (r.num_cached_tokens - hit) // P])
                tree.lock(r.last_node)
                tree.unlock(node)
                node = r.last_node
                todo = tree.path_missing_host(node)  # write-through backup
                if todo:
                    num = sum(n.num_tokens for n in todo) // P
                    short = num - host.num_free_pages
                    if short > 0:
                        e = tree.evict_host(short * P)
                        if e.num_evicted_tokens:
                            host.free(e.device_indices)
                    host_pages = host.alloc(num)
                    if host_pages is not None:
                        attach(todo, host_pages, tree.attach_host)
            tree.unlock(node)
            prompt_total += len(prompt)
        seconds = time.perf_counter() - start
    return ReplayResult(len(requests), seconds, prompt_total, device_hits + host_hits, 0, 0,
                        tree.device_tokens, device_hit_tokens=device_hits,
                        host_hit_tokens=host_hits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-fraction", type=float, default=0.25)
    parser.add_argument("--tree", default="auto", choices=["python", "native", "auto"])
    parser.add_argument("--write-policy", default="write_through")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    P = args.page_size
    unique = trace_stats(load_trace(args.trace), P).working_set_tokens
    requests = _prepare(args.trace, P)
    device_tokens = max(P, int(unique * args.device_fraction) // P * P)
    host_tokens = unique + 64 * P  # every unique page, plus slack for partial turns

    def unbounded():
        return replay_device(requests, P, 2 * unique, tree=make_tree(args.tree, P, "lru"))

    def device():
        return replay_device(requests, P, device_tokens, tree=make_tree(args.tree, P, "lru"))

    def hierarchical():
        return replay_hierarchical(
            requests, P, device_tokens, host_tokens, args.write_policy, tree=args.tree
        )

    def device_hicache():
        return replay_hicache_device_only(requests, P, device_tokens, args.tree)

    def floor():
        return calls_floor(requests, P, device_tokens, host_tokens, make_tree(args.tree, P, "lru"))

    runs = {"unbounded": unbounded, "device": device, "device-hicache": device_hicache,
            "hierarchical": hierarchical, "calls-floor": floor}
    for fn in runs.values():
        fn()  # warm-up
    rps: dict[str, list[float]] = {k: [] for k in runs}
    last = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            last[name] = fn()
            rps[name].append(last[name].req_per_s)

    print(f"trace {os.path.basename(args.trace)}: {unique} unique tokens, device "
          f"{device_tokens} ({args.device_fraction:.0%}), host {host_tokens}, tree {args.tree}")
    print(f"{'config':<14}{'req/s (median)':>16}{'hit ratio':>11}{'device hits':>13}"
          f"{'host hits':>11}")
    out = {}
    for name, r in last.items():
        med = statistics.median(rps[name])
        out[name] = {"req_per_s": round(med, 1), "hit_ratio": round(r.hit_ratio, 6),
                     "device_hit_tokens": r.device_hit_tokens, "host_hit_tokens": r.host_hit_tokens}
        print(f"{name:<14}{med:>16.0f}{r.hit_ratio:>11.4f}{r.device_hit_tokens:>13}"
              f"{r.host_hit_tokens:>11}")
    hit_vs_unbounded = out["hierarchical"]["hit_ratio"] / out["unbounded"]["hit_ratio"]
    speed_vs_device = out["hierarchical"]["req_per_s"] / out["device"]["req_per_s"]
    speed_vs_hicache = out["hierarchical"]["req_per_s"] / out["device-hicache"]["req_per_s"]
    print(f"hierarchical hit ratio / unbounded:        {hit_vs_unbounded:.4f} (target >= 0.99)")
    print(f"hierarchical req/s / device-only:          {speed_vs_device:.2f} (target >= 0.50)")
    print(f"hierarchical req/s / HiCache device-only:  {speed_vs_hicache:.2f}")
    floor_vs_device = out["calls-floor"]["req_per_s"] / out["device"]["req_per_s"]
    print(f"calls-floor req/s / device-only:           {floor_vs_device:.2f} "
          "(the most a Python lifecycle over this tree could reach)")
    print(json.dumps({"trace": os.path.basename(args.trace), "unique_tokens": unique,
                      "device_tokens": device_tokens, "host_tokens": host_tokens,
                      "tree": args.tree, "configs": out,
                      "hit_vs_unbounded": round(hit_vs_unbounded, 4),
                      "speed_vs_device": round(speed_vs_device, 3),
                      "speed_vs_hicache_device": round(speed_vs_hicache, 3),
                      "calls_floor_vs_device": round(floor_vs_device, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
