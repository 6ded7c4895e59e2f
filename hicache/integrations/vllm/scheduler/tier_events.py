"""The third tier as vLLM KV cache events: ``BlockStored`` / ``BlockRemoved``, medium ``STORAGE``.

A block is announced stored in the third tier once *every* tensor-parallel rank's
write of its page landed (each rank stores its own shard; a page missing one shard
is no hit, see :mod:`~hicache.integrations.vllm.scheduler.third_tier`), with the same hash,
parent, tokens and keys as the host tier's announcement of that block
(:class:`~hicache.integrations.vllm.scheduler.kv_events.HostTierEvents`), medium
``"STORAGE"`` (vLLM's name for it). Each storage key is announced at most once, however
often it is written again (a repair, another request computing the same page).
When the tier is invalidated (``reset_prefix_cache(reset_connector=True)`` bumps its
epoch) every block announced is removed in one ``BlockRemoved``.

Not announced: pages evicted by the tier's own capacity policy, or written by other
engines (no engine sees those); a router learns the tier's content as this engine
wrote it. A write that failed, was cancelled or dropped on any rank is not announced.

The flow: the connector calls :meth:`StorageTierEvents.planned` with each step's saves
(keys and host pages), the workers report which keys they stored and which they did
not (:class:`~hicache.integrations.vllm.metadata.HiCacheWorkerMetadata`, summed over
ranks by vLLM), and :meth:`StorageTierEvents.written` announces the keys every rank
stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from hicache.integrations.vllm.common.plan import SaveOp
    from hicache.integrations.vllm.scheduler.kv_events import HostTierEvents


class StorageTierEvents:
    """Pending KV cache events of the third tier, and which key announced which hash."""

    def __init__(self, host: HostTierEvents, num_ranks: int, medium: str = MEDIUM_STORAGE):
        """``host``: the host tier's events, whose blocks the third tier's repeat;
        ``num_ranks``: the tensor-parallel ranks that each store a shard of a page."""
        self.host = host
        if host.blocks is None:
            host.blocks = {}  # keep each announced page's block for this tier's events
        self.num_ranks = num_ranks
        self.medium = medium
        self._pending: dict[str, tuple[BlockStored, set[int]]] = {}  # key -> (block, ranks done)
        # storage key -> (the block hash it announced, its KV cache group)
        self._announced: dict[str, tuple[Any, int | None]] = {}
        self._events: list[KVCacheEvent] = []

    def planned(self, saves: Iterable[SaveOp]) -> None:
        """This step's saves: the keys written behind them await every rank's write.
        A host page never announced (no block hash) is not announced here either."""
        blocks = self.host.blocks or {}
        for op in saves:
            for page, key in zip(op.host_pages, op.storage_keys, strict=False):
                block = blocks.get(int(page))
                if block is not None and key not in self._announced:
                    self._pending.setdefault(key, (block, set()))

    def written(self, written: Mapping[str, Iterable[int]], unwritten: Iterable[str]) -> None:
        """Workers' reports: the ranks ``written[key]`` stored the page; some rank did
        not store those ``unwritten`` (never announced, unless planned and written again)."""
        for key in unwritten:
            self._pending.pop(key, None)
        for key, ranks in written.items():
            entry = self._pending.get(key)
            if entry is None:
                continue
            block, done = entry
            done.update(ranks)
            if len(done) < self.num_ranks:
                continue
            del self._pending[key]
            self._announced[key] = (block.block_hashes[0], block.group_idx)
            self._events.append(msgspec.structs.replace(block, medium=self.medium))

    def invalidated(self) -> None:
        """The tier's epoch moved on: every page announced misses from now on."""
        groups: dict[int | None, list[Any]] = {}  # one BlockRemoved per KV cache group
        for block, group in self._announced.values():
            groups.setdefault(group, []).append(block)
        for group, blocks in groups.items():
            self._events.append(BlockRemoved(block_hashes=blocks, medium=self.medium,
                                             group_idx=group))
        self._announced.clear()
        self._pending.clear()

    @property
    def num_announced(self) -> int:
        return len(self._announced)

    @property
    def num_pending(self) -> int:
        """Keys planned whose writes have not all been reported."""
        return len(self._pending)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events
