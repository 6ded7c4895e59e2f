"""HiCache's side of the third tier: prefetch into host memory, write-behind of backups.

:class:`ThirdTier` coordinates storage jobs (:mod:`hicache.storage.worker` runs
them on worker threads): reading pages only storage holds into host pages
before a match wants them, and writing the host copies of freshly backed-up
nodes to storage, host-pinned until the write lands. Finished jobs are applied
by the cache's ``poll`` (:meth:`ThirdTier.finish`), like transfers. It uses the
tree, the host side of the tier space, the in-flight table (the pins) and the
counters; it knows nothing of device pages or the request lifecycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.config import CacheConfig, PrefetchPolicy
from hicache.storage.base import StorageError
from hicache.tree import TreeNode
from hicache.tree.pages import host_pages_of

if TYPE_CHECKING:  # annotations only
    from hicache.cache.inflight import InFlightTable
    from hicache.cache.space import TierSpace
    from hicache.cache.stats import CacheStats
    from hicache.memory import HostPool
    from hicache.storage.worker import EventPages, StorageJob
    from hicache.tree.protocol import RadixTreeLike


class ThirdTier:
    """Third-tier coordination for :class:`hicache.cache.HiCache` (see the module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        tree: RadixTreeLike,
        host_pool: HostPool | None,
        space: TierSpace,
        inflight: InFlightTable,
        counters: CacheStats,
        *,
        poll: Callable[[], int],
        log_stored: Callable[[list[EventPages], int], None] | None,
    ) -> None:
        from hicache.storage import make_storage
        from hicache.storage.worker import StorageTier

        if host_pool is None:
            raise ValueError(
                "storage: expected a host tier holding KV (host_tokens/host_nbytes/host_ratio "
                "and allocate_kv=True), got none"
            )
        self.page_size = config.page_size
        self._page_nbytes = config.kv.page_nbytes
        assert config.storage is not None, "a third tier needs a storage spec"
        backend = make_storage(
            config.storage, page_nbytes=self._page_nbytes, secret=config.storage_secret,
            **config.extra.get("storage", {}),
        )
        self.worker = StorageTier(backend, host_pool)  # HiCache.storage
        self._fingerprint = config.kv.fingerprint()
        assert config.model_id is not None, "CacheConfig refuses storage without model_id"
        self._model_id = config.model_id
        # The tier's epoch, read once: this cache's pages are those of its own weights,
        # so it moves to a new epoch only when it retires them (new_epoch).
        self.epoch = backend.epoch()
        self._prefetch_policy = config.prefetch_policy
        self._prefetch_timeout_s = config.prefetch_timeout_s
        self.tree = tree
        self._space = space
        self._inflight = inflight
        self._counters = counters
        self._poll = poll  # the cache's
        self._log_stored = log_stored  # KV events for landed writes; None: events off
        self.prefetches: list[StorageJob] = []  # storage reads in flight

    def finish(self, job: StorageJob) -> None:
        """Apply a storage job that finished (the cache's poll)."""
        if job.kind == "write":
            self._finish_write(job)
        else:
            self._finish_read(job)

    def discard_prefetches(self) -> int:
        """Mark every read in flight stale (its pages are thrown away); return how many."""
        for job in self.prefetches:
            job.stale = True
        return len(self.prefetches)

    @property
    def num_prefetching_pages(self) -> int:
        """Host pages that reads in flight hold."""
        return sum(job.host_pages.shape[0] for job in self.prefetches)

    def page_keys(self, key: bytes, namespace: str | None) -> list[str]:
        from hicache.storage import page_keys

        tokens = np.frombuffer(key, dtype=np.int32)
        # The model identity is in the salt: a store shared by several models (same
        # KV layout, other weights) never hands one model another's pages.
        return page_keys(tokens, self.page_size, namespace, self._fingerprint, self._model_id,
                         epoch=self.epoch)

    def new_epoch(self) -> int:
        """Bump the tier's epoch and salt every later key with it: no page stored before
        is read again (weights changed in place). Returns the new epoch."""
        self.epoch = self.worker.backend.bump_epoch()
        return self.epoch

    def start_prefetch(self, key: bytes, namespace: str | None) -> StorageJob | None:
        from hicache.storage.worker import StorageJob

        pnb = 4 * self.page_size
        start = self.tree.probe_key(key, namespace) // self.page_size
        end = len(key) // pnb  # whole pages of the request
        if start >= end:
            return None
        covering = None
        # Reads in flight that fetch exactly this sequence's next pages (same tenant,
        # same tokens up to the end of what they fetch) are already on their way; a
        # request that goes further continues after them. A job is compared by its
        # tokens, not only where it starts: two prompts with nothing cached both start
        # at page 0 and share nothing.
        while start < end:
            job = self._prefetch_continuing(key, namespace, start, end)
            if job is None:
                break
            covering = job
            start = job.start_page + job.host_pages.shape[0]
        if start >= end:
            return covering
        keys = self.page_keys(key, namespace)[start:]
        try:
            num_pages = self.worker.backend.exists(keys)
        except StorageError:  # unreachable store: serve from device and host, count it
            self._counters.storage_errors += 1
            return covering
        if num_pages == 0:
            return covering
        # The fetched pages extend the cached prefix: its host-only part is the oldest
        # host leaf, so making room for them would evict it first and waste the read.
        held = []
        if start:  # read-only: a prefetch is not a hit (LFU, selective write-through)
            held = [n for n in self.tree.probe_path(key[: start * pnb], namespace)
                    if not n.on_device]
        for node in held:
            self.tree.host_lock(node)
        host_pages = self._space.alloc_host(num_pages)
        for node in held:
            self.tree.host_unlock(node)
        if host_pages is None:
            return covering
        job = StorageJob("read", keys[:num_pages], host_pages)
        job.token_key = key[: (start + num_pages) * pnb]
        job.namespace = namespace
        job.start_page = start
        self.prefetches.append(job)
        self.worker.submit(job)
        self._counters.storage_prefetches += 1
        return job

    def _prefetch_continuing(
        self, key: bytes, namespace: str | None, start: int, end: int
    ) -> StorageJob | None:
        """The read in flight that fetches pages ``start`` onward of ``key`` (at least one
        of them, all as ``key`` has them up to ``end``), or None."""
        pnb = 4 * self.page_size
        for job in self.prefetches:
            if job.namespace != namespace or job.start_page != start:
                continue
            num_common = min(len(job.token_key), end * pnb)
            if job.token_key[:num_common] == key[:num_common]:
                return job
        return None

    def prefetch_for_match(self, key: bytes, namespace: str | None) -> None:
        job = self.start_prefetch(key, namespace)
        if job is not None:
            policy = self._prefetch_policy
            if policy is PrefetchPolicy.WAIT_COMPLETE:
                job.done.wait()
            elif policy is PrefetchPolicy.TIMEOUT:
                job.done.wait(self._prefetch_timeout_s)
            self._poll()

    def _finish_read(self, job: StorageJob) -> None:
        self.prefetches.remove(job)
        c = self._counters
        c.storage_read_seconds += job.seconds
        if job.error is not None:
            c.storage_errors += 1
        c.storage_unauthentic_pages += job.num_unauthentic
        num_done = 0 if job.error is not None or job.stale else job.num_done
        c.storage_read_bytes += num_done * self._page_nbytes
        start = job.start_page
        P, pnb = self.page_size, 4 * self.page_size
        taken = 0
        # The fetched pages extend a prefix; only useful while that prefix is cached,
        # and (a host copy implies host copies of every ancestor: docs/design.md)
        # only below a host copy.
        prefix_key = job.token_key[: start * pnb]
        if num_done and self.tree.probe_key(prefix_key, job.namespace) == start * P and (
            start == 0 or self.tree.probe_path(prefix_key, job.namespace)[-1].on_host
        ):
            # Entries before ``start`` are placeholders: those pages are cached, so the
            # tree takes none of them.
            indices = torch.cat(
                (torch.zeros(start, dtype=torch.int64), job.host_pages[:num_done])
            )
            tokens = np.frombuffer(job.token_key[: (start + num_done) * pnb], dtype=np.int32)
            result = self.tree.insert_host(tokens, indices, job.namespace)
            cached = result.num_cached_tokens // P - start  # ours that were cached meanwhile
            if cached > 0:
                self._space.host_allocator.free(job.host_pages[:cached])
            taken = num_done - max(cached, 0)
            c.storage_hit_tokens += taken * P
        else:
            num_done = 0
        if job.host_pages.shape[0] > num_done:
            self._space.host_allocator.free(job.host_pages[num_done:])

    def store(self, nodes: list[TreeNode]) -> None:
        """Write the host copies of freshly backed-up nodes to storage, pinned meanwhile."""
        from hicache.storage.worker import StorageJob

        keys: list[str] = []
        for node in nodes:
            if node.host_indices is None:
                continue
            path_key = b"".join(n.key for n in self.tree.path_to(node))
            num_pages = node.num_tokens // self.page_size
            keys.extend(self.page_keys(path_key, node.namespace)[-num_pages:])
        live = [n for n in nodes if n.host_indices is not None]
        if not live:
            return
        job = StorageJob("write", keys, host_pages_of(live))
        self._inflight.pin_for_storage(live, job)
        for node in live:
            self.tree.host_lock(node)
        job.nodes = live
        if self._log_stored is not None:  # hashed now: splits reorder job.nodes meanwhile
            job.event_pages = [(n.namespace, *self.tree.node_hashes(n)) for n in live]
        self.worker.submit(job)
        self._counters.storage_writes += 1

    def _finish_write(self, job: StorageJob) -> None:
        for node in job.nodes:
            self.tree.host_unlock(node)
            self._inflight.unpin_storage(node)
        c = self._counters
        c.storage_write_seconds += job.seconds
        if job.error is not None:
            c.storage_errors += 1
        else:
            c.storage_write_bytes += job.num_done * self._page_nbytes
            if self._log_stored is not None:
                self._log_stored(job.event_pages, job.num_done)
