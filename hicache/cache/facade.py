"""HiCache: the hierarchical KV cache that ties the tree, the pools and the transfers.

Request lifecycle (one :class:`PrefixHandle` per request; the token/page diagram
and the node IO states are in docs/design.md, "Request lifecycle")::

    h = cache.match(tokens)          lock the cached prefix; report device_len, host_len
    cache.load_back(h)               host-only part -> new device pages (async, per layer)
    pages = cache.alloc(h, n)        device pages for the n tokens the caller computes
    model(..., load_handle=h)        h.wait_layer(i) before reading layer i of the prefix
    cache.insert(h, tokens)          cache the computed whole pages; write policy runs
    cache.release(h)                 unlock; free pages the tree did not take

What it guarantees: nothing whose IO is in flight is freed, evicted or reused;
host pages being loaded are pinned (``host_lock_ref``); a write-back eviction
frees device pages only after the host copy is complete; running out of pages
is a normal return, and a refused allocation evicts nothing; a request's failed
load is applied only by calls made for that request. Completed transfers are
applied only by :meth:`poll`, which every public call runs first: worker threads
never touch the cache's state. Invariants: ``check_integrity`` and
docs/design.md (a host copy implies host copies of every ancestor).
The cache is not thread-safe; one engine loop drives it (docs/design.md).

HiCache checks arguments and sequences its parts, each one object with the state
it owns (:mod:`hicache.cache.parts` lists them and wires them together).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from hicache.cache.control import ResetResult, drop_unheld
from hicache.cache.handle import PrefixHandle
from hicache.cache.integrity import check_cache_integrity
from hicache.cache.parts import compose_parts
from hicache.cache.stats import CacheStats, stats_report, tier_occupancy
from hicache.cache.tiers import build_tiers
from hicache.checks import (
    check_bool,
    check_int,
    check_namespace,
    check_priority,
    check_timeout,
    check_ttl,
)
from hicache.config import CacheConfig
from hicache.events import KVEvent
from hicache.tree import TokenLike, token_key

if TYPE_CHECKING:  # annotations only
    from hicache.storage.worker import StorageJob
    from hicache.transfer.base import Transfer


class HiCache:
    """Hierarchical (device + host) prefix cache. See the module docstring for the lifecycle."""

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected CacheConfig, got {type(config).__name__}")
        self.config = config
        self._closed = False
        self.page_size = config.page_size
        self.has_host_tier = config.has_host_tier
        tiers = build_tiers(config)
        # The tree's split hook is set only while IO or a pin is tracked; the pools are
        # None for bookkeeping-only caches (host_pool also without a host tier).
        (self.tree, self.device_allocator, self.host_allocator, self.device_pool,
         self.host_pool, self.transfers) = tiers
        parts = compose_parts(config, tiers, poll=self.poll, wait_all=self.wait_all)
        self._counters = parts.counters
        self._live: set[PrefixHandle] = set()
        self._inflight, self._space, self._pins = parts.inflight, parts.space, parts.pins
        self._events, self._third_tier = parts.events, parts.third_tier
        # the storage worker (hicache.storage.worker.StorageTier), None without storage
        self.storage = None if parts.third_tier is None else parts.third_tier.worker
        self._writes, self._loads = parts.writes, parts.loads
        self._python, self._native = parts.python, parts.native
        self._lifecycle = self._python if self._native is None else self._native

    # ------------------------------------------------------------- lifecycle
    @property
    def lifecycle(self) -> str:
        """Where the request lifecycle runs: ``"native"`` (C++) or ``"python"``."""
        return "python" if self._native is None else "native"

    def match(
        self,
        tokens: TokenLike,
        namespace: str | None = None,
        *,
        load_back: bool = True,
        priority: int | None = None,
    ) -> PrefixHandle:
        """Find and lock the longest cached prefix of ``tokens``.

        With ``load_back`` (the default) the host-only part of the match starts
        loading into new device pages at once (see :meth:`load_back`); the model
        then waits per layer with ``h.wait_layer(i)``. Never changes cached data;
        may split a node at the match boundary. ``priority`` (an int) raises the
        eviction priority of every node on the path ``h`` holds to at least ``priority``
        (priorities only grow; only the ``priority`` eviction policy reads them:
        docs/design.md, "Tiers and policies").
        """
        self._check_open()
        if priority is not None:
            priority = check_priority(priority)
        check_bool("load_back", load_back)
        check_namespace(namespace)  # before storage keys are derived from it
        self._pins.expire()  # the native lifecycle does not poll
        h = self._lifecycle.match(self, tokens, namespace, load_back)
        self._live.add(h)
        if priority is not None:
            self._lifecycle.raise_priority(h, priority)
        return h

    def load_back(self, h: PrefixHandle) -> Transfer | None:
        """Start loading the host-only part of ``h``'s prefix into new device pages.

        For handles matched with ``load_back=False``: the tree is matched again,
        since what is cached may have changed. Returns the transfer handle, or
        ``None`` when there is nothing to load, the host hit is shorter than
        ``load_threshold_tokens`` or no device pages can be freed (then those
        tokens count as a miss and the caller computes them). Raises
        ``ValueError`` once the handle owns pages (after :meth:`alloc`): those
        pages already hold the positions a load would add to the prefix.
        """
        self._check_handle(h)
        if h._new_pages:
            # The owned pages hold KV for positions from h.prefix_len on: growing the
            # prefix under them would map loaded positions onto those pages.
            raise ValueError(
                f"load_back: the handle owns {h.num_owned_pages} pages allocated for positions "
                f"from {h.prefix_len} on; call load_back before alloc (or release and match again)"
            )
        return self._python.load_back(h)

    def finish_loads(self, h: PrefixHandle) -> bool:
        """Wait for the loads ``h`` depends on and apply them; False if one failed.

        After a failure ``h.prefix_len`` is cut back above the failed part and the
        pages ``h`` had allocated are freed: the caller allocates again and
        recomputes from ``h.prefix_len``. A failure is applied to ``h`` only by
        calls made for ``h`` (this one, ``alloc``, ``load_back``, ``insert``), never
        by another request's call; until then ``h.wait_layer`` raises
        :class:`LoadError`. Each failure is reported (False) by one call;
        ``h.load_error`` keeps the last error until a call reports no failure.
        """
        self._check_handle(h)
        for rec in list(h._loads):
            rec.handle.wait()
        self.poll()
        self._loads.apply_failures(h)
        h._loads = [rec for rec in h._loads if self._inflight.is_tracked(rec.handle)]
        failed, h._failure_unreported = h._failure_unreported, False
        if not failed:
            h.load_error = None  # e.g. a retried load_back landed
        return not failed

    def alloc(self, h: PrefixHandle, num_tokens: int, *,
              checkpoints: Collection[int] = ()) -> torch.Tensor | None:
        """Allocate device pages for ``num_tokens`` more tokens of ``h``'s sequence.

        The new pages continue ``h.page_table()``. Evicts if needed; returns
        ``None`` when not enough pages can be freed, and then has evicted nothing:
        a refused allocation leaves every cached prefix in place. A hybrid model's
        request gets its component pages with them (``h.window_table(c)``,
        ``h.state_pages(c)``): window pages for the new pages, its running state once,
        and a page set per ``checkpoints`` entry not held yet (token counts, multiples
        of the page size within the request's pages: where the state after that many
        tokens is kept for ``insert``, e.g. ``h.full_len`` and the inserted length).
        """
        self._check_handle(h)
        num_tokens = check_int("num_tokens", num_tokens)
        num_pages = -(-num_tokens // self.page_size)
        comps = h._components
        marks: list[int] = []
        if comps is not None:
            high = h.prefix_len + self.page_size * (h.num_owned_pages + num_pages)
            marks = comps.check_checkpoints(checkpoints, h.prefix_len, high)
        elif checkpoints:
            raise ValueError("checkpoints: the cache's KV layout has no state component")
        extra = 0 if comps is None else comps.extra_pages(num_pages, marks)
        self._pins.expire()  # the native lifecycle does not poll
        if num_pages + extra > self.device_allocator.num_pages:
            return None  # more than the whole device tier: evicting cannot help
        pages = self._lifecycle.alloc(h, num_pages + extra)
        if pages is None:
            return None
        if comps is not None:
            comps.take(pages[num_pages:], num_pages, marks)
            pages = pages[:num_pages]
        if pages.shape[0]:
            h._new_pages.append(pages)
        return pages

    def insert(self, h: PrefixHandle, tokens: TokenLike, *, priority: int | None = None) -> int:
        """Cache the whole pages of ``tokens`` (the prefix plus what the caller computed).

        ``tokens`` must start with ``h``'s prefix and fit in ``h.page_table()``.
        Pages another request cached meanwhile are freed (the tree keeps its own).
        Afterwards ``h`` holds the inserted path; the write policy runs. Returns the
        number of tokens newly cached. ``priority`` raises the eviction priority of
        the path ``h`` holds afterwards, as in :meth:`match`. Raises
        :class:`LoadError` (having cut ``h`` back) when a load of ``h``'s prefix
        failed and ``finish_loads`` has not reported it yet.
        """
        self._check_handle(h)
        if priority is not None:
            priority = check_priority(priority)
        self._pins.expire()  # the native lifecycle does not poll
        num_new = self._lifecycle.insert(h, tokens)
        if priority is not None:
            self._lifecycle.raise_priority(h, priority)
        return num_new

    def release(self, h: PrefixHandle) -> None:
        """Unlock ``h``'s prefix and free the pages it owns. The cached KV stays cached."""
        self._check_handle(h)
        self._lifecycle.release(h)
        h._new_pages = []
        for pages in h._components.release() if h._components is not None else ():
            self.device_allocator.free(pages)
        h.released = True
        self._live.discard(h)
        self.poll()

    # -------------------------------------------------------------- transfers
    def poll(self) -> int:
        """Apply every transfer that finished since the last call; return how many.

        Also releases the pins whose time-to-live has passed: every public call polls
        (or, where nothing else is polled, expires pins) first, so an expired pin holds
        no lock and is not counted by ``stats()`` past its deadline.
        """
        self._check_open()
        self._pins.expire()
        storage = self.storage
        if not self._inflight.records and (storage is None or not storage.num_in_flight):
            return 0  # nothing can have finished
        done = self.transfers.poll()
        if storage is not None and not self._loads.setting_up:
            third_tier = self._third_tier
            assert third_tier is not None, "a storage worker belongs to a third tier"
            for job in storage.poll():
                third_tier.finish(job)
        for handle in done:
            rec = self._inflight.pop(handle)
            if rec.kind == "load":
                self._loads.finish(rec)
            else:
                self._writes.finish(rec)
        self._inflight.unwatch_if_idle()
        return len(done)

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every transfer (and storage job) in flight, then apply them.

        On the manual executor only what the test completed is applied.
        """
        self._check_open()
        timeout = check_timeout("timeout", timeout)
        for rec in list(self._inflight.records.values()):
            rec.handle.wait(timeout)
        self.poll()  # finished backups may start storage writes
        reads = [] if self._third_tier is None else self._third_tier.prefetches
        for job in [*reads, *self._inflight.storage_writes()]:
            job.done.wait(timeout)
        self.poll()

    # ------------------------------------------------------------ third tier
    def prefetch(self, tokens: TokenLike, namespace: str | None = None) -> StorageJob | None:
        """Start reading the pages of ``tokens`` that only storage holds into host memory.

        Call it when a request arrives; :meth:`match` (when the request is scheduled)
        then uses what has arrived, as ``prefetch_policy`` says. A read in flight that
        fetches the same tokens' pages is shared, and one that fetches a prefix of them
        is continued after (reads finish in the order they start). Returns the job that
        brings the last of the pages, or ``None`` when there is no third tier or
        nothing to fetch.
        """
        self._check_open()
        key = token_key(tokens, self.page_size)  # bad input is refused with or without storage
        check_namespace(namespace)
        self.poll()
        if self._third_tier is None:
            return None
        return self._third_tier.start_prefetch(key, namespace)

    # ------------------------------------------------------------- controls
    def reset(self, *, storage: bool = False, new_epoch: bool = False) -> ResetResult:
        """Drop every cached prefix that no live request holds, in both tiers; release every pin.

        Safe with IO in flight: what a live request or IO in flight holds stays, and
        storage reads in flight are discarded when they land (docs/design.md, "Reset").
        With ``storage`` the third tier is emptied too, after the transfers and storage
        writes in flight land: only then does reset wait. With ``new_epoch`` (after
        the model's weights changed in place) the third tier's epoch is bumped and
        every later storage key salted with it: no page stored before is read again,
        by this cache or by any cache that opens the tier later; the old pages stay
        for caches still on the old weights until evicted (docs/storage.md). Reset
        with no live request then: what one holds was computed by the old weights.
        Returns what was dropped and what was kept; never raises for what it cannot
        drop; storage errors propagate as :class:`hicache.storage.base.StorageError`.
        Without a third tier ``storage`` and ``new_epoch`` do nothing.
        """
        self._check_open()
        check_bool("storage", storage)
        check_bool("new_epoch", new_epoch)
        clear_storage = storage and self._third_tier is not None
        if clear_storage:
            # Backups that land later would write stale pages to storage: let them land
            # (and their storage writes) before anything is dropped.
            if self.transfers.executor_name != "manual":
                self.wait_all()
            for job in self._inflight.storage_writes():
                job.done.wait()
        self.poll()
        dropped_pins = self._pins.drop_all()
        discarded = 0 if self._third_tier is None else self._third_tier.discard_prefetches()
        num_device, num_host = drop_unheld(self.tree, self.device_allocator, self.host_allocator)
        deleted = None
        if clear_storage:
            assert self.storage is not None, "a third tier has a storage worker"
            deleted = self.storage.backend.clear()
        epoch = self._third_tier.new_epoch() if new_epoch and self._third_tier else None
        if self._events is not None:  # a new epoch retires every stored page, as a clear does
            self._events.note_reset(clear_storage or epoch is not None)
        return ResetResult(
            num_device, num_host, self.tree.device_tokens, self.tree.host_tokens, dropped_pins,
            discarded, deleted, epoch,
        )

    def take_events(self) -> list[KVEvent]:
        """Every KV event since the last call, in order; empty unless ``CacheConfig.kv_events``.

        Which events and when: hicache/events.py and docs/design.md, "KV events".
        Storage that drops pages by itself (a capacity cap) does not report it: a
        router's storage mirror is an upper bound.
        """
        self._check_open()
        self._pins.expire()
        return [] if self._events is None else self._events.take()

    def pin(self, tokens: TokenLike, namespace: str | None = None, ttl_s: float | None = None) -> int:
        """Keep the device-resident cached prefix of ``tokens`` from eviction (docs/design.md).

        Returns the number of tokens pinned: the prefix cached on the device now (0
        when nothing is, or when pinning it would exceed ``max_pinned_fraction`` of
        the device tier: ``stats()["pins_refused"]``). Pinning the same tokens again
        replaces the pin. ``ttl_s`` (seconds, > 0) releases it by itself; ``None``
        keeps it until :meth:`unpin` or :meth:`reset`. A host-only part is not loaded
        (match it first). Like a match, it counts a hit and refreshes its nodes.
        """
        self._check_open()
        ttl_s = check_ttl("ttl_s", ttl_s)
        check_namespace(namespace)
        key = token_key(tokens, self.page_size)
        self.poll()
        return self._pins.pin(key, namespace, ttl_s)

    def unpin(self, tokens: TokenLike, namespace: str | None = None) -> bool:
        """Release the pin made with the same ``tokens`` and ``namespace``; False if none."""
        self._check_open()
        check_namespace(namespace)
        return self._pins.unpin(token_key(tokens, self.page_size), namespace)

    @property
    def max_pinned_tokens(self) -> int:
        """The pin budget: ``max_pinned_fraction`` of the device tier, in whole pages."""
        return self._pins.max_pinned_tokens

    def pinned_device_tokens(self) -> int:
        """Device tokens that pins hold (each node counted once, however many pins share it)."""
        if not self._closed:
            self._pins.expire()
        return self._pins.pinned_device_tokens()

    # ------------------------------------------------------------ inspection
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                "HiCache is closed: its transfers and workers are stopped; make a new HiCache"
            )

    def _check_handle(self, h: object) -> None:
        self._check_open()
        if not isinstance(h, PrefixHandle):
            raise TypeError(f"expected a PrefixHandle, got {type(h).__name__}")
        if h._owner is not self:
            raise ValueError("handle belongs to another HiCache")
        if h.released:
            raise ValueError("handle was already released")

    @property
    def counters(self) -> CacheStats:
        """Counters since construction (exact; see :class:`hicache.cache.CacheStats`)."""
        if self._native is not None:  # read-only: also after close()
            self._native.add_counters(self._counters)
        return self._counters

    def stats(self) -> dict[str, Any]:
        """Counters plus current occupancy; bandwidths in GB/s (1e9 bytes per second).

        After :meth:`close` it still reports the final state (nothing is polled).
        """
        if not self._closed:
            self.poll()
        s = stats_report(self.counters)  # with the C++ lifecycle: its counts added in
        s.update(tier_occupancy(self.tree, self.device_allocator, self.host_allocator))
        s["transfers_in_flight"] = self._inflight.num_transfers
        s["live_requests"] = len(self._live)
        s["pins"] = len(self._pins)
        s["pinned_device_tokens"] = self._pins.pinned_device_tokens()
        return s

    def check_integrity(self) -> None:
        """Verify the tree's invariants and that every page and lock is accounted for."""
        check_cache_integrity(
            self.tree, self.device_allocator, self.host_allocator, self.transfers,
            page_size=self.page_size, live=self._live, pins=self._pins, inflight=self._inflight,
            num_prefetching_pages=(
                0 if self._third_tier is None else self._third_tier.num_prefetching_pages
            ),
        )

    def close(self) -> None:
        """Finish transfers in flight, then stop the workers (and the storage tier).

        Idempotent. Afterwards every other public call raises ``ValueError`` before
        changing anything; ``stats()``, ``counters`` and ``check_integrity()`` still
        read the final state (the counters of what finished while closing included).
        """
        if self._closed:
            return
        if self.transfers.executor_name != "manual":
            self.wait_all()  # backups that finish now still reach storage
        self._closed = True
        self.transfers.close()
        if self.storage is not None:
            self.storage.close()

    def __enter__(self) -> HiCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

