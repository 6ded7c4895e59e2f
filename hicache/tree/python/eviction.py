"""Eviction: giving up a tier's pages, in the order the eviction policy sets.

``evict_device(n)`` and ``evict_host(n)`` free pages of at least ``n`` tokens
(rounded up to pages) when the tree has that many candidates
(:mod:`hicache.tree.python.candidates` says which nodes are and in what order;
:mod:`hicache.tree.policies` the order of each policy). Running out is a normal
return: the result says how many tokens were freed, and the caller frees the
returned page ids.

* A device candidate with a host copy becomes host-only (its chain of idle
  host-only nodes is merged into one node); one without a host copy is removed
  when it is a leaf, else offered to the ``backup`` hook (write-back).
* A host candidate that is host-only is removed; one also on the device only
  loses its host copy (unless ``drop_device_resident`` is False).
* A candidate larger than what is still needed is split, and only its tail goes.

A hook that raises ends the call with the tree consistent (every skipped node
keeps its heap entry).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache.checks import check_int
from hicache.tree.python.core import PrefixIndex
from hicache.tree.python.node import EMPTY_PAGES, TreeNode
from hicache.tree.types import EvictResult, IOStatus


class EvictTally:
    """What one eviction call has given up so far: pages, counts, skipped nodes."""

    __slots__ = ("freed", "num_freed", "num_backup", "skipped")

    def __init__(self) -> None:
        self.freed: list[torch.Tensor] = []  # page ids given up, in eviction order
        self.num_freed = 0  # full-attention tokens whose pages were given up
        self.num_backup = 0  # tokens handed to the backup hook
        self.skipped: list[TreeNode] = []  # candidates passed over (pushed back at the end)

    def result(self) -> EvictResult:
        freed = self.freed
        pages = torch.cat(freed) if len(freed) > 1 else (freed[0] if freed else EMPTY_PAGES)
        return EvictResult(pages, self.num_freed, self.num_backup)


class Eviction(PrefixIndex):
    """``evict_device`` and ``evict_host``, and the node removal and merging they do."""

    def evict_device(
        self,
        num_tokens: int,
        backup: Callable[[TreeNode], bool] | None = None,
    ) -> EvictResult:
        """Give up device pages of at least ``num_tokens`` tokens (rounded up to pages) if possible.

        Unlocked device leaves go in eviction-policy order; nodes with IO in flight
        are skipped. A node with a host copy becomes host-only; a node without one
        is removed if it has no children, else it is offered to ``backup`` (write-back:
        the hook starts a backup and returns True; its pages are freed when the
        backup completes) and skipped if there is no hook or it declines. A leaf
        larger than what is still needed is split, and only its tail is evicted.
        """
        need = -(-check_int("num_tokens", num_tokens) // self.page_size)
        self._refuse_reentry("evict_device")
        tally = EvictTally()
        node = None
        try:
            while need > 0:
                node = self._device_heap.pop(self._device_rank)
                if node is None:
                    break
                need -= self._evict_device_node(node, need, backup, tally)
        except BaseException:
            self._after_failed_eviction(tally, node)
            raise
        for node in tally.skipped:
            self._device_heap.push(node)
        self._maybe_compact()
        return tally.result()

    def _evict_device_node(
        self,
        node: TreeNode,
        need: int,
        backup: Callable[[TreeNode], bool] | None,
        tally: EvictTally,
    ) -> int:
        """Evict device candidate ``node`` (its tail if it is larger than ``need`` pages).

        Returns the pages it counts against ``need`` (0 when skipped).
        """
        if node.host_indices is None and node.children and backup is None:
            tally.skipped.append(node)
            return 0
        num_pages = len(node.key) // self._key_nbytes_per_page
        if num_pages > need:
            self._split(node, num_pages - need)
            num_pages = need
        pages = node.device_indices
        parent = node.parent
        assert pages is not None and parent is not None, "a device candidate is a non-root device node"
        if node.host_indices is not None:
            if self._events is not None:
                self._log(False, "device", node)
            tally.freed.append(pages)
            node.device_indices = None
            self.device_evictable_tokens -= node.num_tokens
            tally.num_freed += node.num_tokens
            if self._has_components:
                num_pages += self._drop_into(node, "device", tally)
            self._merge_host_chain(node)
            self._refresh(node)
            self._refresh(parent)
        elif backup is not None and self._call_backup(backup, node):
            tally.num_backup += node.num_tokens
        elif (
            not node.children
            and node.host_indices is None
            and node.io_status is IOStatus.NONE
            and node.parent is not None
        ):
            # (A backup hook that declined may have given the node a host
            # copy or IO in flight: then it is skipped like a node with children.)
            if self._events is not None:
                self._log(False, "device", node)
            tally.freed.append(pages)
            self.device_evictable_tokens -= node.num_tokens
            tally.num_freed += node.num_tokens
            node.device_indices = None
            if self._has_components:
                num_pages += self._drop_into(node, "device", tally)
            self._remove(node)
        else:
            tally.skipped.append(node)
            return 0
        return num_pages

    def _drop_into(self, node: TreeNode, tier: str, tally: EvictTally) -> int:
        """Cascade: ``node`` lost its full copy in ``tier``; its component data goes too."""
        pages = self._drop_components(node, tier)
        if pages is None:
            return 0
        tally.freed.append(pages)
        return pages.shape[0]

    def _after_failed_eviction(self, tally: EvictTally, node: TreeNode | None) -> None:
        """A hook raised: the node it was running for and the skipped ones get
        their heap entries back, so the tree stays consistent."""
        for n in tally.skipped:
            self._refresh(n)
        if node is not None and node.parent is not None:
            self._refresh(node)

    def _call_backup(self, backup: Callable[[TreeNode], bool], node: TreeNode) -> bool:
        outer, self._hook = self._hook, "backup"
        try:
            return bool(backup(node))
        finally:
            self._hook = outer

    def evict_host(self, num_tokens: int, drop_device_resident: bool = True) -> EvictResult:
        """Give up host pages of at least ``num_tokens`` tokens if possible; return them.

        Host-only leaves go first (removed from the tree), in eviction-policy order;
        then, if ``drop_device_resident``, leaves also on the device lose their host
        copy. Host-locked nodes and nodes with IO in flight are skipped.
        """
        need = -(-check_int("num_tokens", num_tokens) // self.page_size)
        self._refuse_reentry("evict_host", backup_may=True)
        tally = EvictTally()
        while need > 0:
            node = self._host_heap.pop(self._host_rank)
            if node is None:
                break
            if node.device_indices is not None and not drop_device_resident:
                self._host_heap.push(node, 1)
                break
            need -= self._evict_host_node(node, need, tally)
        return tally.result()

    def _evict_host_node(self, node: TreeNode, need: int, tally: EvictTally) -> int:
        """Evict host candidate ``node`` (its tail if larger than ``need`` pages); pages counted."""
        num_pages = len(node.key) // self._key_nbytes_per_page
        if num_pages > need:
            try:
                self._split(node, num_pages - need)
            except BaseException:
                self._refresh(node)  # an on_split hook raised: node keeps its heap entry
                raise
            num_pages = need
        if self._events is not None:
            self._log(False, "host", node)
        assert node.host_indices is not None, "a host candidate has a host copy"
        tally.freed.append(node.host_indices)
        node.host_indices = None
        self.host_evictable_tokens -= node.num_tokens
        self._host_changed(node, True, False)  # a candidate is never busy
        tally.num_freed += node.num_tokens
        if self._has_components:
            num_pages += self._drop_into(node, "host", tally)
        if node.device_indices is None:
            self._remove(node)
        else:
            self._refresh(node)
        return num_pages

    def _merge_host_chain(self, node: TreeNode) -> None:
        """Absorb ``node``'s only child when both are idle and host-only.

        Leaf-first eviction turns a chain (one node per turn of a conversation)
        into host-only nodes one by one; merging them keeps a reload of the chain
        one node instead of dozens. Nothing references an idle host-only node
        (no lock, no pin, no IO), so the absorbed child just goes stale.
        """
        if (
            node.device_indices is not None
            or node.host_lock_ref
            or node.io_status is not IOStatus.NONE
            or len(node.children) != 1
        ):
            return
        (child,) = node.children.values()
        if (
            child.device_indices is not None
            or child.host_lock_ref
            or child.io_status is not IOStatus.NONE
        ):
            return
        node.key += child.key
        node._end_hash = child._end_hash  # node now ends where child ended
        assert node.host_indices is not None and child.host_indices is not None, "host-only"
        node.host_indices = torch.cat((node.host_indices, child.host_indices))
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        # Both idle and host-only: node was busy exactly when child was.
        node._host_children = child._host_children
        node._busy_children = child._busy_children
        node.hit_count = max(node.hit_count, child.hit_count)
        node.last_access = max(node.last_access, child.last_access)
        node.created = min(node.created, child.created)
        node.priority = max(node.priority, child.priority)
        child.parent = None
        child.children = {}
        self.num_nodes -= 1

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None, "removal of a root"
        del parent.children[node.key[: self._key_nbytes_per_page]]
        node.parent = None
        self.num_nodes -= 1
        self._refresh(parent)
        if parent.parent is None:  # a namespace left empty: its root goes
            self._free_if_empty(parent)
