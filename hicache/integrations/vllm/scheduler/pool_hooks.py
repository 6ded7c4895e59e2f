"""What the connector sees of vLLM's prefix cache through its block pool.

``bind_gpu_block_pool`` hands the scheduler-side connector vLLM's ``BlockPool``. vLLM
0.32 has no callback for a cached block being evicted, so :class:`EvictionHook` wraps
the pool's ``_maybe_evict_cached_block``, the one place every eviction of a cached
block goes through (``get_new_blocks`` reusing a free block, ``evict_blocks``), and
``get_new_blocks`` to tell a reuse from an eviction alone. The hook reports every
block taken out of the prefix cache or handed out again, whether it held a
prefix-cache entry until then and whether it is being reused, and lets the calls
through unchanged. Hits need no hook: the connector sees them as each request's
``num_computed_tokens``.

This module knows vLLM's pool, nothing of hicache's tiers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

_log = logging.getLogger(__name__)

_ATTR = "_maybe_evict_cached_block"
_ALLOC = "get_new_blocks"


class EvictionHook:
    """Calls ``on_evict(block_id, was_cached, reused)`` for every block vLLM's pool takes
    out of its prefix cache or hands out again (``reused``: by ``get_new_blocks``, for a
    step being scheduled), while not :meth:`paused`."""

    def __init__(self, pool: Any, on_evict: Callable[[int, bool, bool], None]) -> None:
        original = getattr(pool, _ATTR, None)
        alloc = getattr(pool, _ALLOC, None)
        if not callable(original) or not callable(alloc):
            raise TypeError(
                f"vLLM's block pool ({type(pool).__name__}) has no {_ATTR}: expected vLLM "
                "0.32's BlockPool (write_back needs to see its evictions)"
            )
        self._pool = pool
        self._original = original
        self._alloc = alloc
        self._on_evict = on_evict
        self._paused = 0
        self._allocating = 0
        setattr(pool, _ATTR, self._evict)  # instance attributes shadow the methods
        setattr(pool, _ALLOC, self._get_new_blocks)

    def _evict(self, block: Any) -> bool:
        evicted = self._original(block)
        if not self._paused:
            self._on_evict(block.block_id, bool(evicted), self._allocating > 0)
        return evicted

    def _get_new_blocks(self, num_blocks: int) -> Any:
        self._allocating += 1
        try:
            return self._alloc(num_blocks)
        finally:
            self._allocating -= 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Evictions the connector asks for itself (blocks holding wrong KV) are not
        reported."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def close(self) -> None:
        """Give the pool its own method back (idempotent)."""
        if self._pool is not None and getattr(self._pool, _ATTR, None) == self._evict:
            delattr(self._pool, _ATTR)
        if self._pool is not None and getattr(self._pool, _ALLOC, None) == self._get_new_blocks:
            delattr(self._pool, _ALLOC)
        self._pool = None
