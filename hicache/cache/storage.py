"""HiCache's side of the third tier: prefetch into host memory, write-behind of backups.

:class:`ThirdTierMixin` holds the methods of :class:`hicache.cache.HiCache` that
coordinate storage jobs (:mod:`hicache.storage.worker` runs them on worker threads):
reading pages only storage holds into host pages before a match wants them,
and writing the host copies of freshly backed-up nodes to storage, host-pinned
until the write lands. Finished jobs are applied in ``HiCache.poll`` like
transfers. It uses the cache's tree, host allocator, counters and
``_alloc_host``; it knows nothing of device pages or the request lifecycle.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.checks import check_namespace
from hicache.config import CacheConfig, PrefetchPolicy
from hicache.storage.base import StorageError
from hicache.tree import TokenLike, TreeNode, token_key


class ThirdTierMixin:
    """Third-tier coordination for :class:`hicache.cache.HiCache` (see the module docstring)."""

    def _open_storage(self, config: CacheConfig) -> None:
        from hicache.storage import make_storage
        from hicache.storage.worker import StorageTier

        if self.host_pool is None:
            raise ValueError(
                "storage: expected a host tier holding KV (host_tokens/host_nbytes/host_ratio "
                "and allocate_kv=True), got none"
            )
        backend = make_storage(
            config.storage, page_nbytes=self._page_nbytes, **config.extra.get("storage", {})
        )
        self.storage = StorageTier(backend, self.host_pool)
        self._fingerprint = config.kv.fingerprint()
        assert config.model_id is not None, "CacheConfig refuses storage without model_id"
        self._model_id = config.model_id

    def _page_keys(self, key: bytes, namespace: str | None) -> list[str]:
        from hicache.storage import page_keys

        tokens = np.frombuffer(key, dtype=np.int32)
        # The model identity is in the salt: a store shared by several models (same
        # KV layout, other weights) never hands one model another's pages.
        return page_keys(tokens, self.page_size, namespace, self._fingerprint, self._model_id)

    def prefetch(self, tokens: TokenLike, namespace: str | None = None):
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
        if self.storage is None:
            return None
        return self._start_prefetch(key, namespace)

    def _start_prefetch(self, key: bytes, namespace: str | None):
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
        keys = self._page_keys(key, namespace)[start:]
        try:
            num_pages = self.storage.backend.exists(keys)
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
        host_pages = self._alloc_host(num_pages)
        for node in held:
            self.tree.host_unlock(node)
        if host_pages is None:
            return covering
        job = StorageJob("read", keys[:num_pages], host_pages)
        job.token_key = key[: (start + num_pages) * pnb]
        job.namespace = namespace
        job.start_page = start
        self._prefetches.append(job)
        self.storage.submit(job)
        self._counters.storage_prefetches += 1
        return job

    def _prefetch_continuing(self, key: bytes, namespace: str | None, start: int, end: int):
        """The read in flight that fetches pages ``start`` onward of ``key`` (at least one
        of them, all as ``key`` has them up to ``end``), or None."""
        pnb = 4 * self.page_size
        for job in self._prefetches:
            if job.namespace != namespace or job.start_page != start:
                continue
            num_common = min(len(job.token_key), end * pnb)
            if job.token_key[:num_common] == key[:num_common]:
                return job
        return None

    def _prefetch_for_match(self, key: bytes, namespace: str | None) -> None:
        job = self._start_prefetch(key, namespace)
        if job is not None:
            policy = self.config.prefetch_policy
            if policy is PrefetchPolicy.WAIT_COMPLETE:
                job.done.wait()
            elif policy is PrefetchPolicy.TIMEOUT:
                job.done.wait(self.config.prefetch_timeout_s)
            self.poll()

    def _finish_storage_read(self, job) -> None:
        self._prefetches.remove(job)
        c = self._counters
        c.storage_read_seconds += job.seconds
        if job.error is not None:
            c.storage_errors += 1
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
                self.host_allocator.free(job.host_pages[:cached])
            taken = num_done - max(cached, 0)
            c.storage_hit_tokens += taken * P
        else:
            num_done = 0
        if job.host_pages.shape[0] > num_done:
            self.host_allocator.free(job.host_pages[num_done:])

    def _store(self, nodes: list[TreeNode]) -> None:
        """Write the host copies of freshly backed-up nodes to storage, pinned meanwhile."""
        from hicache.storage.worker import StorageJob

        keys: list[str] = []
        for node in nodes:
            if node.host_indices is None:
                continue
            path_key = b"".join(n.key for n in self.tree.path_to(node))
            num_pages = node.num_tokens // self.page_size
            keys.extend(self._page_keys(path_key, node.namespace)[-num_pages:])
        live = [n for n in nodes if n.host_indices is not None]
        if not live:
            return
        job = StorageJob("write", keys, torch.cat([n.host_indices for n in live]))
        self._watch_splits()
        for node in live:
            self.tree.host_lock(node)
            self._storage_pins[node] = job
        job.nodes = live
        if self._event_log is not None:  # hashed now: splits reorder job.nodes meanwhile
            job.event_pages = [(n.namespace, *self.tree.node_hashes(n)) for n in live]
        self.storage.submit(job)
        self._counters.storage_writes += 1

    def _finish_storage_write(self, job) -> None:
        for node in job.nodes:
            self.tree.host_unlock(node)
            del self._storage_pins[node]
        c = self._counters
        c.storage_write_seconds += job.seconds
        if job.error is not None:
            c.storage_errors += 1
        else:
            c.storage_write_bytes += job.num_done * self._page_nbytes
            if self._event_log is not None:
                self._log_storage_stored(job.event_pages, job.num_done)
