"""Pins: cached device prefixes the cache keeps from eviction for a caller.

A pin is a lock the cache holds on the node ending a device-resident prefix,
optionally with a time-to-live. Pinned tokens are bounded by
``CacheConfig.max_pinned_fraction`` of the device tier, so pins can never
starve allocation. Pins hold device pages only: a pinned prefix stays matchable
on the device, and its host copies stay evictable (the device copy is the one a
hit reads), so the host tier needs no pin budget of its own.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from hicache.cache.stats import CacheStats
    from hicache.config import CacheConfig
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike


class _Pin:
    """One pin: the node ending the pinned device prefix (locked once) and its deadline."""

    __slots__ = ("node", "num_tokens", "expires_at")

    def __init__(self, node: TreeNode, num_tokens: int, expires_at: float) -> None:
        self.node = node
        self.num_tokens = num_tokens  # device tokens pinned (the prefix up to node)
        self.expires_at = expires_at  # now() deadline; inf: until unpinned


class Pins:
    """The cache's pins, by (namespace, key of the pinned tokens' whole pages)."""

    def __init__(self, config: CacheConfig, tree: RadixTreeLike, counters: CacheStats) -> None:
        self._tree = tree
        self._counters = counters
        self._pins: dict[tuple[str | None, bytes], _Pin] = {}
        # The pin budget: max_pinned_fraction of the device tier, in whole pages.
        pages = int(config.max_pinned_fraction * config.num_device_pages)
        self.max_pinned_tokens = pages * config.page_size
        self.now = time.monotonic  # the pin clock (tests replace it)
        # No pin expires before this (inf: none has a time-to-live). May be early after
        # an unpin; expire() then recomputes it. Lets the cache's every call skip the scan.
        self._next_expiry = math.inf

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, key: bytes, namespace: str | None, ttl_s: float) -> int:
        """Pin the device prefix of ``key`` for ``ttl_s`` seconds (inf: until unpinned).

        Returns the tokens pinned; 0 when nothing is on the device or the budget
        would be exceeded (counted; an old pin of the same key then stays).
        """
        tree = self._tree
        now = self.now()
        self.expire(now)
        ident = (namespace, key)
        # (a namespace with nothing cached gets no root: match_key would make one)
        result = tree.match_key(key, namespace) if tree.probe_key(key, namespace) else None
        old = self._pins.pop(ident, None)
        if result is None or result.device_len == 0:
            if old is not None:
                tree.unlock(old.node)
            return 0
        node = result.last_device_node
        tree.lock(node)
        self._pins[ident] = _Pin(node, result.device_len, now + ttl_s)
        self._next_expiry = min(self._next_expiry, now + ttl_s)
        if self.pinned_device_tokens() > self.max_pinned_tokens:
            tree.unlock(node)
            if old is None:
                del self._pins[ident]
            else:  # the old pin stays as it was
                self._pins[ident] = old
            self._counters.pins_refused += 1
            return 0
        if old is not None:
            tree.unlock(old.node)
        return result.device_len

    def unpin(self, key: bytes, namespace: str | None) -> bool:
        """Release the pin of ``key``; False if none."""
        self.expire(self.now())
        pin = self._pins.pop((namespace, key), None)
        if pin is None:
            return False
        self._tree.unlock(pin.node)
        return True

    def drop_all(self) -> int:
        """Release every pin; return how many there were."""
        num = len(self._pins)
        for pin in self._pins.values():
            self._tree.unlock(pin.node)
        self._pins.clear()
        self._next_expiry = math.inf
        return num

    def pinned_device_tokens(self) -> int:
        """Device tokens that pins hold (each node counted once, however many pins share it)."""
        seen: set[TreeNode] = set()
        total = 0
        for pin in self._pins.values():
            node = pin.node
            while node.parent is not None and node not in seen:
                seen.add(node)
                total += node.num_tokens
                node = node.parent
        return total

    def expire(self, now: float | None = None) -> None:
        """Release pins whose time-to-live has passed (cheap when none can have)."""
        if not self._pins or self._next_expiry == math.inf:
            return
        now = self.now() if now is None else now
        if now < self._next_expiry:
            return
        expired = [ident for ident, pin in self._pins.items() if pin.expires_at <= now]
        for ident in expired:
            self._tree.unlock(self._pins.pop(ident).node)
        self._next_expiry = min((pin.expires_at for pin in self._pins.values()), default=math.inf)

    def check(self, want_locks: dict[TreeNode, int]) -> None:
        """Integrity: add the pins' locks to ``want_locks``; pins are live and within budget."""
        for (namespace, key), pin in self._pins.items():
            node = pin.node
            assert node.parent is not None and node.on_device and node.namespace == namespace, (
                f"pin of {len(key) >> 2} tokens: its node {node.id} left the device tree"
            )
            for n in self._tree.path_to(node):
                want_locks[n] = want_locks.get(n, 0) + 1
        pinned = self.pinned_device_tokens()
        assert pinned <= self.max_pinned_tokens, (
            f"pins hold {pinned} device tokens, budget {self.max_pinned_tokens}: "
            "pins could starve allocation"
        )
