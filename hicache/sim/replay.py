"""Replay a trace through the cache's bookkeeping: hit ratios and cache operations per second.

Device tier only (the replay semantics of docs/workloads.md), per request:

    1. match the page-aligned prompt; hit = matched tokens; lock the matched path
    2. full = prompt + output cut to whole pages; need = len(full) - hit;
       evict device pages (LRU, unlocked leaves first) until need fits
    3. insert full (new tokens take new pages); unlock

With a host tier (:func:`replay_hierarchical`) the real :class:`hicache.HiCache` runs
in bookkeeping-only mode (no KV tensors, transfers complete at once), and
device-evicted pages that have a host copy stay matchable as host hits. Only cache
operations are timed: the trace is parsed into int32 arrays beforehand
(:func:`prepare_requests`), as an engine holding token ids in tensors would.

The ``hicache replay`` command around these functions is :mod:`hicache.cli.replay`.
"""

from __future__ import annotations

import contextlib
import gc
import time
import tracemalloc
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from hicache.cache import HiCache
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, WritePolicy
from hicache.memory import PageAllocator
from hicache.sim.traces import Request, load_trace_arrays
from hicache.tree import RadixTree, make_tree
from hicache.tree.protocol import RadixTreeLike


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
    tree: RadixTreeLike | None = None,
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
    tree = make_tree(kind, page_size, eviction)
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


def prepare_requests(trace: str, page_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A trace file as ``(prompt, full)`` int32 arrays, ``full`` = prompt + output cut to whole
    pages: what the replays take, parsed once so that no parsing lands in a timed loop."""
    return replay_arrays(load_trace_arrays(trace), page_size)


def replay_arrays(requests: list[Request], page_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Requests (from :func:`hicache.sim.traces.load_trace_arrays`) as :func:`prepare_requests`
    gives them."""
    prepared = []
    for req in requests:
        full = np.concatenate((req.prompt, req.output))
        full = full[: len(full) // page_size * page_size]
        prepared.append((np.asarray(req.prompt, dtype=np.int32), full))
    return prepared
