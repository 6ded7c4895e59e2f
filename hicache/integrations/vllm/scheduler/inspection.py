"""What the scheduler half shows of itself (counters, occupancy, invariants), and its close.

:class:`HalfInspection` is a part of :class:`~hicache.integrations.vllm.scheduler.half.SchedulerHalf`
(a mixin over its state, declared below), kept here so that the half's module reads
as the lifecycle of a request.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.integrations.vllm.common.config import ConnectorConfig
    from hicache.integrations.vllm.common.plan import SaveOp
    from hicache.integrations.vllm.scheduler.components import ComponentPages
    from hicache.integrations.vllm.scheduler.pins import StepPins
    from hicache.integrations.vllm.scheduler.prefetch import Prefetcher
    from hicache.integrations.vllm.scheduler.requests import RequestState
    from hicache.integrations.vllm.scheduler.stats import SchedulerStats
    from hicache.integrations.vllm.scheduler.third_tier import (
        NoReads,
        StorageKeys,
        StorageProbe,
    )
    from hicache.memory import PageAllocator
    from hicache.storage import StorageBackend
    from hicache.tree.protocol import RadixTreeLike


class HalfInspection:
    """The inspection part of the scheduler half's state and methods."""

    config: ConnectorConfig
    page_size: int
    tree: RadixTreeLike
    host_allocator: PageAllocator
    components: ComponentPages | None
    counters: SchedulerStats
    pins: StepPins
    prefetch: Prefetcher | None
    _reqs: dict[str, RequestState]
    _early_saves: list[SaveOp]
    _gap_saves: list[SaveOp]
    _storage_keys: StorageKeys
    _probe: StorageProbe | NoReads | None  # NoReads: a kv_producer's
    storage: StorageBackend | None

    def close(self) -> None:
        """Stop the storage probe's thread and close the backend (idempotent)."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    @property
    def epoch(self) -> int:
        """The third tier's epoch that storage keys are salted with (bumped by reset)."""
        return self._storage_keys.epoch

    @property
    def num_live_requests(self) -> int:
        return len(self._reqs)

    @property
    def has_unsent_saves(self) -> bool:
        """Saves planned that go out with the next plan (a finished request's last blocks)."""
        return bool(self._early_saves or self._gap_saves)

    def stats(self) -> dict:
        s = asdict(self.counters)
        s["host_pages_used"] = self.host_allocator.num_used_pages
        s["host_pages_free"] = self.host_allocator.num_free_pages
        s["host_cached_tokens"] = self.tree.host_tokens
        if self.components is not None:
            s.update(self.components.occupancy())
        return s

    def check_integrity(self) -> None:
        """Tree invariants; every host page in use is held by the tree; locks = pins."""
        self.tree.check_integrity()
        self.host_allocator.check_integrity()
        P = self.page_size
        assert self.tree.device_tokens == 0, "the scheduler's tree must hold host pages only"
        fetch = self.prefetch
        fetching = fetch.num_held_pages if fetch is not None else 0
        held = self.tree.host_tokens // P + (
            self.components.num_host_pages() if self.components is not None else 0)
        assert self.host_allocator.num_used_pages == held + fetching, (
            f"host pages: {self.host_allocator.num_used_pages} allocated, tree holds "
            f"{held}, prefetches {fetching}: pages leaked or lost"
        )
        for node in self.tree.nodes():
            assert node.lock_ref == 0, f"node {node.id}: device lock in a host-only tree"
            pins = self.pins.count(node) + (fetch.num_pins(node) if fetch is not None else 0)
            assert node.host_lock_ref == pins, (
                f"node {node.id}: host_lock_ref {node.host_lock_ref}, pins {pins}: a pin leaked"
            )
