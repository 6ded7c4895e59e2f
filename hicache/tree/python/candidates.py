"""Which nodes may be evicted now, in each tier, and in what order.

A node is a *device candidate* when it is on the device, unlocked, has no IO in
flight and no child on the device (a device leaf). It is a *host candidate*
when it has a host copy, no host lock, no IO in flight and no child with a host
copy: host copies stay closed under ancestors, so a parent on both tiers whose
children are device-only is a candidate although it has children. Rank 0 goes
first: a host-only candidate (removed when evicted) before one also on the
device (only its host copy goes).

Candidates sit in one lazy heap per tier (:class:`hicache.tree.policies.CandidateHeap`,
keyed by the eviction policy): every operation that may make a node a candidate,
or change its key, calls :meth:`EvictionCandidates._refresh` on it, and stale
entries are skipped when popped. The contract: every candidate has a current
heap entry (``check_integrity`` verifies it).

Host eviction also needs to know what it can take without waiting: a host copy
is *busy* while host-locked, with IO in flight, or above a busy host copy.
:meth:`EvictionCandidates._host_changed` keeps the per-node counts of host and
busy children and ``host_takeable_tokens`` (the non-busy host tokens) exact.
"""

from __future__ import annotations

from hicache.tree.python.node import TreeNode
from hicache.tree.python.state import TreeState
from hicache.tree.types import IOStatus


class EvictionCandidates(TreeState):
    """Ranks nodes as eviction candidates and keeps their heap entries current."""

    def _device_rank(self, node: TreeNode) -> int | None:
        """0 if ``node`` may give up its device pages now (a device leaf, idle), else None."""
        if (
            node.device_indices is None
            or node.lock_ref
            or node.io_status is not IOStatus.NONE
            or node.parent is None
        ):
            return None
        for c in node.children.values():
            if c.device_indices is not None:
                return None
        return 0

    def _host_rank(self, node: TreeNode) -> int | None:
        """0: host-only leaf; 1: also on the device (drop only its host copy); else None.

        A candidate has a host copy, no host lock, no IO in flight and no child with
        a host copy (children only on the device do not hold it back; a host-only
        node's children all have host copies, so a host-only candidate is a leaf).
        """
        if (
            node.host_indices is None
            or node.host_lock_ref
            or node.io_status is not IOStatus.NONE
            or node._host_children
            or node.parent is None
        ):
            return None
        return 1 if node.device_indices is not None else 0

    def _refresh(self, node: TreeNode) -> None:
        """Give ``node`` a current heap entry in each tier where it is a candidate.

        Inlines :meth:`_device_rank` and :meth:`_host_rank`: this runs on every
        state change, and the early exits keep it cheap.
        """
        if node.io_status is not IOStatus.NONE or node.parent is None:
            return
        children = node.children
        if node.device_indices is not None and not node.lock_ref:
            for c in children.values():
                if c.device_indices is not None:
                    break
            else:
                self._device_heap.push(node, 0)
        if node.host_indices is not None and not node.host_lock_ref and not node._host_children:
            self._host_heap.push(node, 1 if node.device_indices is not None else 0)

    def _refresh_inner_host(self, node: TreeNode) -> None:
        """Re-key ``node``, a host candidate inside a path whose access time changed.

        A node on both tiers whose children are all device-only is a host
        candidate although it has children (see :meth:`_host_rank`).
        """
        if node.parent is not None and (rank := self._host_rank(node)) is not None:
            self._host_heap.push(node, rank)

    def _maybe_compact(self) -> None:
        """Rebuild the heaps once stale entries outnumber live nodes by far."""
        limit = 4 * self.num_nodes + 1024
        if len(self._device_heap) > limit or len(self._host_heap) > limit:
            self._compact()

    def _compact(self) -> None:
        nodes = list(self.nodes())
        self._device_heap.rebuild((n, r) for n in nodes if (r := self._device_rank(n)) is not None)
        self._host_heap.rebuild((n, r) for n in nodes if (r := self._host_rank(n)) is not None)

    # ------------------------------------------------------- host accounting
    @staticmethod
    def _host_busy(node: TreeNode) -> bool:
        """True if host eviction can never take ``node``'s host copy as things stand."""
        return node.host_indices is not None and bool(
            node.host_lock_ref or node.io_status is not IOStatus.NONE or node._busy_children
        )

    def _host_changed(self, node: TreeNode, was_on_host: bool, was_busy: bool) -> None:
        """Account a change of ``node``'s host copy, host lock or IO status.

        ``was_on_host`` / ``was_busy``: its state before. Keeps the parent's
        ``_host_children``, the ancestors' ``_busy_children`` and
        ``host_takeable_tokens`` exact; a parent left without host children is
        refreshed (it may have become a host-eviction candidate).
        """
        now_on_host = node.host_indices is not None
        now_busy = self._host_busy(node)
        if was_on_host and not was_busy:
            self.host_takeable_tokens -= node.num_tokens
        if now_on_host and not now_busy:
            self.host_takeable_tokens += node.num_tokens
        parent = node.parent
        if parent is None or parent.parent is None:
            return
        if was_on_host != now_on_host:
            parent._host_children += 1 if now_on_host else -1
            if not parent._host_children:
                self._refresh(parent)
        while was_busy != now_busy and parent.parent is not None:
            # A parent without a host copy is never busy: the walk stops there.
            was_busy = self._host_busy(parent)
            parent._busy_children += 1 if now_busy else -1
            now_busy = self._host_busy(parent)
            if parent.host_indices is not None and was_busy != now_busy:
                self.host_takeable_tokens += -parent.num_tokens if now_busy else parent.num_tokens
            parent = parent.parent
