"""Component records of the hybrid tree: their data, counters, heap entries and ranks.

Every node of a :class:`hicache.tree.python.hybrid.HybridRadixTree` (roots
included) holds one :class:`~hicache.tree.python.node.ComponentRecord` per
component. :class:`HybridRecords` owns what the other hybrid parts share:

* :meth:`HybridRecords._set_data`, the one place a record's data in a tier
  changes: it keeps the per-component page counts, the evictable and takeable
  component counters, the parents' counts of children holding a window
  component, and pushes the heap entries whose rank the change may move;
* candidacy and rank (:meth:`HybridRecords._record_rank`): component data on a
  node with no IO in flight, unlocked in its tier, is an eviction candidate of
  that component's heap in that tier; rank ``-1`` (first to go) when no hit can
  use it as far as the node and its neighbours show, else the rank a full-attention
  candidate of the tier has (device 0; host 0 host-only, 1 also on the device);
* splits (component data divided by the kinds' hooks), the cascade that takes a
  node's component data with its full copy, and a hit's access stamps.

The kinds' own rules are :mod:`hicache.tree.python.kind_window` and
:mod:`hicache.tree.python.kind_state`; contracts: docs/design.md, "Hybrid models:
components".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicache.components import ComponentSpec, check_components
from hicache.config import EvictionPolicy
from hicache.tree.guards import check_component, check_tier
from hicache.tree.policies import CandidateHeap, priority_fn
from hicache.tree.python.kind_state import StateLogic
from hicache.tree.python.kind_window import WindowLogic
from hicache.tree.python.kinds import KindLogic
from hicache.tree.python.node import ComponentRecord, TreeNode, own_pages
from hicache.tree.python.tree import RadixTree
from hicache.tree.types import TIERS, IOStatus, Tier


def kind_logic(spec: ComponentSpec, page_size: int) -> KindLogic:
    """The hooks of ``spec``'s kind."""
    return WindowLogic(spec, page_size) if spec.is_window else StateLogic(spec, page_size)


def data_of(record: ComponentRecord, tier: str) -> torch.Tensor | None:
    """A record's page ids in ``tier``."""
    return record.device if tier == "device" else record.host


class HybridRecords(RadixTree):
    """The records' bookkeeping (see the module docstring)."""

    _has_components = True

    def __init__(
        self,
        page_size: int,
        eviction: EvictionPolicy | str = EvictionPolicy.LRU,
        on_split: Callable[[TreeNode, TreeNode], None] | None = None,
        components: Sequence[ComponentSpec] = (),
    ) -> None:
        super().__init__(page_size, eviction, on_split)
        specs = check_components(components)
        if not specs:
            raise ValueError("components: expected at least one ComponentSpec, got none")
        self.components = specs
        self._logic = [kind_logic(spec, page_size) for spec in specs]
        prio = priority_fn(self.eviction)
        self._comp_heaps: dict[str, list[CandidateHeap]] = {
            "device": [CandidateHeap(prio, "_dev_seq") for _ in specs],
            "host": [CandidateHeap(prio, "_host_seq") for _ in specs],
        }
        # One predicate per heap, for its pop and peek: the record's rank, or None.
        self._rank_fns: dict[str, list[Callable[[ComponentRecord], int | None]]] = {
            tier: [self._rank_fn(c, tier) for c in range(len(specs))] for tier in TIERS
        }
        self._comp_counts = [[0, 0] for _ in specs]  # page ids each component holds: device, host

    def _rank_fn(self, c: int, tier: str) -> Callable[[ComponentRecord], int | None]:
        return lambda rec: self._record_rank(rec, c, tier)

    def _records(self, node: TreeNode) -> list[ComponentRecord]:
        return [ComponentRecord(node) for _ in self.components]

    def root(self, namespace: str | None = None) -> TreeNode:
        root = super().root(namespace)
        if root.components is None:
            root.components = self._records(root)
        return root

    def _new_node(self, key: bytes, parent: TreeNode) -> TreeNode:
        node = super()._new_node(key, parent)
        node.components = self._records(node)
        return node

    def num_component_pages(self, c: int, tier: Tier) -> int:
        """Page ids component ``c`` holds in ``tier``."""
        check_tier(tier, "num_component_pages")
        check_component(c, len(self.components), "num_component_pages")
        return self._comp_counts[c][0 if tier == "device" else 1]

    # ------------------------------------------------------------- data
    def _set_data(self, node: TreeNode, c: int, tier: str, ids: torch.Tensor | None) -> None:
        """Give ``node``'s record ``c`` these ids in ``tier`` (None: take them away).

        Keeps every counter and heap entry the change touches (module docstring).
        """
        assert node.components is not None, "a node of a hybrid tree has records"
        rec = node.components[c]
        old = data_of(rec, tier)
        delta = (0 if ids is None else ids.shape[0]) - (0 if old is None else old.shape[0])
        fresh = ids is not None and rec.device is None and rec.host is None
        if tier == "device":
            rec.device = ids
            self._comp_counts[c][0] += delta
            if not node.lock_ref:
                self.device_component_evictable_pages += delta
        else:
            rec.host = ids
            self._comp_counts[c][1] += delta
            if not node.host_lock_ref and node.io_status is IOStatus.NONE:
                self.host_component_takeable_pages += delta
        if fresh:  # new data: its eviction order starts now
            rec.created = rec.last_access = self._clock
        if (old is None) == (ids is None):
            return
        lg = self._logic[c]
        parent = node.parent
        if lg.is_window and parent is not None and parent.parent is not None:
            assert parent.components is not None, "records on every node"
            prec = parent.components[c]
            step = 1 if ids is not None else -1
            if tier == "device":
                prec._dev_children += step
            else:
                prec._host_children += step
            self._push_record(prec, c, tier)
        # The node's other records: whether a hit can end here changed with this one.
        for i, other in enumerate(node.components):
            self._push_record(other, i, tier)
        if lg.is_window:  # short children read this node's window pages for their hits
            for child in node.children.values():
                if lg.reads_parent(len(child.key) // self._key_nbytes_per_page):
                    assert child.components is not None, "records on every node"
                    self._push_record(child.components[c], c, tier)

    def _drop_components(self, node: TreeNode, tier: str) -> torch.Tensor | None:
        """Cascade: take ``node``'s component data in ``tier`` (its full copy there went)."""
        assert node.components is not None, "records on every node"
        parts = []
        for c, rec in enumerate(node.components):
            ids = data_of(rec, tier)
            if ids is not None:
                parts.append(ids)
                self._set_data(node, c, tier, None)
        if not parts:
            return None
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _component_pages_on(self, node: TreeNode, tier: str) -> int:
        """Component page ids ``node`` holds in ``tier``."""
        if node.components is None:
            return 0
        return sum(ids.shape[0] for rec in node.components
                   if (ids := data_of(rec, tier)) is not None)

    def _split_components(self, prefix: TreeNode, suffix: TreeNode, num_pages: int) -> None:
        """Divide ``suffix``'s component data at a split after ``num_pages`` (kinds' hooks)."""
        assert suffix.components is not None, "records on every node"
        prefix.components = records = self._records(prefix)
        for lg, pre, suf in zip(self._logic, records, suffix.components, strict=True):
            for tier in TIERS:
                ids = data_of(suf, tier)
                if ids is None:
                    continue
                head, tail = lg.split(ids, num_pages)
                if tier == "device":
                    suf.device = own_pages(tail)
                    pre.device = None if head is None else own_pages(head)
                else:
                    suf.host = own_pages(tail)
                    pre.host = None if head is None else own_pages(head)
            if pre.device is not None or pre.host is not None:
                pre.last_access, pre.hit_count, pre.created = (
                    suf.last_access, suf.hit_count, suf.created)
            if lg.is_window:  # the prefix's only child is the suffix
                pre._dev_children = int(suf.device is not None)
                pre._host_children = int(suf.host is not None)
        # Same locks, same pages: the counters stand; ranks may move (the suffix is
        # shorter and has a new parent).
        self._refresh_records(prefix)
        self._refresh_records(suffix)

    # ------------------------------------------------------- candidates
    def _record_rank(self, rec: ComponentRecord, c: int, tier: str) -> int | None:
        """The rank of ``rec``'s data in ``tier`` as an eviction candidate, or None."""
        node = rec.node
        if node.parent is None or node.io_status is not IOStatus.NONE:
            return None
        if tier == "device":
            if rec.device is None or node.lock_ref:
                return None
            return -1 if self._unusable(node, c, tier) else 0
        if rec.host is None or node.host_lock_ref:
            return None
        if self._unusable(node, c, tier):
            return -1
        return 1 if node.device_indices is not None else 0

    def _unusable(self, node: TreeNode, c: int, tier: str) -> bool:
        """True when no hit can read ``node``'s component ``c`` in ``tier``, as far as the
        node and its neighbours show: no hit ends at its end (another component lacks
        data there, or a window shorter than its window lacks its parent's), and for
        a window no child holds the window's data (their hits read it)."""
        records = node.components
        assert records is not None, "records on every node"
        dead = any(data_of(r, tier) is None for i, r in enumerate(records) if i != c)
        lg = self._logic[c]
        if not dead and lg.reads_parent(len(node.key) // self._key_nbytes_per_page):
            parent = node.parent
            assert parent is not None and parent.components is not None, "a live node"
            dead = parent.parent is not None and data_of(parent.components[c], tier) is None
        if not dead:
            return False
        if lg.is_window:
            rec = records[c]
            return not (rec._dev_children if tier == "device" else rec._host_children)
        return True

    def _push_record(self, rec: ComponentRecord, c: int, tier: str) -> None:
        rank = self._record_rank(rec, c, tier)
        if rank is not None:
            self._comp_heaps[tier][c].push(rec, rank)

    def _refresh_records(self, node: TreeNode) -> None:
        """Give each of ``node``'s records a current heap entry where it is a candidate."""
        records = node.components
        if node.parent is None or records is None or node.io_status is not IOStatus.NONE:
            return
        for c, rec in enumerate(records):
            if rec.device is not None:
                self._push_record(rec, c, "device")
            if rec.host is not None:
                self._push_record(rec, c, "host")

    def _refresh(self, node: TreeNode) -> None:
        super()._refresh(node)
        self._refresh_records(node)

    def _touch(self, rec: ComponentRecord, c: int) -> None:
        """A hit reads ``rec``: its access stamps move (and so its heap keys)."""
        rec.last_access = self._clock
        rec.hit_count += 1
        for tier in TIERS:
            if data_of(rec, tier) is not None:
                self._push_record(rec, c, tier)

    def _compact(self) -> None:
        super()._compact()
        nodes = list(self.nodes())
        for tier in TIERS:
            for c, heap in enumerate(self._comp_heaps[tier]):
                rank = self._rank_fns[tier][c]
                heap.rebuild(
                    (rec, r) for n in nodes if n.components is not None
                    for rec in (n.components[c],) if (r := rank(rec)) is not None
                )

    def _maybe_compact(self) -> None:
        limit = 4 * self.num_nodes + 1024
        if any(len(h) > limit for heaps in self._comp_heaps.values() for h in heaps):
            self._compact()
        else:
            super()._maybe_compact()
