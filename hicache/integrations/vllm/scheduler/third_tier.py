"""The scheduler half's third tier: what it may promise from storage, and under which keys.

A lookup (``get_num_new_matched_tokens``) may promise pages that only storage
holds; ``update_state_after_alloc`` then allocates host pages for them and the
workers read them from storage into those pages before loading them. A promise
that cannot be kept is a load error (vLLM's default load-failure policy fails
the request), so a lookup promises only the stored pages that host memory can
take at that moment. Storage keys are chained (each page's key covers every
token before it), so a request's keys are computed once and extended as the
request grows.

This module only asks the backend ``exists``; reads and writes are the workers'.
Nothing here changes the tree or the page allocator.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

from hicache.integrations.vllm.common.keys import salt_keys

_log = logging.getLogger("hicache.integrations.vllm.scheduler")
MAX_ROOTS = 4096  # namespaces whose storage-key seed StorageKeys keeps


class StorageKeys:
    """The third-tier keys of requests' pages: chained from one root per namespace
    (``cache_salt``), which folds in the storage identity and the tier's epoch."""

    def __init__(self, identity: tuple[str, str] | None, epoch: int, page_size: int) -> None:
        """``identity``: ``(KV layout fingerprint, model_id)`` (None: a placeholder)."""
        self.identity = identity
        self.epoch = epoch
        self.page_size = page_size
        # Chain seed per namespace, the most recently used MAX_ROOTS (one hash to make
        # again): clients choosing namespaces must not grow the scheduler without bound.
        self._roots: OrderedDict[str | None, str] = OrderedDict()

    def of(self, st, num_pages: int) -> list[str]:
        """Keys of the first ``num_pages`` pages of ``st`` (a request's
        :class:`~hicache.integrations.vllm.scheduler.requests.RequestState`; its ``keys`` cache
        is extended in place)."""
        from hicache.storage import extend_keys, root_key

        keys: list[str] = st.keys
        have = len(keys)
        if have < num_pages:
            root = self._roots.get(st.namespace)
            if root is None:
                fingerprint, model_id = self.identity or ("vllm", "unknown")
                root = self._roots[st.namespace] = root_key(
                    st.namespace, fingerprint, model_id, epoch=self.epoch)
                if len(self._roots) > MAX_ROOTS:
                    self._roots.popitem(last=False)
            else:
                self._roots.move_to_end(st.namespace)
            prev = keys[-1] if have else root
            # Chained over the pages' identity ids (their tokens, or what their other
            # inputs derive), as the tree keys are.
            keys.extend(extend_keys(prev, st.identity_ids(have, num_pages, self.page_size),
                                    self.page_size))
        return keys[:num_pages]

    def bump_epoch(self, backend) -> bool:
        """Move to this engine's epoch + 1 and raise the tier's record to it (pages stored
        before miss from now on, see docs/storage.md): engines that reset after the same
        weight update land on one epoch and share pages again, which two bumps of the
        record would not give. Keys are rooted anew (callers drop their key caches).
        False when the tier could not be reached (logged; the epoch stays)."""
        from hicache.storage import StorageError

        try:
            backend.advance_epoch(self.epoch + 1)
        except StorageError as exc:
            _log.warning("hicache: the third tier's epoch could not be advanced: %s", exc)
            return False
        self.epoch += 1
        self._roots.clear()
        return True


class StorageProbe:
    """``exists`` off the scheduler's thread, waiting at most ``timeout_s``: a hung store
    (an NFS mount, an unreachable Mooncake master) must not hang vLLM's scheduler loop.

    A probe that timed out promises nothing (0 pages), and so does every probe while it
    is still running (no pile-up of hung calls); the next one after it ended asks again.
    """

    def __init__(self, backend, timeout_s: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.backend = backend
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-exists")
        # The Future of a probe that timed out and has not ended
        self._hung: Future[int] | None = None

    def exists(self, keys: Sequence[str]) -> int:
        from concurrent.futures import TimeoutError as FutureTimeout

        if self._hung is not None:
            if not self._hung.done():
                return 0
            self._hung = None
        future = self._pool.submit(self.backend.exists, keys)
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            self._hung = future
            self.num_timeouts += 1
            return 0

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class NoReads:
    """The probe of a scheduler half that never reads the third tier (a ``kv_producer``):
    as far as its lookups know, the tier holds nothing; it still writes there."""

    num_timeouts = 0

    def exists(self, keys: Sequence[str]) -> int:
        return 0

    def close(self) -> None:
        return


def num_promisable_pages(
    backend, keys: Sequence[str], tree, host_allocator, key: bytes, num_host_pages: int,
    page_size: int, *, extra_pages: int = 0, namespace: str | None = None,
    salts: Sequence[str | None] = (None,),
) -> int:
    """Pages, of those named by ``keys`` (the pages after the ``num_host_pages`` cached
    in host memory for ``key``, and ``extra_pages`` more that host memory must also
    take), that a lookup may promise: the leading run storage holds for every rank (one
    key salt a rank, see :func:`salt_keys`), at most as many as host memory can take
    (:func:`host_room_for_fetch`) besides ``extra_pages``.
    An unreachable store promises nothing (host memory still serves what it has)."""
    from hicache.storage import StorageError

    try:
        stored = min(backend.exists(salt_keys(keys, salt)) for salt in salts)
    except StorageError:
        return 0
    room = host_room_for_fetch(tree, host_allocator, key, num_host_pages, page_size,
                               namespace)
    return max(0, min(stored, room - extra_pages))


def host_room_for_fetch(tree, host_allocator, key: bytes, num_host_pages: int,
                        page_size: int, namespace: str | None = None) -> int:
    """Host pages that allocation can provide once the first ``num_host_pages`` cached
    pages of ``key`` are pinned (as ``after_alloc`` pins them: no longer evictable then)."""
    P = page_size
    own, left = 0, num_host_pages
    for node in tree.probe_path(key, namespace):
        if left <= 0:
            break
        n = min(node.num_tokens // P, left)
        if node.host_lock_ref == 0:
            own += n
        left -= n
    # Pinning takes at most the path's takeable pages out of host_takeable_tokens
    # (subtracting every unpinned path page errs on the side of promising less).
    evictable = tree.host_takeable_tokens // P - own
    return max(0, host_allocator.num_free_pages + evictable)
