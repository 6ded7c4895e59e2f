"""What the scheduler half shows of itself (counters, occupancy, invariants), its reset
and its close.

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
    from hicache.integrations.vllm.scheduler.bad_pages import BadPages
    from hicache.integrations.vllm.scheduler.components import ComponentPages
    from hicache.integrations.vllm.scheduler.pins import StepPins
    from hicache.integrations.vllm.scheduler.prefetch import Prefetcher
    from hicache.integrations.vllm.scheduler.requests import RequestState
    from hicache.integrations.vllm.scheduler.saves import Saves
    from hicache.integrations.vllm.scheduler.stats import SchedulerStats
    from hicache.integrations.vllm.scheduler.third_tier import NoReads, StorageKeys, StorageProbe
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
    _probe: StorageProbe | NoReads | None
    storage: StorageBackend | None
    saves: Saves
    _bad: BadPages

    def _evict_host(self, num_tokens: int) -> None: ...  # the half's own

    def reset(self) -> bool:
        """Drop every cached host page (vLLM's ``reset_prefix_cache(reset_connector=True)``,
        which RL frameworks call after a weight update).

        With a third tier and ``storage_epoch_on_reset``, the tier's epoch is bumped too:
        pages stored before miss from now on, here and in every process that opens the
        tier afterwards (see docs/storage.md). Pages pinned by a step being planned (or by
        a save sent with the next plan) stay; returns False then, or when the tier could
        not be reached.
        """
        # Saves not sent yet (a finished request's last blocks, vLLM's hit copied in)
        # would keep their pages pinned, and the pages of the old weights cached.
        for op in self._early_saves + self._gap_saves:
            self._bad.update(op.host_pages)  # never filled: gone with the eviction below
        self._early_saves, self._gap_saves = [], []
        self.saves.forget_all()
        self.pins.unpin_all()
        if self.prefetch is not None:
            self.prefetch.reset()
        num = self.tree.host_tokens
        if num:  # evict_host counts page ids: component pages too (held only beside full ones)
            self._evict_host(num + (self.page_size * self.components.num_host_pages()
                                    if self.components is not None else 0))
        if self.components is not None:  # bad component pages just freed: forgotten
            self.components.mark_bad(())
        for st in self._reqs.values():
            st.num_checked_pages = 0
        ok = self.tree.host_tokens == 0
        self.tree.prune_namespaces()  # roots a lookup made and nothing filled
        if self.storage is not None and self.config.storage_epoch_on_reset:
            if not self._storage_keys.bump_epoch(self.storage):
                return False
            for st in self._reqs.values():
                st.keys = []  # rebuilt under the new epoch
        return ok

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
