"""check_integrity: every page, lock, pin and IO state of a cache accounted for.

The tree and the free lists check their own invariants; this adds what only the
cache sees: pages the tree holds plus pages requests and storage reads hold are
exactly the pages allocated; every lock belongs to a live request or a pin;
every host lock to a load or a storage write in flight; a node's IO state is set
exactly while a transfer is tracked on it; and a host copy implies host copies
of every ancestor (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hicache.tree import IOStatus

if TYPE_CHECKING:  # annotations only
    from hicache.cache.handle import PrefixHandle
    from hicache.cache.inflight import InFlightTable
    from hicache.cache.pins import Pins
    from hicache.memory import PageAllocator
    from hicache.transfer import TransferEngine
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike


def check_cache_integrity(
    tree: RadixTreeLike,
    device_allocator: PageAllocator,
    host_allocator: PageAllocator,
    transfers: TransferEngine,
    *,
    page_size: int,
    live: Iterable[PrefixHandle],
    pins: Pins,
    inflight: InFlightTable,
    num_prefetching_pages: int,
) -> None:
    """Raise AssertionError naming the first broken invariant (see the module docstring)."""
    tree.check_integrity()
    device_allocator.check_integrity()
    host_allocator.check_integrity()
    P = page_size
    owned = sum(h.num_owned_pages for h in live)
    owned += sum(h._components.num_pages for h in live if h._components is not None)
    # Component pages share the tiers' page space (docs/design.md, "Hybrid models").
    held = {tier: sum(tree.num_component_pages(c, tier) for c in range(len(tree.components)))
            for tier in ("device", "host")}
    assert device_allocator.num_used_pages == tree.device_tokens // P + held["device"] + owned, (
        f"device pages: {device_allocator.num_used_pages} allocated, tree holds "
        f"{tree.device_tokens // P} (and {held['device']} of components), requests own "
        f"{owned}: pages leaked or lost"
    )
    prefetching = num_prefetching_pages
    assert host_allocator.num_used_pages == tree.host_tokens // P + held["host"] + prefetching, (
        f"host pages: {host_allocator.num_used_pages} allocated, tree holds "
        f"{tree.host_tokens // P} (and {held['host']} of components), storage reads hold "
        f"{prefetching}: pages leaked or lost"
    )
    want_locks: dict[TreeNode, int] = {}
    want_host_locks: dict[TreeNode, int] = {}
    root_locks: dict[TreeNode, int] = {}  # requests that matched nothing lock the root
    for h in live:
        if h._lock_node.parent is None:
            root_locks[h._lock_node] = root_locks.get(h._lock_node, 0) + 1
        for node in tree.path_to(h._lock_node):
            want_locks[node] = want_locks.get(node, 0) + 1
    for ns in tree.namespaces():
        root = tree.root(ns)
        assert root.lock_ref == 1 + root_locks.pop(root, 0), (
            f"namespace {ns!r}: its root's lock_ref is {root.lock_ref}, expected 1 + the live "
            f"requests that lock the root itself: a root lock leaked"
        )
        # (a namespace that holds nothing is freed: docs/design.md, "Namespaces")
        assert ns is None or root.children or root.lock_ref > 1, (
            f"namespace {ns!r} holds no node and no request locks its root, but its root "
            f"was not freed"
        )
    assert not root_locks, "a live request locks the root of a namespace that was freed"
    pins.check(want_locks)
    for rec in inflight.records.values():
        if rec.kind == "load":
            for node in rec.nodes:
                want_host_locks[node] = want_host_locks.get(node, 0) + 1
    for node in inflight.storage_pins:
        want_host_locks[node] = want_host_locks.get(node, 0) + 1
    for node in tree.nodes():
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
        in_flight = node in inflight.by_node
        assert in_flight == (node.io_status is not IOStatus.NONE), (
            f"node {node.id}: io_status {node.io_status.name} but tracked={in_flight}"
        )
    assert inflight.num_transfers == transfers.num_in_flight, (
        f"{inflight.num_transfers} transfers tracked, engine has {transfers.num_in_flight}"
    )
