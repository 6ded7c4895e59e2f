"""Operator controls of a HiCache: reset (drop what nobody holds), pins, KV events.

:class:`ControlMixin` holds the methods of :class:`hicache.cache.HiCache` that
act on the cache as a whole rather than on one request:

* :meth:`~ControlMixin.reset` drops every cached prefix that no live request
  holds (after a weight update the cached KV is stale). It never waits for or
  cancels IO: what a live request, a transfer in flight or a storage write in
  flight still holds is kept and reported in :class:`ResetResult`.
* :meth:`~ControlMixin.pin` / :meth:`~ControlMixin.unpin` keep a cached prefix
  on the device (a lock the cache holds for the caller, optionally with a
  time-to-live). Pinned tokens are bounded by ``CacheConfig.max_pinned_fraction``
  of the device tier, so pins can never starve allocation.

Pins hold device pages only: a pinned prefix stays matchable on the device,
and its host copies stay evictable (the device copy is the one a hit reads).
The host tier therefore needs no pin budget of its own.

* :meth:`~ControlMixin.take_events` drains the KV events (hicache/events.py):
  the trees log device and host events; this mixin adds the storage events
  (a storage write landed) and a reset's all-cleared events, in order.

It uses the cache's tree, allocators, counters and ``poll``; it knows nothing of
transfers or the request lifecycle beyond locks.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, NamedTuple

from hicache.checks import check_namespace
from hicache.events import AllBlocksCleared, BlockStored, KVEvent, to_event
from hicache.tree import TokenLike, token_key

if TYPE_CHECKING:
    from hicache.tree import TreeNode


class ResetResult(NamedTuple):
    """What :meth:`ControlMixin.reset` dropped and what it could not drop (tokens)."""

    dropped_device_tokens: int  # device copies given up
    dropped_host_tokens: int  # host copies given up
    kept_device_tokens: int  # still on the device: locked by live requests, or IO in flight
    kept_host_tokens: int  # still in host memory: loads / storage writes in flight read them
    dropped_pins: int  # pins released (a reset drops every pin)
    discarded_prefetches: int  # storage reads in flight whose pages will be thrown away
    storage_pages_deleted: int | None  # pages cleared from the third tier; None: not asked

    @property
    def complete(self) -> bool:
        """True when nothing cached is left in either tier."""
        return self.kept_device_tokens == 0 and self.kept_host_tokens == 0


class _Pin:
    """One pin: the node ending the pinned device prefix (locked once) and its deadline."""

    __slots__ = ("node", "num_tokens", "expires_at")

    def __init__(self, node: TreeNode, num_tokens: int, expires_at: float) -> None:
        self.node = node
        self.num_tokens = num_tokens  # device tokens pinned (the prefix up to node)
        self.expires_at = expires_at  # time.monotonic() deadline; inf: until unpinned


def _check_ttl(ttl_s: object) -> float:
    if ttl_s is None:
        return math.inf
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        raise TypeError(f"ttl_s: expected a number of seconds or None, got {type(ttl_s).__name__}")
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"ttl_s: expected a finite number > 0, got {ttl_s}")
    return float(ttl_s)


class ControlMixin:
    """Reset and pins for :class:`hicache.cache.HiCache` (see the module docstring)."""

    # Pins by (namespace, key of the pinned tokens' whole pages).
    _pins: dict[tuple[str | None, bytes], _Pin]
    _now = staticmethod(time.monotonic)  # the pin clock (tests replace it)

    # ------------------------------------------------------------------ reset
    def reset(self, *, storage: bool = False) -> ResetResult:
        """Drop every cached prefix that no live request holds, in both tiers.

        Safe with IO in flight: nodes that a live request locks, or that a load, a
        backup or a storage write is reading, stay; the result says how many
        tokens that kept. Every pin is released. Storage reads in flight are
        discarded when they land (their KV would be as stale). With ``storage``
        the third tier is emptied too, after the transfers and storage writes in
        flight land (else they would put stale pages back): only then does reset
        wait. Never raises for what it cannot drop; storage errors propagate as
        :class:`hicache.storage.base.StorageError`.
        """
        self._check_open()
        if not isinstance(storage, bool):
            raise TypeError(f"storage: expected bool, got {type(storage).__name__}")
        clear_storage = storage and self.storage is not None
        if clear_storage:
            # Backups that land later would write stale pages to storage: let them land
            # (and their storage writes) before anything is dropped.
            if self.transfers.executor_name != "manual":
                self.wait_all()
            for job in list(self._storage_pins.values()):
                job.done.wait()
        self.poll()
        dropped_pins = len(self._pins)
        for pin in self._pins.values():
            self.tree.unlock(pin.node)
        self._pins.clear()
        for job in self._prefetches:
            job.stale = True
        discarded = len(self._prefetches)
        num_device = num_host = 0
        tree = self.tree
        while True:  # host-only children leave first, then their device-only parents can
            dev = tree.evict_device(tree.device_evictable_tokens)
            host = tree.evict_host(tree.host_evictable_tokens, drop_device_resident=True)
            if dev.num_evicted_tokens:
                self.device_allocator.free(dev.page_ids)
            if host.num_evicted_tokens:
                self.host_allocator.free(host.page_ids)
            num_device += dev.num_evicted_tokens
            num_host += host.num_evicted_tokens
            if not dev.num_evicted_tokens and not host.num_evicted_tokens:
                break
        deleted = self.storage.backend.clear() if clear_storage else None
        self._note_reset(clear_storage)
        return ResetResult(
            num_device, num_host, tree.device_tokens, tree.host_tokens, dropped_pins,
            discarded, deleted,
        )

    def _note_reset(self, storage_cleared: bool) -> None:
        """Log an all-cleared event for each tier a reset left empty (and storage if cleared)."""
        if self._event_log is None:
            return
        self._drain_tree_events()
        if self.tree.device_tokens == 0:
            self._event_log.append(AllBlocksCleared("device"))
        if self.tree.host_tokens == 0 and self.has_host_tier:
            self._event_log.append(AllBlocksCleared("host"))
        if storage_cleared:
            self._event_log.append(AllBlocksCleared("storage"))

    # -------------------------------------------------------------- KV events
    def take_events(self) -> list[KVEvent]:
        """Every KV event since the last call, in order (see hicache/events.py).

        Empty unless ``CacheConfig.kv_events``. Device and host events come from
        the tree (also when the C++ lifecycle runs the requests); storage events
        when a write to the third tier lands; ``AllBlocksCleared`` from
        :meth:`reset`. Storage that drops pages by itself (a capacity cap) does
        not report it: a router's storage mirror is an upper bound.
        """
        self._check_open()
        if self._event_log is None:
            return []
        self._drain_tree_events()
        events, self._event_log = self._event_log, []
        return events

    def _drain_tree_events(self) -> None:
        """Move the tree's log into the cache's, so cache events land after them."""
        raw = self.tree.take_events()
        if raw:
            self._event_log.extend(map(to_event, raw))

    def _log_storage_stored(self, event_pages: list[tuple], num_pages: int) -> None:
        """Storage events for the first ``num_pages`` pages a landed write covered.

        ``event_pages``: ``(namespace, parent hash, page hashes)`` per node written,
        in the write's page order.
        """
        self._drain_tree_events()
        for namespace, parent, hashes in event_pages:
            if num_pages <= 0:
                break
            hashes = hashes[:num_pages]
            num_pages -= len(hashes)
            self._event_log.append(BlockStored(
                "storage", tuple(hashes), parent, len(hashes) * self.page_size, namespace
            ))

    # ------------------------------------------------------------------- pins
    def pin(self, tokens: TokenLike, namespace: str | None = None, ttl_s: float | None = None) -> int:
        """Keep the device-resident cached prefix of ``tokens`` from eviction.

        Returns the number of tokens pinned: the prefix cached on the device now
        (0 when nothing is, or when pinning it would exceed
        ``max_pinned_fraction`` of the device tier: counted in
        ``stats()["pins_refused"]``). Pinning the same tokens again replaces the
        pin (with the new ``ttl_s`` and whatever is cached by then). ``ttl_s``
        (seconds, > 0) releases the pin by itself; ``None`` keeps it until
        :meth:`unpin` or :meth:`reset`. A host-only part is not loaded: match it
        first to bring it back, then pin. Pinning is a use of the prefix: like a
        match it counts a hit and refreshes the access time of its nodes.
        """
        self._check_open()
        deadline = _check_ttl(ttl_s)
        check_namespace(namespace)
        key = token_key(tokens, self.page_size)
        self.poll()
        now = self._now()
        self._expire_pins(now)
        result = self.tree.match_key(key, namespace)
        ident = (namespace, key)
        old = self._pins.pop(ident, None)
        if result.device_len == 0:
            if old is not None:
                self.tree.unlock(old.node)
            return 0
        node = result.last_device_node
        self.tree.lock(node)
        self._pins[ident] = _Pin(node, result.device_len, now + deadline)
        if self.pinned_device_tokens() > self.max_pinned_tokens:
            self.tree.unlock(node)
            if old is None:
                del self._pins[ident]
            else:  # the old pin stays as it was
                self._pins[ident] = old
            self._counters.pins_refused += 1
            return 0
        if old is not None:
            self.tree.unlock(old.node)
        return result.device_len

    def unpin(self, tokens: TokenLike, namespace: str | None = None) -> bool:
        """Release the pin made with the same ``tokens`` and ``namespace``; False if none."""
        self._check_open()
        check_namespace(namespace)
        key = token_key(tokens, self.page_size)
        self._expire_pins(self._now())
        pin = self._pins.pop((namespace, key), None)
        if pin is None:
            return False
        self.tree.unlock(pin.node)
        return True

    @property
    def max_pinned_tokens(self) -> int:
        """The pin budget: ``max_pinned_fraction`` of the device tier, in whole pages."""
        pages = int(self.config.max_pinned_fraction * self.config.num_device_pages)
        return pages * self.page_size

    def pinned_device_tokens(self) -> int:
        """Device tokens that pins hold (each node counted once, however many pins share it)."""
        seen: set = set()
        total = 0
        for pin in self._pins.values():
            node = pin.node
            while node.parent is not None and node not in seen:
                seen.add(node)
                total += node.num_tokens
                node = node.parent
        return total

    def _expire_pins(self, now: float) -> None:
        """Release pins whose time-to-live has passed."""
        if not self._pins:
            return
        expired = [ident for ident, pin in self._pins.items() if pin.expires_at <= now]
        for ident in expired:
            self.tree.unlock(self._pins.pop(ident).node)

    def _check_pins(self, want_locks: dict) -> None:
        """Integrity: add the pins' locks to ``want_locks``; pins are live and within budget."""
        for (namespace, key), pin in self._pins.items():
            node = pin.node
            assert node.parent is not None and node.on_device and node.namespace == namespace, (
                f"pin of {len(key) >> 2} tokens: its node {node.id} left the device tree"
            )
            for n in self.tree.path_to(node):
                want_locks[n] = want_locks.get(n, 0) + 1
        pinned = self.pinned_device_tokens()
        assert pinned <= self.max_pinned_tokens, (
            f"pins hold {pinned} device tokens, budget {self.max_pinned_tokens}: "
            "pins could starve allocation"
        )
