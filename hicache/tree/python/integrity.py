"""The Python radix tree's invariants, checked one by one (``check_integrity``).

What must hold after every public call, whatever happened (a hook that raised
included), and what the check asserts, naming the first node that violates it:

* structure: each node is keyed in its parent by its first page, its key is
  whole pages, its namespace is its parent's; each root is its namespace's;
* copies: each page-id tensor is 1-D int64 with one id per page; every non-root
  node has a copy somewhere; device-resident nodes form a connected subtree
  from the root; no page id is held twice in a tier;
* locks: no negative count; a locked node is on the device and its parent is
  locked at least as often; a node with IO in flight has both copies;
* counters: ``num_nodes``, the four evictable/protected token counts,
  ``host_takeable_tokens`` and each node's counts of host and busy children
  equal the sums over nodes;
* eviction: every candidate of either tier has a current heap entry.

It is O(nodes) and meant for tests: every test scenario ends by calling it, and
the differential tests call it on both trees.
"""

from __future__ import annotations

import torch

from hicache.tree.python.candidates import EvictionCandidates
from hicache.tree.types import IOStatus


class IntegrityCheck(EvictionCandidates):
    """``check_integrity``: raise ``AssertionError`` naming the first broken invariant."""

    def check_integrity(self) -> None:
        """Verify every invariant; raise ``AssertionError`` naming the first violation."""
        pnb = self._key_nbytes_per_page
        sums = {"dev_ev": 0, "dev_pr": 0, "host_ev": 0, "host_pr": 0, "host_take": 0}
        dev_pages: list[torch.Tensor] = []
        host_pages: list[torch.Tensor] = []
        dev_live = self._device_heap.live_priorities()
        host_live = self._host_heap.live_priorities()
        count = 0
        for ns, root in self._roots.items():
            assert root.namespace == ns and root.parent is None and root.lock_ref >= 1, (
                f"root of namespace {ns!r} corrupted"
            )
        for node in self.nodes():
            count += 1
            where = f"node {node.id} ({node.namespace!r})"
            parent = node.parent
            assert parent is not None, f"{where}: a non-root node without a parent"
            assert len(node.key) > 0 and len(node.key) % pnb == 0, f"{where}: key not whole pages"
            assert parent.children.get(node.key[:pnb]) is node, f"{where}: not keyed by first page"
            assert node.namespace == parent.namespace, f"{where}: namespace differs from parent"
            num_pages = len(node.key) // pnb
            for name in ("device_indices", "host_indices"):
                idx = getattr(node, name)
                if idx is not None:
                    assert idx.dtype == torch.int64 and idx.dim() == 1, f"{where}: {name} not int64"
                    assert len(idx) == num_pages, (
                        f"{where}: {name} has {len(idx)} entries for {num_pages} pages"
                    )
            assert node.on_device or node.on_host, f"{where}: no copy in any tier"
            if node.device_indices is not None:
                assert parent.on_device, f"{where}: on the device but its parent is not"
                dev_pages.append(node.device_indices)
                sums["dev_pr" if node.lock_ref else "dev_ev"] += node.num_tokens
            if node.host_indices is not None:
                host_pages.append(node.host_indices)
                sums["host_pr" if node.host_lock_ref else "host_ev"] += node.num_tokens
                if not self._host_busy(node):
                    sums["host_take"] += node.num_tokens
            kids = node.children.values()
            num_host = sum(c.host_indices is not None for c in kids)
            assert node._host_children == num_host, (
                f"{where}: counts {node._host_children} children with a host copy, has {num_host}"
            )
            num_busy = sum(self._host_busy(c) for c in kids)
            assert node._busy_children == num_busy, (
                f"{where}: counts {node._busy_children} busy host children, has {num_busy}"
            )
            assert node.lock_ref >= 0 and node.host_lock_ref >= 0, f"{where}: negative lock"
            assert node.lock_ref == 0 or node.on_device, f"{where}: locked but not on the device"
            if parent.parent is not None:
                assert parent.lock_ref >= node.lock_ref, f"{where}: locked more than its parent"
            if node.io_status is not IOStatus.NONE:
                assert node.on_device and node.on_host, f"{where}: IO in flight without both copies"
            for heap, live, rank_fn, tier in (
                (self._device_heap, dev_live, self._device_rank, "device"),
                (self._host_heap, host_live, self._host_rank, "host"),
            ):
                rank = rank_fn(node)
                seq = node._dev_seq if tier == "device" else node._host_seq
                if rank is not None:
                    assert live.get(seq) == heap.expected_priority(node, rank), (
                        f"{where}: {tier} eviction candidate without a current heap entry"
                    )
        assert count == self.num_nodes, f"num_nodes is {self.num_nodes}, tree has {count}"
        for name, key in (
            ("device_evictable_tokens", "dev_ev"),
            ("device_protected_tokens", "dev_pr"),
            ("host_evictable_tokens", "host_ev"),
            ("host_protected_tokens", "host_pr"),
            ("host_takeable_tokens", "host_take"),
        ):
            assert getattr(self, name) == sums[key], (
                f"{name} is {getattr(self, name)}, nodes sum to {sums[key]}"
            )
        for tier, pages in (("device", dev_pages), ("host", host_pages)):
            if pages:
                allp = torch.cat(pages)
                assert len(torch.unique(allp)) == len(allp), f"a {tier} page is held twice"
