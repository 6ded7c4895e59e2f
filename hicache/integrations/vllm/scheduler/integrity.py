"""The scheduler half's invariants (:meth:`SchedulerHalf.check_integrity`, which every
test scenario calls): its tree holds host pages only, every host page in use is held
by the tree or by a prefetch, and every host lock is a pin someone holds."""

from __future__ import annotations

from typing import Any


def check_scheduler_half(half: Any) -> None:
    """Assert the invariants of ``half`` (a
    :class:`~hicache.integrations.vllm.scheduler.half.SchedulerHalf`; not imported: it
    imports this module)."""
    half.tree.check_integrity()
    half.host_allocator.check_integrity()
    P = half.page_size
    assert half.tree.device_tokens == 0, "the scheduler's tree must hold host pages only"
    fetch = half.prefetch
    fetching = fetch.num_held_pages if fetch is not None else 0
    assert half.host_allocator.num_used_pages == half.tree.host_tokens // P + fetching, (
        f"host pages: {half.host_allocator.num_used_pages} allocated, tree holds "
        f"{half.tree.host_tokens // P}, prefetches {fetching}: pages leaked or lost"
    )
    for node in half.tree.nodes():
        assert node.lock_ref == 0, f"node {node.id}: device lock in a host-only tree"
        pins = half.pins.count(node) + (fetch.num_pins(node) if fetch is not None else 0)
        assert node.host_lock_ref == pins, (
            f"node {node.id}: host_lock_ref {node.host_lock_ref}, pins {pins}: a pin leaked"
        )
