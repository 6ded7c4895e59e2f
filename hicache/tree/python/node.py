"""One node of the Python radix tree, and how the tree keeps the page ids it is given.

A :class:`TreeNode` is one edge: a run of whole pages of token ids and where their
KV lives (device page ids, host page ids, or both), plus what orders and guards
their eviction (locks, IO status, access clock, hit count, priority). The node
holds no logic beyond reading itself: the tree changes nodes, and keeps the
counters derived from them (:mod:`hicache.tree.python.state`).

Page ids the tree keeps are its own: :func:`copy_pages` copies what a caller
hands in, :func:`own_pages` bounds what a split's slices keep alive.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from hicache.tree.guards import check_component, check_tier
from hicache.tree.types import IOStatus, Tier

# The page ids of a root (it holds no tokens), and an evict call that freed nothing.
EMPTY_PAGES = torch.empty(0, dtype=torch.int64)


def copy_pages(indices: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of page ids the tree keeps (it owns what it stores)."""
    return indices.clone(memory_format=torch.contiguous_format)


def own_pages(indices: torch.Tensor) -> torch.Tensor:
    """``indices``, or a copy when it is a view into storage more than twice its size.

    Callers hand the tree slices of larger tensors (a request's whole page table,
    one allocation split across nodes); keeping such a view would keep the whole
    storage alive for as long as the node lives. Bounded this way, the index
    storage the tree holds is at most twice the bytes of the page ids it caches.
    """
    if indices.untyped_storage().nbytes() > 2 * indices.nbytes:
        return indices.clone()
    return indices


class ComponentRecord:
    """One component's data on one node (docs/design.md, "Hybrid models: components").

    Its page ids in each tier (a window component: ``width`` ids per page of the
    node; a state component: ``width`` ids of the checkpoint at the node's end), and
    what orders its eviction: its own access time and hit count, refreshed only
    when a hit reads this data, and the tick it was first attached. The eviction
    policy's key reads it as it reads a node (``priority`` is the node's).
    """

    __slots__ = ("node", "device", "host", "last_access", "hit_count", "created",
                 "_dev_seq", "_host_seq", "_dev_children", "_host_children")

    def __init__(self, node: TreeNode) -> None:
        self.node = node
        self.device: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.last_access = 0  # tree clock tick of the last hit that read it (or its attach)
        self.hit_count = 0  # hits that read it
        self.created = 0  # tree clock tick it was attached at (in either tier)
        self._dev_seq = 0  # seq of its newest device-heap entry
        self._host_seq = 0  # seq of its newest host-heap entry
        # Children holding this component in each tier (kept for window components: a
        # child's hits read this node's window pages).
        self._dev_children = 0
        self._host_children = 0

    @property
    def priority(self) -> int:
        return self.node.priority


class TreeNode:
    """One edge of the radix tree: a run of whole pages and where their KV lives."""

    __slots__ = (
        "id", "key", "parent", "children", "namespace", "device_indices", "host_indices",
        "lock_ref", "host_lock_ref", "io_status", "hit_count", "last_access", "created",
        "priority", "_dev_seq", "_host_seq", "_end_hash", "_host_children", "_busy_children",
        "components",
    )

    def __init__(
        self, node_id: int, key: bytes, parent: TreeNode | None, namespace: str | None
    ) -> None:
        self.id = node_id
        self.key = key  # token ids as int32 bytes, a whole number of pages
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}  # keyed by the first page of the child's run
        self.namespace = namespace
        self.device_indices: torch.Tensor | None = None  # one device page id per page
        self.host_indices: torch.Tensor | None = None  # one host page id per page
        self.lock_ref = 0  # running requests using the device pages of this node
        self.host_lock_ref = 0  # loads / third-tier writes reading the host pages
        self.io_status = IOStatus.NONE
        self.hit_count = 0  # times a match went through this node
        self.last_access = 0  # tree clock tick of the last match or insert touching it
        self.created = 0  # tree clock tick of the insert that created it (a split keeps it)
        self.priority = 0  # largest priority a match or insert gave it (raise_priority)
        self._dev_seq = 0  # seq of this node's newest device-heap entry
        self._host_seq = 0  # seq of this node's newest host-heap entry
        self._end_hash: int | None = None  # chained hash of its last page (events), lazily
        # Children with a host copy: a host copy is a host-eviction candidate only
        # without them (evicting it first would leave a host copy under a node without
        # one, against the invariant that host copies are closed under ancestors).
        self._host_children = 0
        # Children whose host copy is "busy": host-locked, IO in flight, or above a
        # busy host child. Host eviction can never take a busy host copy.
        self._busy_children = 0
        # One record per component of the tree (hybrid models), None in a single-kind tree.
        self.components: list[ComponentRecord] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2

    def num_pages(self, page_size: int) -> int:
        return (len(self.key) >> 2) // page_size

    @property
    def on_device(self) -> bool:
        return self.device_indices is not None

    @property
    def on_host(self) -> bool:
        return self.host_indices is not None

    def tokens(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.key, dtype=np.int32)

    def component_pages(self, c: int, tier: Tier) -> torch.Tensor | None:
        """Component ``c``'s page ids in ``tier`` (docs/design.md, "Hybrid models"), or None."""
        check_tier(tier, "component_pages")
        check_component(c, 0 if self.components is None else len(self.components),
                        "component_pages")
        assert self.components is not None, "checked above"
        record = self.components[c]
        return record.device if tier == "device" else record.host

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, device={self.on_device}, "
            f"host={self.on_host}, lock={self.lock_ref}, host_lock={self.host_lock_ref}, "
            f"io={self.io_status.name})"
        )
