"""The in-flight IO table: which transfers and storage writes are running, and on what.

Every transfer the cache starts (a load, a backup) gets an :class:`InFlightIO`
record naming the tree nodes whose pages it reads or writes and the requests
waiting on it (the record is defined next to :class:`PrefixHandle` in handle.py,
since a handle lists the loads it waits on: this module imports that one, never
the other way round); every storage write host-pins the nodes it reads. The table
answers "is IO in flight on this node?" (eviction and the takeable-page checks
ask it) and keeps those answers true when the tree splits a node in flight: a
split hook, installed only while something is tracked, adds the new prefix node
to whatever tracks its suffix. It starts and applies nothing itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.cache.handle import InFlightIO, PrefixHandle

if TYPE_CHECKING:  # annotations only
    from hicache.storage.worker import StorageJob
    from hicache.transfer.base import Transfer
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike

__all__ = ["InFlightIO", "InFlightTable", "node_depth"]  # InFlightIO: see handle.py


class InFlightTable:
    """Transfers and storage writes in flight, by transfer and by tree node."""

    def __init__(self, tree: RadixTreeLike) -> None:
        self._tree = tree
        self.records: dict[int, InFlightIO] = {}  # id(transfer handle) -> record
        self.by_node: dict[TreeNode, InFlightIO] = {}  # nodes with a transfer in flight
        self.storage_pins: dict[TreeNode, StorageJob] = {}  # host-pinned by a storage write (job)
        self.num_loading_nodes = 0  # nodes a load is writing (0: no path needs a check)

    @property
    def num_transfers(self) -> int:
        return len(self.records)

    def track(self, rec: InFlightIO) -> None:
        """Start tracking a transfer that was just submitted."""
        self._watch_splits()
        self.records[id(rec.handle)] = rec
        for node in rec.nodes:
            self.by_node[node] = rec
        if rec.kind == "load":
            self.num_loading_nodes += len(rec.nodes)

    def pop(self, handle: Transfer) -> InFlightIO:
        """Stop tracking the finished transfer ``handle``; return its record."""
        rec = self.records.pop(id(handle))
        for node in rec.nodes:
            del self.by_node[node]
        if rec.kind == "load":
            self.num_loading_nodes -= len(rec.nodes)
        return rec

    def is_tracked(self, handle: Transfer) -> bool:
        return id(handle) in self.records

    def pin_for_storage(self, nodes: list[TreeNode], job: StorageJob) -> None:
        """Track ``nodes`` as read by the storage write ``job`` (the caller host-locks them)."""
        self._watch_splits()
        for node in nodes:
            self.storage_pins[node] = job

    def unpin_storage(self, node: TreeNode) -> None:
        del self.storage_pins[node]

    def storage_writes(self) -> set[StorageJob]:
        """The storage write jobs in flight."""
        return set(self.storage_pins.values())

    def unwatch_if_idle(self) -> None:
        """Remove the split hook once nothing is tracked any more."""
        if not self.by_node and not self.storage_pins and self._tree.on_split is not None:
            self._tree.on_split = None

    def wait_for_loads_on_path(self, h: PrefixHandle, node: TreeNode) -> None:
        """Make ``h`` wait for every load in flight on ``node``'s path."""
        while node.parent is not None:
            rec = self.by_node.get(node)
            if rec is not None and rec.kind == "load" and rec not in h._loads:
                h._loads.append(rec)
                rec.requests.append(h)
            node = node.parent

    def _watch_splits(self) -> None:
        """Follow splits (``_on_split``) while a node is tracked by a transfer or a pin.

        Installed on demand: with nothing tracked a split needs no bookkeeping, and
        the native tree would otherwise call into Python on every split (most
        evictions split a leaf). :meth:`unwatch_if_idle` removes it.
        """
        if self._tree.on_split is None:
            self._tree.on_split = self._on_split

    def _on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        job = self.storage_pins.get(suffix)
        if job is not None:
            job.nodes.append(prefix)
            self.storage_pins[prefix] = job
        rec = self.by_node.get(suffix)
        if rec is not None:
            rec.nodes.append(prefix)
            self.by_node[prefix] = rec
            if rec.kind == "load":
                self.num_loading_nodes += 1
            elif rec.evict is not None and suffix in rec.evict:
                rec.evict.append(prefix)
            if rec.parts is not None and suffix in rec.parts:
                rec.parts[prefix] = rec.parts[suffix]


def node_depth(node: TreeNode) -> int:
    """Edges from the root to ``node``: orders a record's nodes root side first."""
    depth = 0
    while node.parent is not None:
        depth += 1
        node = node.parent
    return depth
