"""Locks, IO status and the copies of a node's pages: what each tier holds, and who uses it.

The operations a cache runs around its transfers, all on one node:

* ``lock``/``unlock``: a running request uses the device pages of a node and of
  all its ancestors (one reference each); a locked node is never device-evicted.
* ``host_lock``/``host_unlock``: a load or a third-tier write reads the node's
  host pages; a host-locked copy is never host-evicted.
* ``set_io_status``: a copy between the tiers is in flight (both copies must
  exist); such a node is evicted from neither tier.
* ``attach_device``/``detach_device``, ``attach_host``/``detach_host``: a node
  gains or loses the copy in one tier (a load's target, a backup's target, a
  copy dropped); the tree copies the page ids it is given and returns the ones
  it gives up, for the caller to free.
* ``raise_priority``: the priority eviction policy's key, raised along a path.

Every call checks the node is live and that no hook forbids it, then keeps the
size counters, the host accounting and the eviction candidates exact
(:mod:`hicache.tree.python.candidates`) and logs KV events
(:mod:`hicache.tree.python.kv_events`). Bad calls raise ``ValueError`` before
changing anything.
"""

from __future__ import annotations

import torch

from hicache.checks import check_page_tensor, check_priority
from hicache.config import EvictionPolicy
from hicache.tree.python.candidates import EvictionCandidates
from hicache.tree.python.kv_events import EventLog
from hicache.tree.python.node import TreeNode, copy_pages
from hicache.tree.types import IOStatus


class TierMembership(EvictionCandidates, EventLog):
    """Locks, host locks, IO status, and attaching or detaching a node's copy in a tier."""

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from device eviction (one reference each)."""
        self._check_live(node, "lock")
        if self._hook is not None:
            self._refuse_reentry("lock")
        if node.device_indices is None:
            raise ValueError(f"lock: expected a device-resident node, got {node}")
        if node.parent is None:  # a root: the lock holds its namespace (state.py)
            node.lock_ref += 1
            return
        while node.parent is not None:
            if node.lock_ref == 0:
                self.device_evictable_tokens -= node.num_tokens
                self.device_protected_tokens += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Drop one reference taken by :meth:`lock` on ``node``'s path."""
        self._check_live(node, "unlock")
        if self._hook is not None:
            self._refuse_reentry("unlock")
        if node.parent is None:  # a root: its last lock may free it (state.py)
            if node.lock_ref > 1:
                node.lock_ref -= 1
                self._free_if_empty(node)
            return
        walk = node
        while walk.parent is not None:
            if walk.lock_ref <= 0:
                raise ValueError(f"unlock: node {walk.id} on the path is not locked")
            walk = walk.parent
        deepest = node
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                num = len(node.key) >> 2
                self.device_protected_tokens -= num
                self.device_evictable_tokens += num
            node = node.parent
        # Ancestors have a device child on the path: only the deepest can be a candidate.
        self._refresh(deepest)

    def host_lock(self, node: TreeNode) -> None:
        """Protect the host copy of ``node`` (a load or a third-tier write reads it)."""
        self._check_live(node, "host_lock")
        self._refuse_reentry("host_lock", backup_may=True)
        if node.host_indices is None or node.parent is None:
            raise ValueError(f"host_lock: expected a non-root node with a host copy, got {node}")
        was_busy = self._host_busy(node)
        if node.host_lock_ref == 0:
            self.host_evictable_tokens -= node.num_tokens
            self.host_protected_tokens += node.num_tokens
        node.host_lock_ref += 1
        self._host_changed(node, True, was_busy)

    def host_unlock(self, node: TreeNode) -> None:
        self._check_live(node, "host_unlock")
        self._refuse_reentry("host_unlock", backup_may=True)
        if node.host_lock_ref <= 0:
            raise ValueError(f"host_unlock: node {node.id} is not host-locked")
        was_busy = self._host_busy(node)
        node.host_lock_ref -= 1
        if node.host_lock_ref == 0:
            self.host_protected_tokens -= node.num_tokens
            self.host_evictable_tokens += node.num_tokens
            self._host_changed(node, True, was_busy)
            self._refresh(node)

    def raise_priority(self, node: TreeNode, priority: int) -> None:
        """Raise the priority of ``node`` and its ancestors to at least ``priority``.

        A node's priority only grows: a prefix shared by requests of different
        priorities keeps the highest. It orders eviction only under the
        ``priority`` policy (lowest first, least recent among equals).
        """
        priority = check_priority(priority)
        self._check_live(node, "raise_priority")
        self._refuse_reentry("raise_priority")
        refresh = self.eviction is EvictionPolicy.PRIORITY
        while node.parent is not None:
            if node.priority < priority:
                node.priority = priority
                if refresh:  # its heap entry's key changed
                    self._refresh(node)
            node = node.parent

    # ------------------------------------------------- IO status and copies
    def set_io_status(self, node: TreeNode, status: IOStatus) -> None:
        if not isinstance(status, IOStatus):
            raise TypeError(f"set_io_status: expected an IOStatus, got {type(status).__name__}")
        self._check_live(node, "set_io_status")
        self._refuse_reentry("set_io_status", backup_may=True)
        if status is not IOStatus.NONE and (node.device_indices is None or node.host_indices is None):
            raise ValueError(f"set_io_status: IO in flight needs both copies, got {node}")
        was_busy = self._host_busy(node)
        node.io_status = status
        self._host_changed(node, node.host_indices is not None, was_busy)
        if status is IOStatus.NONE:
            self._refresh(node)

    def attach_device(self, node: TreeNode, device_indices: torch.Tensor) -> None:
        """Give a host-only node device pages (a load target, or adopted on insert)."""
        self._check_live(node, "attach_device")
        check_page_tensor("device_indices", device_indices)
        self._refuse_reentry("attach_device")
        if node.device_indices is not None or node.parent is None:
            raise ValueError(f"attach_device: expected a host-only node, got {node}")
        if node.parent.device_indices is None:
            raise ValueError("attach_device: the parent must be on the device first")
        num_pages = len(node.key) // self._key_nbytes_per_page
        if device_indices.shape[0] != num_pages:
            raise ValueError(
                f"attach_device: expected {num_pages} pages, got {device_indices.shape[0]}"
            )
        node.device_indices = copy_pages(device_indices)
        self.device_evictable_tokens += node.num_tokens
        if self._events is not None:
            self._log(True, "device", node)
        self._refresh(node)

    def detach_device(self, node: TreeNode) -> torch.Tensor:
        """Drop the device copy of an unlocked node that has a host copy; return its pages."""
        self._check_live(node, "detach_device")
        self._refuse_reentry("detach_device")
        if node.device_indices is None or node.host_indices is None or node.lock_ref:
            raise ValueError(f"detach_device: expected an unlocked node on both tiers, got {node}")
        if any(c.device_indices is not None for c in node.children.values()):
            raise ValueError("detach_device: a child is still on the device")
        if self._events is not None:
            self._log(False, "device", node)
        pages = node.device_indices
        node.device_indices = None
        was_busy = self._host_busy(node)
        node.io_status = IOStatus.NONE
        self._host_changed(node, True, was_busy)
        self.device_evictable_tokens -= node.num_tokens
        parent = node.parent
        assert parent is not None, "detach_device: a root is always locked"
        self._refresh(node)
        self._refresh(parent)
        return pages

    def attach_host(self, node: TreeNode, host_indices: torch.Tensor) -> None:
        """Record the host copy of a device node (a backup target)."""
        self._check_live(node, "attach_host")
        check_page_tensor("host_indices", host_indices)
        self._refuse_reentry("attach_host", backup_may=True)
        if node.device_indices is None or node.host_indices is not None or node.parent is None:
            raise ValueError(f"attach_host: expected a device-only node, got {node}")
        num_pages = len(node.key) // self._key_nbytes_per_page
        if host_indices.shape[0] != num_pages:
            raise ValueError(f"attach_host: expected {num_pages} pages, got {host_indices.shape[0]}")
        node.host_indices = copy_pages(host_indices)
        self.host_evictable_tokens += node.num_tokens
        self._host_changed(node, False, False)
        if self._events is not None:
            self._log(True, "host", node)
        self._refresh(node)

    def detach_host(self, node: TreeNode) -> torch.Tensor:
        """Drop the host copy of a node that stays on the device; return its host pages."""
        self._check_live(node, "detach_host")
        self._refuse_reentry("detach_host")
        if node.host_indices is None or node.device_indices is None or node.host_lock_ref:
            raise ValueError(f"detach_host: expected a node on both tiers, host-unlocked, got {node}")
        if self._events is not None:
            self._log(False, "host", node)
        was_busy = self._host_busy(node)
        pages = node.host_indices
        node.host_indices = None
        node.io_status = IOStatus.NONE
        self.host_evictable_tokens -= node.num_tokens
        self._host_changed(node, True, was_busy)
        self._refresh(node)
        return pages
