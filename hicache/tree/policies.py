"""Eviction order: one key per policy and a lazy candidate heap.

Keys (smaller leaves first; ``csrc/tree.cpp`` ``RadixTree::entry`` computes the same)::

    lru       (last_access,)                 least recently used
    lfu       (hit_count, last_access)       fewest hits, then least recent
    fifo      (created,)                     created first
    mru       (-last_access,)                most recently used
    filo      (-created,)                    created last
    priority  (priority, last_access)        lowest priority, then least recent
    slru      (hit_count >= 2, last_access)  probationary segment before protected, LRU within

``created`` is the tree clock tick of the insert that made a node (a split keeps
it for both halves); ``priority`` is the largest priority any match or insert
gave a node (``RadixTree.raise_priority``).

A heap entry is ``(priority, seq, node)``. Entries are never removed eagerly:
when a node's priority changes, or it stops being a candidate, its old entry
simply goes stale, and ``pop`` skips stale entries. A node's newest entry is
the one whose ``seq`` equals the node's recorded seq (``seq_attr``). This keeps
every update O(log n) instead of SGLang's O(leaves) rescan on every eviction.

The heap knows nothing of tiers or of what makes a node a candidate: the
caller passes that predicate to ``pop``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from hicache.config import EvictionPolicy

# SLRU: a node hit this many times leaves the probationary segment (SGLang's threshold).
SLRU_PROTECTED_HITS = 2

# A heap key: ints compared in order (the rank first in the heap, then the policy's key).
EvictionKey = tuple[int, ...]


def priority_fn(policy: EvictionPolicy) -> Callable[[Any], EvictionKey]:
    """Return the key function for a policy: smaller keys are evicted first."""
    if policy is EvictionPolicy.LRU:
        return lambda node: (node.last_access,)
    if policy is EvictionPolicy.LFU:
        return lambda node: (node.hit_count, node.last_access)
    if policy is EvictionPolicy.FIFO:
        return lambda node: (node.created,)
    if policy is EvictionPolicy.MRU:
        return lambda node: (-node.last_access,)
    if policy is EvictionPolicy.FILO:
        return lambda node: (-node.created,)
    if policy is EvictionPolicy.PRIORITY:
        return lambda node: (node.priority, node.last_access)
    if policy is EvictionPolicy.SLRU:
        return lambda node: (int(node.hit_count >= SLRU_PROTECTED_HITS), node.last_access)
    raise ValueError(f"eviction: expected one of {[p.value for p in EvictionPolicy]}, got {policy!r}")


class CandidateHeap:
    """Lazy min-heap of eviction candidates for one tier.

    ``seq_attr`` names the node attribute that records the seq of the node's
    newest entry (each tier uses its own attribute, so one node can sit in both
    tiers' heaps). ``rank`` prefixes the priority, e.g. to evict host-only nodes
    before dropping host copies of device-resident ones.
    """

    def __init__(self, priority: Callable[[Any], EvictionKey], seq_attr: str) -> None:
        self._priority = priority
        self._seq_attr = seq_attr
        self._heap: list[tuple[EvictionKey, int, Any]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Any, rank: int = 0) -> None:
        self._seq += 1
        setattr(node, self._seq_attr, self._seq)
        heapq.heappush(self._heap, ((rank, *self._priority(node)), self._seq, node))

    def pop(self, is_candidate: Callable[[Any], int | None]) -> Any | None:
        """Pop the best live candidate, or ``None`` if none is left.

        ``is_candidate(node)`` returns the node's current rank if it is a
        candidate, else ``None``. Entries whose seq, rank or priority no longer
        match the node are stale and dropped.
        """
        heap = self._heap
        while heap:
            prio, seq, node = heapq.heappop(heap)
            if seq != getattr(node, self._seq_attr):
                continue
            rank = is_candidate(node)
            if rank is None or prio != (rank, *self._priority(node)):
                continue
            setattr(node, self._seq_attr, 0)
            return node
        return None

    def peek(self, is_candidate: Callable[[Any], int | None]) -> tuple[EvictionKey, Any] | None:
        """The best live candidate and its priority, left in the heap; ``None`` if none.

        Drops the stale entries above it, as :meth:`pop` would; a ``pop`` with the
        same predicate right after returns the same node.
        """
        heap = self._heap
        while heap:
            prio, seq, node = heap[0]
            if seq == getattr(node, self._seq_attr):
                rank = is_candidate(node)
                if rank is not None and prio == (rank, *self._priority(node)):
                    return prio, node
            heapq.heappop(heap)
        return None

    def live_priorities(self) -> dict[int, EvictionKey]:
        """Map each entry's seq to its priority; for integrity checks (O(n))."""
        return {seq: prio for prio, seq, _ in self._heap}

    def expected_priority(self, node: Any, rank: int) -> EvictionKey:
        return (rank, *self._priority(node))

    def rebuild(self, candidates: Iterable[tuple[Any, int]]) -> None:
        """Replace all entries by fresh ones for ``(node, rank)`` pairs (drops stale entries)."""
        self._heap = []
        for node, rank in candidates:
            self._seq += 1
            setattr(node, self._seq_attr, self._seq)
            self._heap.append(((rank, *self._priority(node)), self._seq, node))
        heapq.heapify(self._heap)
