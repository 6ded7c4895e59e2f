"""What the connector sees of vLLM's prefix cache through its block pool.

``bind_gpu_block_pool`` hands the scheduler-side connector vLLM's ``BlockPool``. vLLM
0.32 has no callback for a cached block being evicted, so :class:`EvictionHook` wraps
the pool's ``_maybe_evict_cached_block``, the one place every eviction of a cached
block goes through (``get_new_blocks`` reusing a free block, ``evict_blocks``). The
hook reports, for every block ``get_new_blocks`` hands out again, whether it held a
prefix-cache entry until then, and lets the call through unchanged. Hits need no
hook: the connector sees them as each request's ``num_computed_tokens``.

This module knows vLLM's pool, nothing of hicache's tiers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

_log = logging.getLogger(__name__)

_ATTR = "_maybe_evict_cached_block"


class EvictionHook:
    """Calls ``on_reuse(block_id, was_cached)`` for every block vLLM's pool takes out of
    its prefix cache or hands out again, while not :meth:`paused`."""

    def __init__(self, pool: Any, on_reuse: Callable[[int, bool], None]) -> None:
        original = getattr(pool, _ATTR, None)
        if not callable(original):
            raise TypeError(
                f"vLLM's block pool ({type(pool).__name__}) has no {_ATTR}: expected vLLM "
                "0.32's BlockPool (write_back needs to see its evictions)"
            )
        self._pool = pool
        self._original = original
        self._on_reuse = on_reuse
        self._paused = 0
        setattr(pool, _ATTR, self._evict)  # an instance attribute shadows the method

    def _evict(self, block: Any) -> bool:
        evicted = self._original(block)
        if not self._paused:
            self._on_reuse(block.block_id, bool(evicted))
        return evicted

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
        self._pool = None
