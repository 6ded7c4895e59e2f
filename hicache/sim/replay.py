"""``hicache replay``: run a trace through the cache's bookkeeping and report hit ratios.

Device tier only (the replay semantics of docs/workloads.md), per request:

    1. match the page-aligned prompt; hit = matched tokens; lock the matched path
    2. full = prompt + output cut to whole pages; need = len(full) - hit;
       evict device pages (LRU, unlocked leaves first) until need fits
    3. insert full (new tokens take new pages); unlock

With ``--host-tokens`` the real :class:`hicache.HiCache` runs in bookkeeping-only
mode (no KV tensors, transfers complete at once), and device-evicted pages that
have a host copy stay matchable as host hits. Only cache operations are timed:
the trace is parsed into int32 arrays beforehand, as an engine holding token ids
in tensors would.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from hicache.cache import HiCache
from hicache.cli.args import TRACE_HELP, UsageError, add_json, positive_int, require_matplotlib
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, WritePolicy
from hicache.memory import PageAllocator
from hicache.sim.traces import load_trace_arrays
from hicache.tree import RadixTree


class ReplayResult(NamedTuple):
    requests: int
    seconds: float  # cache operations only
    prompt_tokens: int
    hit_tokens: int  # device hits plus host hits loaded back
    evicted_tokens: int  # evicted from the device
    skipped_inserts: int  # requests whose new pages could not be allocated (all locked)
    cached_tokens: int  # on the device at the end
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    host_evicted_tokens: int = 0
    lifecycle: str = ""  # HiCache replays: "native" (C++) or "python"

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("inf")

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Freeze the objects that exist now out of the garbage collector's sight while inside.

    What an engine does once it has started (its model, its modules: nothing it
    will free): full collections then walk only the objects made since, the cache's
    own. The parsed trace and the hundreds of thousands of objects torch's modules
    hold would otherwise be walked by every full collection and billed to the
    cache. The frozen objects return to the collector on exit, unless some were
    frozen before (an engine's own ``gc.freeze()``): those stay frozen, and with
    them what this froze.
    """
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def replay_device(
    requests: list[tuple[np.ndarray, np.ndarray]],
    page_size: int,
    device_tokens: int,
    eviction: EvictionPolicy | str = EvictionPolicy.LRU,
    tree: RadixTree | None = None,
) -> ReplayResult:
    """Replay ``(prompt, full)`` int32 arrays through a device-only radix tree and allocator."""
    tree = tree if tree is not None else RadixTree(page_size, eviction)
    allocator = PageAllocator(device_tokens // page_size, "device pages")
    hit_total = prompt_total = evicted = skipped = 0
    with frozen_gc():
        start = time.perf_counter()
        for prompt, full in requests:
            match = tree.match_prefix(prompt)
            hit = match.device_len
            node = match.last_device_node
            tree.lock(node)
            need_pages = (len(full) - hit) // page_size
            short = need_pages - allocator.num_free_pages
            if short > 0:
                result = tree.evict_device(short * page_size)
                if result.num_evicted_tokens:
                    allocator.free(result.page_ids)
                    evicted += result.num_evicted_tokens
            new_pages = allocator.alloc(need_pages)
            if new_pages is None:
                skipped += 1
            elif need_pages:
                pages = tree.device_indices_of(node, new_pages)
                cached = tree.insert(full, pages).num_cached_tokens
                if cached > hit:  # another insert got there first: give our copies back
                    allocator.free(new_pages[: (cached - hit) // page_size])
            tree.unlock(node)
            hit_total += hit
            prompt_total += len(prompt)
        seconds = time.perf_counter() - start
    return ReplayResult(
        len(requests), seconds, prompt_total, hit_total, evicted, skipped, tree.device_tokens,
        device_hit_tokens=hit_total,
    )


def replay_hicache_device_only(
    requests: list[tuple[np.ndarray, np.ndarray]], page_size: int, device_tokens: int,
    tree: str = "python", lifecycle: str = "auto",
) -> ReplayResult:
    """:func:`replay_hierarchical` without a host tier: HiCache's own device-only cost."""
    return replay_hierarchical(
        requests, page_size, device_tokens, None, tree=tree, lifecycle=lifecycle
    )


def replay_hierarchical(
    requests: list[tuple[np.ndarray, np.ndarray]],
    page_size: int,
    device_tokens: int,
    host_tokens: int | None,
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
    eviction: EvictionPolicy | str = EvictionPolicy.LRU,
    tree: str = "python",
    lifecycle: str = "auto",
) -> ReplayResult:
    """Replay through a bookkeeping-only :class:`HiCache` with a host tier.

    Per request: match (host hits load back at once), allocate the new pages,
    insert ``full``, release. A KV shape is needed only to size transfers; no KV
    tensors exist and every transfer completes at submission. ``lifecycle``:
    see :attr:`hicache.config.CacheConfig.lifecycle` (the C++ lifecycle needs
    the native tree).
    """
    config = CacheConfig(
        KVConfig(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16", page_size=page_size),
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        write_policy=write_policy,
        eviction=eviction,
        allocate_kv=False,
        tree=tree,
        lifecycle=lifecycle,
    )
    cache = HiCache(config)
    prompt_total = skipped = 0
    with frozen_gc():
        start = time.perf_counter()
        for prompt, full in requests:
            h = cache.match(prompt)
            if cache.alloc(h, len(full) - h.prefix_len) is None:
                skipped += 1
            else:
                cache.insert(h, full)
            cache.release(h)
            prompt_total += len(prompt)
        seconds = time.perf_counter() - start
    c = cache.counters
    return ReplayResult(
        len(requests), seconds, prompt_total, c.device_hit_tokens + c.host_hit_tokens,
        c.device_evicted_tokens, skipped, cache.tree.device_tokens,
        device_hit_tokens=c.device_hit_tokens, host_hit_tokens=c.host_hit_tokens,
        host_evicted_tokens=c.host_evicted_tokens, lifecycle=cache.lifecycle,
    )


def tree_bytes_per_cached_token(
    requests: list[tuple[np.ndarray, np.ndarray]], page_size: int, device_tokens: int,
    eviction: EvictionPolicy | str, kind: str = "python",
) -> float:
    """Replay again under tracemalloc; return the tree's memory per cached token.

    tracemalloc sees Python objects (nodes, dicts, key bytes, tensor wrappers);
    the index tensors' storage comes from torch's allocator, so it is added
    separately (each storage counted once, since split nodes share storages).
    """
    tree = _make_tree(kind, page_size, eviction)
    if hasattr(tree, "memory_bytes"):  # the native tree counts its own allocations
        result = replay_device(requests, page_size, device_tokens, eviction, tree=tree)
        return tree.memory_bytes() / max(result.cached_tokens, 1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = replay_device(requests, page_size, device_tokens, eviction, tree=tree)
    python_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    storages: dict[int, int] = {}
    for node in tree.nodes():
        for idx in (node.device_indices, node.host_indices):
            if idx is not None:
                st = idx.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
    total = python_bytes + sum(storages.values())
    return total / max(result.cached_tokens, 1)


def _prepare(trace: str, page_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    prepared = []
    for req in load_trace_arrays(trace):
        full = np.concatenate((req.prompt, req.output))
        full = full[: len(full) // page_size * page_size]
        prepared.append((req.prompt, full))
    return prepared


def _make_tree(kind: str, page_size: int, eviction: str):
    if kind == "python":
        return RadixTree(page_size, eviction)
    from hicache.tree import make_tree

    return make_tree(kind, page_size, eviction)


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


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    requests = _prepare(args.trace, args.page_size)
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
        tree = _make_tree(args.tree, args.page_size, args.eviction)
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
