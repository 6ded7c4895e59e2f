"""KV cache events for cache-aware routers: which pages entered or left which tier.

A router that sends each request to the engine holding most of its prefix keeps
a mirror of every engine's cache; these events are what it builds the mirror
from. They are shaped like vLLM's KV events::

    BlockStored(tier, block_hashes, parent_block_hash, num_tokens, namespace)
    BlockRemoved(tier, block_hashes, namespace)
    AllBlocksCleared(tier)

``tier`` is ``"device"``, ``"host"`` or ``"storage"``; one block is one page.
A page's hash chains over its whole prefix, so equal hashes mean equal prefixes
(within a namespace, which events carry separately)::

    h_0 = mix(0,   poly(tokens[0 : P]))
    h_1 = mix(h_0, poly(tokens[P : 2P]))
    poly(page)  = sum((t_i + 1) * K**(i + 1)) mod 2**64,  K = FNV-1a's 64-bit prime
    mix(p, x)   = splitmix64(p * 0x9E3779B97F4A7C15 + x)  (mod 2**64)

A 64-bit non-cryptographic hash: collisions become likely only near 2**32
distinct pages. ``csrc/tree.cpp`` computes the same values (``page_hashes``).

Both radix trees log the device and host events themselves, at the moment a
node's pages enter or leave a tier (so the C++ request lifecycle logs them too,
with no Python in its path); ``HiCache`` adds the storage events and the
all-cleared events of a reset, in order, and hands them out with
``HiCache.take_events()``. Logging is off unless ``CacheConfig.kv_events``.

What this module does not know: trees, caches, transports to a router.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

_MASK = (1 << 64) - 1
_K = 0x100000001B3
_GOLDEN = 0x9E3779B97F4A7C15
_POWERS: dict[int, np.ndarray] = {}  # page size -> K**(i+1) mod 2**64, i < page size


class BlockStored(NamedTuple):
    tier: str  # "device" | "host" | "storage"
    block_hashes: tuple[int, ...]  # one chained hash per page, in token order
    parent_block_hash: int | None  # hash of the page before the first; None at the root
    num_tokens: int  # tokens of these pages
    namespace: str | None


class BlockRemoved(NamedTuple):
    tier: str
    block_hashes: tuple[int, ...]
    namespace: str | None


class AllBlocksCleared(NamedTuple):
    tier: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
TIERS = ("device", "host", "storage")


def _powers(page_size: int) -> np.ndarray:
    powers = _POWERS.get(page_size)
    if powers is None:
        values, p = [], 1
        for _ in range(page_size):
            p = (p * _K) & _MASK
            values.append(p)
        powers = _POWERS[page_size] = np.array(values, dtype=np.uint64)
    return powers


def _splitmix64(z: int) -> int:
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def page_hashes(key: bytes, page_size: int, prev: int) -> list[int]:
    """Chained hashes of the whole pages of ``key`` (int32 token bytes) after ``prev``.

    ``prev`` is the hash of the page before (0 at the root of a namespace).
    """
    tokens = np.frombuffer(key, dtype=np.int32).astype(np.uint64).reshape(-1, page_size)
    # uint64 arithmetic wraps modulo 2**64, as the C++ does.
    polys = ((tokens + np.uint64(1)) * _powers(page_size)).sum(axis=1, dtype=np.uint64)
    out = []
    for x in polys.tolist():
        prev = _splitmix64((prev * _GOLDEN + x) & _MASK)
        out.append(prev)
    return out


def to_event(raw: tuple[bool, str, str | None, int | None, list[int], int]) -> KVEvent:
    """A tree's raw log entry ``(stored, tier, namespace, parent, hashes, num_tokens)`` as an event."""
    stored, tier, namespace, parent, hashes, num_tokens = raw
    if stored:
        return BlockStored(tier, tuple(hashes), parent, num_tokens, namespace)
    return BlockRemoved(tier, tuple(hashes), namespace)


class Mirror:
    """What a router knows of a cache: the (namespace, page hash) pairs in each tier.

    Built only from events; ``apply`` raises ``AssertionError`` when an event
    contradicts the mirror (a page stored twice in a tier, or removed while absent).
    """

    def __init__(self) -> None:
        self.tiers: dict[str, set[tuple[str | None, int]]] = {t: set() for t in TIERS}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.tiers[event.tier].clear()
            return
        pages = self.tiers[event.tier]
        for h in event.block_hashes:
            entry = (event.namespace, h)
            if isinstance(event, BlockStored):
                assert entry not in pages or event.tier == "storage", (
                    f"{event.tier}: page {h:#x} stored twice"
                )
                pages.add(entry)
            else:
                assert entry in pages, f"{event.tier}: page {h:#x} removed but never stored"
                pages.discard(entry)
