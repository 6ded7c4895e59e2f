"""HiCache: the hierarchical KV cache that ties the tree, the pools and the transfers.

Request lifecycle (one :class:`PrefixHandle` per request)::

    h = cache.match(tokens)          lock the cached prefix; report device_len, host_len
    cache.load_back(h)               host-only part -> new device pages (async, per layer)
    pages = cache.alloc(h, n)        device pages for the n tokens the caller computes
    model(..., load_handle=h)        h.wait_layer(i) before reading layer i of the prefix
    cache.insert(h, tokens)          cache the computed whole pages; write policy runs
    cache.release(h)                 unlock; free pages the tree did not take

    tokens  |<-- device_len -->|<-- host_len -->|<---- computed by the caller ---->|
    pages   |  tree's pages    | loaded pages   | h's pages (alloc) | partial page |
            |<-------- h.prefix_len ---------->|

What it guarantees: nothing whose IO is in flight is freed, evicted or reused;
host pages being loaded are pinned (``host_lock_ref``); a write-back eviction
frees device pages only after the host copy is complete; running out of pages
is a normal return, and a refused allocation evicts nothing; a request's failed
load is applied only by calls made for that request. Completed transfers are
applied only by :meth:`poll`, which every public call runs first: worker threads
never touch the cache's state. Invariants: ``check_integrity`` and
docs/design.md (a host copy implies host copies of every ancestor).
The cache is not thread-safe; one engine loop drives it (docs/design.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from hicache.cache.control import ControlMixin, ResetResult  # noqa: F401  (ResetResult: re-exported)
from hicache.cache.handle import LoadError, PrefixHandle  # noqa: F401  (LoadError: re-exported)
from hicache.cache.native_lifecycle import NativeLifecycleMixin
from hicache.cache.storage import ThirdTierMixin
from hicache.checks import check_namespace, check_priority
from hicache.config import CacheConfig, WritePolicy
from hicache.memory import PageAllocator
from hicache.tree import (
    IOStatus,
    MatchResult,
    TokenLike,
    TreeNode,
    token_key,
)

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class CacheStats:
    """Counters since construction; exact, in tokens unless the name says otherwise."""

    requests: int = 0  # match calls
    requested_tokens: int = 0  # tokens passed to match
    device_hit_tokens: int = 0  # matched on the device
    host_hit_tokens: int = 0  # matched in host memory and loaded back
    host_hit_refused_tokens: int = 0  # host hits not loaded (below threshold or no room)
    loads_refused_by_threshold: int = 0
    loads_refused_no_space: int = 0
    loads: int = 0
    loads_failed: int = 0
    loads_reloaded: int = 0  # failed loads' nodes loaded again in place (a request held them)
    load_bytes: int = 0
    load_seconds: float = 0.0
    backups: int = 0
    backups_failed: int = 0
    backups_skipped: int = 0  # nodes not backed up: host tier full and nothing evictable
    backups_retried: int = 0  # failed backups started again (a child's host copy needs them)
    backup_bytes: int = 0
    backup_seconds: float = 0.0
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    inserted_tokens: int = 0  # tokens newly cached by insert
    storage_prefetches: int = 0  # reads from the third tier started
    storage_hit_tokens: int = 0  # tokens brought into the host tier from storage
    storage_read_bytes: int = 0
    storage_read_seconds: float = 0.0
    storage_writes: int = 0  # writes to the third tier started
    storage_write_bytes: int = 0
    storage_write_seconds: float = 0.0
    storage_errors: int = 0  # failed storage jobs (store unreachable, I/O error)
    pins_refused: int = 0  # pin calls refused: the pin budget (max_pinned_fraction) was spent


class _Transfer:
    """A transfer in flight and the tree nodes / requests that depend on it."""

    __slots__ = ("handle", "kind", "nodes", "requests", "evict", "nbytes")

    def __init__(self, handle, kind: str, nodes: list[TreeNode], nbytes: int) -> None:
        self.handle = handle
        self.kind = kind  # "load" | "backup"
        self.nodes = nodes  # grows when a node is split while in flight
        self.requests: list[PrefixHandle] = []  # requests that must wait for this load
        # write-back: the nodes (the evicted leaf, parts split off it) whose device
        # pages are freed once backed up; None for other backups
        self.evict: list[TreeNode] | None = None
        self.nbytes = nbytes


class HiCache(ThirdTierMixin, NativeLifecycleMixin, ControlMixin):
    """Hierarchical (device + host) prefix cache. See the module docstring for the lifecycle."""

    def __init__(self, config: CacheConfig) -> None:
        from hicache.memory import DevicePool, HostPool, check_cache_memory
        from hicache.transfer import TransferEngine

        if not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected CacheConfig, got {type(config).__name__}")
        check_cache_memory(config)  # before any pool or page allocator is built
        self.config = config
        self._closed = False
        self.page_size = config.page_size
        self.tree = _make_tree(config)  # split hook: only while IO or a pin is tracked
        self.device_allocator = PageAllocator(config.num_device_pages, "device pages")
        self.host_allocator = PageAllocator(config.num_host_pages, "host pages")
        self.has_host_tier = config.has_host_tier
        if config.allocate_kv:
            self.device_pool = DevicePool(config.kv, config.num_device_pages, config.device)
            self.host_pool = (
                HostPool(
                    config.kv, config.num_host_pages, reserve_nbytes=config.host_reserve_nbytes
                )
                if self.has_host_tier
                else None
            )
            # Without a host tier nothing is ever transferred; a copying executor
            # would demand a host pool.
            executor = config.executor if self.has_host_tier else "immediate"
        else:
            self.device_pool = self.host_pool = None
            executor = "immediate"
        self.transfers = TransferEngine(self.device_pool, self.host_pool, executor)
        # Bookkeeping only (no KV tensors): loads and write-through backups complete
        # as they start, so they skip the IO states and transfer records entirely.
        self._bookkeeping = self.device_pool is None
        self._counters = CacheStats()
        self._page_nbytes = config.kv.page_nbytes
        self._inflight: dict[int, _Transfer] = {}  # id(transfer handle) -> record
        self._node_transfer: dict[TreeNode, _Transfer] = {}  # nodes with IO in flight
        self._num_loading_nodes = 0
        self._live: set[PrefixHandle] = set()
        self._pins = {}  # (namespace, key) -> pin (hicache/cache/control.py)
        self._event_log = [] if config.kv_events else None  # KV events (hicache/events.py)
        if config.kv_events:
            self.tree.enable_events()
        self.storage = None
        self._storage_pins: dict[TreeNode, object] = {}  # host-pinned by a storage write
        self._prefetches: list = []  # storage reads in flight
        # While a load is being set up, finished storage jobs wait: a read applied then
        # would insert host pages (splitting the pinned nodes the load is about to use).
        self._storage_paused = False
        if config.storage is not None:
            self._open_storage(config)
        self._open_lifecycle(config)  # sets _core: the C++ lifecycle, or None

    # ------------------------------------------------------------- lifecycle
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
        eviction priority of the prefix ``h`` holds (see :meth:`_raise_priority`).
        """
        self._check_open()
        if priority is not None:
            priority = check_priority(priority)
        h = self._match(tokens, namespace, load_back)
        if priority is not None:
            self._raise_priority(h, priority)
        return h

    def _raise_priority(self, h: PrefixHandle, priority: int) -> None:
        """Raise the priority of every node on ``h``'s locked path to at least ``priority``.

        Priorities only grow (a shared prefix keeps its most important user's) and
        order eviction only under the ``priority`` policy: lowest first, least
        recently used among equals.
        """
        if self._core is not None:  # the lock node is a bare native handle
            self.tree._impl.raise_priority(h._lock_h, priority)
        else:
            self.tree.raise_priority(h._lock_node, priority)

    def _match(self, tokens: TokenLike, namespace: str | None, load_back: bool) -> PrefixHandle:
        if not isinstance(load_back, bool):
            raise TypeError(f"load_back: expected bool, got {type(load_back).__name__}")
        check_namespace(namespace)  # before storage keys are derived from it
        if self._core is not None:  # bookkeeping only: nothing is ever in flight to poll
            return self._match_native(tokens, namespace, load_back)
        self.poll()
        key = token_key(tokens, self.page_size)
        if self.storage is not None:
            self._prefetch_for_match(key, namespace)
        result = self.tree.match_key(key, namespace)
        h = PrefixHandle(
            self, key, namespace, result.device_len, result.host_len, result.last_device_node
        )
        self.tree.lock(result.last_device_node)
        self._live.add(h)
        c = self._counters
        c.requests += 1
        c.requested_tokens += len(tokens)
        c.device_hit_tokens += result.device_len
        if self._num_loading_nodes:
            self._wait_for_loads_on_path(h, result.last_device_node)
        if load_back and result.host_len:
            self._start_load(h, result)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            # After the load: the host allocation for these backups may evict host
            # pages, and the matched host-only nodes are pinned only once loading.
            self._backup_path(h._lock_node)
        return h

    def load_back(self, h: PrefixHandle):
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
        self.poll()
        self._apply_load_failures(h)
        if h.prefix_len < h.device_len + h.host_len:
            result = self.tree.match_key(h.key[: 4 * (h.device_len + h.host_len)], h.namespace)
            if result.device_len > h.prefix_len:  # loaded or inserted meanwhile: take it
                self.tree.lock(result.last_device_node)
                self.tree.unlock(h._lock_node)
                h._lock_node = result.last_device_node
                h._prefix_pages = None
                h.prefix_len = result.device_len
                if self._num_loading_nodes:
                    self._wait_for_loads_on_path(h, result.last_device_node)
            if result.host_len and result.last_device_node is h._lock_node:
                return self._start_load(h, result)
        return None

    def _start_load(self, h: PrefixHandle, result: MatchResult):
        nodes = self.tree.host_only_path(result)
        num_pages = sum(n.num_tokens for n in nodes) // self.page_size
        num_tokens = num_pages * self.page_size
        if num_tokens < self.config.load_threshold_tokens:
            self._counters.loads_refused_by_threshold += 1
            self._counters.host_hit_refused_tokens += num_tokens
            return None
        # Pinned now: the eviction below must not take them (a write-back eviction
        # may evict host pages), and a real load reads them until it completes.
        pin = not self._bookkeeping or self.config.write_policy is WritePolicy.WRITE_BACK
        if pin:
            for node in nodes:
                self.tree.host_lock(node)
        self._storage_paused = True
        try:
            pages = self._alloc_device(num_pages)
        finally:
            self._storage_paused = False
        if h._lock_node is not result.last_device_node:
            # Eviction polls: a failed load applied meanwhile cut ``h`` back above these
            # nodes (their parent may have lost its device copy). Load nothing.
            if pages is not None:
                self.device_allocator.free(pages)
            for node in nodes if pin else ():
                self.tree.host_unlock(node)
            return None
        if pages is None:
            for node in nodes if pin else ():
                self.tree.host_unlock(node)
            self._counters.loads_refused_no_space += 1
            self._counters.host_hit_refused_tokens += num_tokens
            return None
        off = 0
        for node in nodes:
            n = node.num_tokens // self.page_size
            self.tree.attach_device(node, pages[off : off + n])
            if self._bookkeeping:
                if pin:
                    self.tree.host_unlock(node)
            else:
                self.tree.set_io_status(node, IOStatus.LOADING)
            off += n
        self.tree.lock(nodes[-1])
        self.tree.unlock(h._lock_node)
        h._lock_node = nodes[-1]
        h._prefix_pages = None
        h.prefix_len += num_tokens
        self._counters.loads += 1
        self._counters.host_hit_tokens += num_tokens
        if self._bookkeeping:  # no KV to move: the load is complete as it starts
            self._counters.load_bytes += num_pages * self._page_nbytes
            return None
        host_pages = torch.cat([n.host_indices for n in nodes]) if len(nodes) > 1 else (
            nodes[0].host_indices
        )
        handle = self.transfers.load(host_pages, pages)
        rec = _Transfer(handle, "load", list(nodes), num_pages * self._page_nbytes)
        rec.requests.append(h)
        h._loads.append(rec)
        self._track(rec)
        return handle

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
        self._apply_load_failures(h)
        h._loads = [rec for rec in h._loads if id(rec.handle) in self._inflight]
        failed, h._failure_unreported = h._failure_unreported, False
        if not failed:
            h.load_error = None  # e.g. a retried load_back landed
        return not failed

    def alloc(self, h: PrefixHandle, num_tokens: int) -> torch.Tensor | None:
        """Allocate device pages for ``num_tokens`` more tokens of ``h``'s sequence.

        The new pages continue ``h.page_table()``. Evicts if needed; returns
        ``None`` when not enough pages can be freed, and then has evicted nothing:
        a refused allocation leaves every cached prefix in place.
        """
        self._check_handle(h)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens: expected int, got {type(num_tokens).__name__}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens: expected >= 0, got {num_tokens}")
        num_pages = -(-num_tokens // self.page_size)
        if self._pins:  # an expired pin's pages are evictable again
            self._expire_pins(self._now())
        if num_pages > self.device_allocator.num_pages:
            return None  # more than the whole device tier: evicting cannot help
        if self._core is not None:
            pages = self._core.alloc(num_pages)
        else:
            self.poll()
            self._apply_load_failures(h)
            pages = self._alloc_device(num_pages)
        if pages is not None and pages.shape[0]:
            h._new_pages.append(pages)
        return pages

    def insert(self, h: PrefixHandle, tokens: TokenLike, *, priority: int | None = None) -> int:
        """Cache the whole pages of ``tokens`` (the prefix plus what the caller computed).

        ``tokens`` must start with ``h``'s prefix and fit in ``h.page_table()``.
        Pages another request cached meanwhile are freed (the tree keeps its own).
        Afterwards ``h`` holds the inserted path; the write policy runs. Returns the
        number of tokens newly cached. ``priority`` raises the eviction priority of
        the path ``h`` holds afterwards (see :meth:`_raise_priority`). Raises :class:`LoadError` (having cut ``h``
        back) when a load of ``h``'s prefix failed and ``finish_loads`` has not
        reported it yet.
        """
        if priority is not None:
            self._check_handle(h)
            priority = check_priority(priority)
        num_new = self._insert(h, tokens)
        if priority is not None:
            self._raise_priority(h, priority)
        return num_new

    def _insert(self, h: PrefixHandle, tokens: TokenLike) -> int:
        self._check_handle(h)
        if self._core is not None:  # bookkeeping only: no load is ever in flight
            return self._insert_native(h, tokens)
        self.poll()
        self._apply_load_failures(h)
        if h._failure_unreported:
            raise LoadError(
                f"insert: a load of the prefix failed ({h.load_error}); h.prefix_len was cut "
                f"back to {h.prefix_len}: call finish_loads(h), alloc and recompute from there"
            )
        for rec in h._loads:
            if not rec.handle.done():
                raise ValueError("insert: a prefix load is still in flight; call h.wait() first")
        key = token_key(tokens, self.page_size)
        pnb = 4 * self.page_size
        prefix_nbytes = 4 * h.prefix_len
        if len(key) < prefix_nbytes or not key.startswith(h.key[:prefix_nbytes]):
            raise ValueError(
                f"insert: tokens must start with the handle's {h.prefix_len}-token prefix"
            )
        num_pages = len(key) // pnb
        num_prefix_pages = h.prefix_len // self.page_size
        num_owned = h.num_owned_pages
        if num_pages > num_prefix_pages + num_owned:
            raise ValueError(
                f"insert: {num_pages} whole pages of tokens, but the handle holds only "
                f"{num_prefix_pages + num_owned} pages (alloc more first)"
            )
        if num_pages == num_prefix_pages:
            return 0
        table = h.page_table()
        inserted = table[:num_pages]
        result = self.tree.insert_key(key, inserted, h.namespace)
        cached_pages = result.num_cached_tokens // self.page_size
        if cached_pages > num_prefix_pages:  # cached meanwhile by someone else: ours are spare
            self.device_allocator.free(table[num_prefix_pages:cached_pages])
        rest = table[num_pages:]
        h._new_pages = [rest] if rest.shape[0] else []
        self.tree.lock(result.last_node)
        self.tree.unlock(h._lock_node)
        h._lock_node = result.last_node
        if self._num_loading_nodes:  # deduplicated onto pages a load is still writing
            self._wait_for_loads_on_path(h, result.last_node)
        # If nothing was cached meanwhile, the tree's pages of the path are ours.
        h._prefix_pages = inserted if cached_pages <= num_prefix_pages else None
        h.prefix_len = num_pages * self.page_size
        h.key = key
        new_tokens = (num_pages - cached_pages) * self.page_size
        self._counters.inserted_tokens += new_tokens
        if self.config.write_policy is not WritePolicy.WRITE_BACK:
            self._backup_path(result.last_node)
        return new_tokens

    def release(self, h: PrefixHandle) -> None:
        """Unlock ``h``'s prefix and free the pages it owns. The cached KV stays cached."""
        self._check_handle(h)
        if self._core is not None and len(h._new_pages) <= 1:
            self._core.release(h._lock_h, h._new_pages[0] if h._new_pages else None)
        else:
            self.tree.unlock(h._lock_node)
            for pages in h._new_pages:
                self.device_allocator.free(pages)
        h._new_pages = []
        h.released = True
        self._live.discard(h)
        self.poll()

    # -------------------------------------------------------------- transfers
    def poll(self) -> int:
        """Apply every transfer that finished since the last call; return how many."""
        self._check_open()
        if not self._inflight and (self.storage is None or not self.storage.num_in_flight):
            return 0  # nothing can have finished
        done = self.transfers.poll()
        if self.storage is not None and not self._storage_paused:
            for job in self.storage.poll():
                if job.kind == "write":
                    self._finish_storage_write(job)
                else:
                    self._finish_storage_read(job)
        for handle in done:
            rec = self._inflight.pop(id(handle))
            for node in rec.nodes:
                del self._node_transfer[node]
            if rec.kind == "load":
                self._num_loading_nodes -= len(rec.nodes)
                self._finish_load(rec)
            else:
                self._finish_backup(rec)
        if not self._node_transfer and not self._storage_pins and self.tree.on_split is not None:
            self.tree.on_split = None  # nothing to follow through splits any more
        return len(done)

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every transfer (and storage job) in flight, then apply them.

        On the manual executor only what the test completed is applied.
        """
        self._check_open()
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(f"timeout: expected seconds or None, got {type(timeout).__name__}")
            if not timeout >= 0:
                raise ValueError(f"timeout: expected >= 0, got {timeout}")
            if math.isinf(timeout):  # waits take a finite timeout: infinity is no limit
                timeout = None
        for rec in list(self._inflight.values()):
            rec.handle.wait(timeout)
        self.poll()  # finished backups may start storage writes
        for job in [*self._prefetches, *set(self._storage_pins.values())]:
            job.done.wait(timeout)
        self.poll()

    def _watch_splits(self) -> None:
        """Follow splits (``_on_split``) while a node is tracked by a transfer or a pin.

        Installed on demand: with nothing tracked a split needs no bookkeeping, and
        the native tree would otherwise call into Python on every split (most
        evictions split a leaf). ``poll`` removes the hook once nothing is tracked.
        """
        if self.tree.on_split is None:
            self.tree.on_split = self._on_split

    def _track(self, rec: _Transfer) -> None:
        self._watch_splits()
        self._inflight[id(rec.handle)] = rec
        for node in rec.nodes:
            self._node_transfer[node] = rec
        if rec.kind == "load":
            self._num_loading_nodes += len(rec.nodes)

    def _on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        job = self._storage_pins.get(suffix)
        if job is not None:
            job.nodes.append(prefix)
            self._storage_pins[prefix] = job
        rec = self._node_transfer.get(suffix)
        if rec is not None:
            rec.nodes.append(prefix)
            self._node_transfer[prefix] = rec
            if rec.kind == "load":
                self._num_loading_nodes += 1
            elif rec.evict is not None and suffix in rec.evict:
                rec.evict.append(prefix)

    def _finish_load(self, rec: _Transfer) -> None:
        handle = rec.handle
        c = self._counters
        for node in rec.nodes:
            self.tree.set_io_status(node, IOStatus.NONE)
            self.tree.host_unlock(node)
        if handle.error is None:
            c.load_bytes += rec.nbytes
            c.load_seconds += handle.seconds or 0.0
            return
        # The device pages hold garbage: requests fall back to the prefix above the
        # failed nodes (and recompute the rest); then the nodes lose their device copy.
        c.loads_failed += 1
        nodes = sorted(rec.nodes, key=self._depth)
        top = nodes[0]
        for h in rec.requests:
            # Applied by h's own next call (_apply_load_failures): this poll may run
            # inside another request's call, and h's pages must not change under it.
            # The record stays in h._loads so that h.wait_layer raises LoadError.
            if not h.released:
                h._failed_loads.append((rec, top.parent))
        for node in reversed(nodes):
            if node.lock_ref or any(ch.on_device for ch in node.children.values()):
                # Someone cached KV below it before the failure was seen: load it again.
                self._reload([node])
                continue
            self.device_allocator.free(self.tree.detach_device(node))

    def _reload(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            self.tree.set_io_status(node, IOStatus.LOADING)
            self.tree.host_lock(node)
        handle = self.transfers.load(
            torch.cat([n.host_indices for n in nodes]), torch.cat([n.device_indices for n in nodes])
        )
        num_pages = sum(n.num_tokens for n in nodes) // self.page_size
        self._counters.loads_reloaded += 1
        self._track(_Transfer(handle, "load", list(nodes), num_pages * self._page_nbytes))

    def _apply_load_failures(self, h: PrefixHandle) -> None:
        """Cut ``h`` back above the loads of its prefix that failed (a call made for ``h``)."""
        if not h._failed_loads:
            return
        for rec, node in h._failed_loads:
            if rec in h._loads:
                h._loads.remove(rec)
            self._truncate(h, node, rec.handle.error)
            h.load_error = rec.handle.error
            h._failure_unreported = True
        h._failed_loads = []

    def _truncate(self, h: PrefixHandle, node: TreeNode, error: BaseException) -> None:
        depth = sum(n.num_tokens for n in self.tree.path_to(node))
        if depth >= h.prefix_len:
            return
        self.tree.lock(node)
        self.tree.unlock(h._lock_node)
        h._lock_node = node
        h._prefix_pages = None
        h.prefix_len = depth
        for pages in h._new_pages:  # computed on top of garbage: useless
            self.device_allocator.free(pages)
        h._new_pages = []
        h.load_error = error

    def _finish_backup(self, rec: _Transfer) -> None:
        handle = rec.handle
        c = self._counters
        for node in rec.nodes:
            self.tree.set_io_status(node, IOStatus.NONE)
        if handle.error is not None:
            c.backups_failed += 1
            # Deepest first. A node whose child has a host copy keeps its own (the
            # invariant) and is backed up again; the others lose theirs and stay on
            # the device (a later backup through the path, or write-back eviction,
            # tries again).
            retry = []
            for node in sorted(rec.nodes, key=self._depth, reverse=True):
                if any(ch.host_indices is not None for ch in node.children.values()):
                    retry.append(node)
                else:
                    self.host_allocator.free(self.tree.detach_host(node))
            if retry:
                self._retry_backup(retry[::-1], rec)
            return
        c.backup_bytes += rec.nbytes
        c.backup_seconds += handle.seconds or 0.0
        if self.storage is not None:
            self._store(rec.nodes)
        if rec.evict is not None:
            # Deepest first: parts split off in flight become leaves once their child goes.
            for node in sorted(rec.evict, key=self._depth, reverse=True):
                if node.lock_ref == 0 and not any(ch.on_device for ch in node.children.values()):
                    c.device_evicted_tokens += node.num_tokens
                    self.device_allocator.free(self.tree.detach_device(node))

    def _retry_backup(self, nodes: list[TreeNode], failed: _Transfer) -> None:
        """Copy ``nodes`` (root side first) into the host pages they keep, again."""
        c = self._counters
        for node in nodes:
            self.tree.set_io_status(node, IOStatus.BACKING_UP)
        dev = torch.cat([n.device_indices for n in nodes])
        host = torch.cat([n.host_indices for n in nodes])
        fence = None if self.device_pool is None else self.transfers.compute_fence()
        handle = self.transfers.backup(dev, host, after=fence)
        rec = _Transfer(handle, "backup", nodes, dev.shape[0] * self._page_nbytes)
        if failed.evict is not None:
            rec.evict = [n for n in failed.evict if n in nodes] or None
        c.backups += 1
        c.backups_retried += 1
        self._track(rec)

    def _depth(self, node: TreeNode) -> int:
        depth = 0
        while node.parent is not None:
            depth += 1
            node = node.parent
        return depth

    def _wait_for_loads_on_path(self, h: PrefixHandle, node: TreeNode) -> None:
        while node.parent is not None:
            rec = self._node_transfer.get(node)
            if rec is not None and rec.kind == "load" and rec not in h._loads:
                h._loads.append(rec)
                rec.requests.append(h)
            node = node.parent

    # ------------------------------------------------------- pages, eviction
    def _alloc_device(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` free device pages, evicting as needed; None having evicted nothing.

        Liveness: with no IO in flight, whenever the free pages plus the tree's
        unlocked device pages cover the request, it succeeds (every unlocked device
        page can be evicted: see the invariants in docs/design.md).
        """
        alloc = self.device_allocator
        if num_pages <= alloc.num_free_pages:
            return alloc.alloc(num_pages)
        waits = self._inflight and self.transfers.executor_name != "manual"
        if num_pages > alloc.num_free_pages + self._device_takeable_pages():
            if not waits:
                return None  # a refused allocation touches nothing
            # Pages held by backups in flight (write-back, or nodes that cannot be
            # evicted until their backup lands) come free once those complete.
            self.wait_all()
            if num_pages > alloc.num_free_pages + self._device_takeable_pages():
                return None
        manual = self.transfers.executor_name == "manual"
        stalls = 0
        while num_pages > alloc.num_free_pages and stalls < 3:
            before = alloc.num_free_pages
            # Write-back hands device leaves to backups and frees them as those land, so
            # a chain is freed leaf by leaf: one round per level.
            self._evict_device(num_pages - before)
            if num_pages > alloc.num_free_pages and self._inflight and not manual:
                # Evicted pages come free once their backups land (a failed one is
                # offered to a backup again by the next round).
                self.wait_all()
            if alloc.num_free_pages > before:
                stalls = 0
            elif manual or self._bookkeeping:
                break  # nothing lands until the test completes it / nothing is left
            else:
                stalls += 1
        return alloc.alloc(num_pages)

    def _host_takeable_pages(self) -> int:
        """Host pages host eviction can free now: exactly what ``evict_host`` takes.

        A host copy that is host-locked (a load, a storage write, a pin) or has IO
        in flight is not taken, nor is any host copy above it (host eviction takes
        a host copy only once its children have none: see docs/design.md). The
        tree keeps that figure (``host_takeable_tokens``).
        """
        return self.tree.host_takeable_tokens // self.page_size

    def _device_takeable_pages(self) -> int:
        """Device pages eviction can free now: unlocked ones, less those IO pins.

        An unlocked node with IO in flight (a backup, a reload) is not taken, nor
        are its unlocked ancestors (they keep a device child until it lands).
        """
        tokens = self.tree.device_evictable_tokens
        if self._node_transfer:
            seen: set = set()
            for node in self._node_transfer:
                while node.parent is not None and node.lock_ref == 0 and node not in seen:
                    seen.add(node)
                    if node.device_indices is not None:
                        tokens -= node.num_tokens
                    node = node.parent
        return tokens // self.page_size

    def _evict_device(self, num_pages: int) -> None:
        if num_pages <= 0:
            return
        hook = self._backup_for_eviction if (
            self.config.write_policy is WritePolicy.WRITE_BACK and self.has_host_tier
        ) else None
        result = self.tree.evict_device(num_pages * self.page_size, hook)
        if result.num_evicted_tokens:
            self.device_allocator.free(result.page_ids)
            self._counters.device_evicted_tokens += result.num_evicted_tokens
        if result.num_backup_tokens:
            self.poll()  # the immediate executor has finished already

    def _alloc_host(self, num_pages: int) -> torch.Tensor | None:
        alloc = self.host_allocator
        short = num_pages - alloc.num_free_pages
        if short > 0 and short > self._host_takeable_pages():
            return None  # evicting would not make enough room: keep what is cached
        if short > 0:
            result = self.tree.evict_host(short * self.page_size)
            if result.num_evicted_tokens:
                self.host_allocator.free(result.page_ids)
                self._counters.host_evicted_tokens += result.num_evicted_tokens
        return alloc.alloc(num_pages)

    def _backup_path(self, node: TreeNode) -> None:
        """Back up the nodes on ``node``'s path that the write policy wants on the host."""
        if not self.has_host_tier:
            return
        selective = self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        todo = self.tree.path_missing_host(node, self.config.backup_hit_threshold if selective else 0)
        if todo:
            self._start_backup(todo)

    def _backup_for_eviction(self, node: TreeNode) -> bool:
        # A host copy needs host copies of every ancestor (docs/design.md): the
        # ancestors that lack one are backed up with it and stay on the device.
        return self._start_backup(self.tree.path_missing_host(node), evict=node)

    def _start_backup(self, nodes: list[TreeNode], evict: TreeNode | None = None) -> bool:
        """Back up ``nodes`` (one path, root side first); True if ``evict``'s backup started.

        Stops at the first node whose parent has no host copy (the invariant: a
        host copy implies host copies of every ancestor) or that the
        host tier cannot take: the rest of the path is skipped. ``evict`` (the last
        node, write-back) loses its device pages once its backup lands.
        """
        # A write-back eviction still goes through a (completed) transfer: the
        # eviction loop hands the node over and frees its pages when that is applied.
        sync = self._bookkeeping
        started: list[TreeNode] = []
        for i, node in enumerate(nodes):
            parent = node.parent
            if parent.parent is not None and parent.host_indices is None:
                break  # the parent first: a later backup through this path takes these
            num_pages = node.num_tokens // self.page_size
            # Making room must not take the parent's host copy (a host-eviction
            # candidate while its children have none): node's copy needs it.
            guard = parent.parent is not None and num_pages > self.host_allocator.num_free_pages
            if guard:
                self.tree.host_lock(parent)
            try:
                host_pages = self._alloc_host(num_pages)
            finally:
                if guard:
                    self.tree.host_unlock(parent)
            if host_pages is None:
                self._counters.backups_skipped += len(nodes) - i
                break
            self.tree.attach_host(node, host_pages)
            if not sync or node is evict:
                self.tree.set_io_status(node, IOStatus.BACKING_UP)
            started.append(node)
        if not started:
            return False
        self._counters.backups += 1
        moving = started if not sync else [evict] if started[-1] is evict else []
        if sync:  # bookkeeping only: the host copy is complete as it starts
            self._counters.backup_bytes += (
                sum(n.num_tokens for n in started if n is not evict) // self.page_size
                * self._page_nbytes
            )
        if not moving:
            return False
        if len(moving) == 1:
            dev, host = moving[0].device_indices, moving[0].host_indices
        else:
            dev = torch.cat([n.device_indices for n in moving])
            host = torch.cat([n.host_indices for n in moving])
        # Bookkeeping-only replay has no compute to wait for (and no fence to make).
        fence = None if self.device_pool is None else self.transfers.compute_fence()
        handle = self.transfers.backup(dev, host, after=fence)
        rec = _Transfer(handle, "backup", moving, dev.shape[0] * self._page_nbytes)
        if evict is not None and started[-1] is evict:
            rec.evict = [evict]
        self._track(rec)
        return rec.evict is not None

    # ------------------------------------------------------- inspection
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                "HiCache is closed: its transfers and workers are stopped; make a new HiCache"
            )

    def _check_handle(self, h: object) -> None:
        self._check_open()
        if not isinstance(h, PrefixHandle):
            raise TypeError(f"expected a PrefixHandle, got {type(h).__name__}")
        if h._cache is not self:
            raise ValueError("handle belongs to another HiCache")
        if h.released:
            raise ValueError("handle was already released")

    def stats(self) -> dict:
        """Counters plus current occupancy; bandwidths in GB/s (1e9 bytes per second).

        After :meth:`close` it still reports the final state (nothing is polled).
        """
        if not self._closed:
            self.poll()
        c = self.counters  # with the C++ lifecycle: its counts added in
        s = asdict(c)
        s["hit_tokens"] = c.device_hit_tokens + c.host_hit_tokens
        s["hit_ratio"] = s["hit_tokens"] / c.requested_tokens if c.requested_tokens else 0.0
        s["load_gbps"] = c.load_bytes / c.load_seconds / 1e9 if c.load_seconds else 0.0
        s["backup_gbps"] = c.backup_bytes / c.backup_seconds / 1e9 if c.backup_seconds else 0.0
        s["device_pages_used"] = self.device_allocator.num_used_pages
        s["device_pages_free"] = self.device_allocator.num_free_pages
        s["host_pages_used"] = self.host_allocator.num_used_pages
        s["host_pages_free"] = self.host_allocator.num_free_pages
        s["device_cached_tokens"] = self.tree.device_tokens
        s["host_cached_tokens"] = self.tree.host_tokens
        s["transfers_in_flight"] = len(self._inflight)
        s["live_requests"] = len(self._live)
        s["pins"] = len(self._pins)
        s["pinned_device_tokens"] = self.pinned_device_tokens()
        return s

    def check_integrity(self) -> None:
        """Verify the tree's invariants and that every page and lock is accounted for."""
        self.tree.check_integrity()
        self.device_allocator.check_integrity()
        self.host_allocator.check_integrity()
        P = self.page_size
        owned = sum(h.num_owned_pages for h in self._live)
        assert self.device_allocator.num_used_pages == self.tree.device_tokens // P + owned, (
            f"device pages: {self.device_allocator.num_used_pages} allocated, tree holds "
            f"{self.tree.device_tokens // P}, requests own {owned}: pages leaked or lost"
        )
        prefetching = sum(job.host_pages.shape[0] for job in self._prefetches)
        assert self.host_allocator.num_used_pages == self.tree.host_tokens // P + prefetching, (
            f"host pages: {self.host_allocator.num_used_pages} allocated, tree holds "
            f"{self.tree.host_tokens // P}, storage reads hold {prefetching}: pages leaked or lost"
        )
        want_locks: dict[TreeNode, int] = {}
        want_host_locks: dict[TreeNode, int] = {}
        for h in self._live:
            for node in self.tree.path_to(h._lock_node):
                want_locks[node] = want_locks.get(node, 0) + 1
        self._check_pins(want_locks)
        for rec in self._inflight.values():
            if rec.kind == "load":
                for node in rec.nodes:
                    want_host_locks[node] = want_host_locks.get(node, 0) + 1
        for node in self._storage_pins:
            want_host_locks[node] = want_host_locks.get(node, 0) + 1
        for node in self.tree.nodes():
            parent = node.parent
            assert not node.on_host or parent.parent is None or parent.on_host, (
                f"node {node.id}: a host copy under parent {parent.id} without one (a host "
                f"copy implies host copies of every ancestor)"
            )
            assert node.lock_ref == want_locks.get(node, 0), (
                f"node {node.id}: lock_ref {node.lock_ref}, live requests hold "
                f"{want_locks.get(node, 0)}: a lock leaked"
            )
            assert node.host_lock_ref == want_host_locks.get(node, 0), (
                f"node {node.id}: host_lock_ref {node.host_lock_ref}, expected "
                f"{want_host_locks.get(node, 0)}"
            )
            in_flight = node in self._node_transfer
            assert in_flight == (node.io_status is not IOStatus.NONE), (
                f"node {node.id}: io_status {node.io_status.name} but tracked={in_flight}"
            )
        assert len(self._inflight) == self.transfers.num_in_flight, (
            f"{len(self._inflight)} transfers tracked, engine has {self.transfers.num_in_flight}"
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

    def __exit__(self, *exc) -> None:
        self.close()


def _make_tree(config: CacheConfig):
    if config.tree == "python":
        from hicache.tree import RadixTree

        return RadixTree(config.page_size, config.eviction)
    from hicache.tree import make_tree

    return make_tree(config.tree, config.page_size, config.eviction)
