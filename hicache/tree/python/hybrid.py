"""The Python radix tree of a hybrid model: :class:`HybridRadixTree` (components beside full attention).

A :class:`~hicache.tree.python.tree.RadixTree` whose nodes also hold, per
component (:mod:`hicache.components`: a sliding-window class or a recurrent-state
class), the window pages or the state checkpoint a hit at their end needs, in
each tier. The single-kind tree is untouched: this class adds the components
through the hooks and wrappers of its parts, bottom up::

    kinds.py, kind_window.py, kind_state.py   what each kind of component answers
    hybrid_records.py    records, counters, heap entries, ranks, splits, cascade
    hybrid_paths.py      serving a match, what an insert keeps, reads of a path
    hybrid_eviction.py   locks, copies and eviction over full and component data
    hybrid.py            HybridRadixTree, and its check_integrity

:func:`hicache.tree.make_tree` makes one when given ``components``. Contracts and
invariants: docs/design.md, "Hybrid models: components".
"""

from __future__ import annotations

import torch

from hicache.tree.python.hybrid_eviction import HybridEviction
from hicache.tree.python.hybrid_records import data_of
from hicache.tree.types import TIERS, IOStatus


class HybridRadixTree(HybridEviction):
    """Radix tree with components (see the module docstring).

    ``HybridRadixTree(page_size, eviction="lru", on_split=None, components=(spec, ...))``:
    as :class:`hicache.tree.RadixTree`, with at least one
    :class:`~hicache.components.ComponentSpec`.
    """

    def check_integrity(self) -> None:
        """The single-kind invariants, then the components' (docs/design.md, 12-13)."""
        super().check_integrity()
        pnb = self._key_nbytes_per_page
        counts = [[0, 0] for _ in self.components]
        evictable = takeable = 0
        pages: dict[str, list[torch.Tensor]] = {"device": [], "host": []}
        live = {t: [h.live_priorities() for h in self._comp_heaps[t]] for t in TIERS}
        for root in self._roots.values():
            assert root.components is not None and len(root.components) == len(self.components), (
                "a root without its component records")
            assert all(r.device is None and r.host is None for r in root.components), (
                "a root holds component data")
        for node in self.nodes():
            where = f"node {node.id} ({node.namespace!r})"
            records = node.components
            assert records is not None and len(records) == len(self.components), (
                f"{where}: not one record per component")
            full = {"device": node.device_indices, "host": node.host_indices}
            if full["device"] is not None:
                pages["device"].append(full["device"])
            if full["host"] is not None:
                pages["host"].append(full["host"])
            num_pages = len(node.key) // pnb
            for c, (rec, lg) in enumerate(zip(records, self._logic, strict=True)):
                assert rec.node is node, f"{where}: component {c}'s record is another node's"
                for ti, tier in enumerate(TIERS):
                    ids = data_of(rec, tier)
                    if ids is None:
                        continue
                    assert full[tier] is not None, (
                        f"{where}: component {c} in {tier} without the node's {tier} copy")
                    assert ids.dtype == torch.int64 and ids.dim() == 1, f"{where}: ids not int64"
                    assert ids.shape[0] == lg.num_ids(num_pages), (
                        f"{where}: component {c} holds {ids.shape[0]} ids in {tier}, expected "
                        f"{lg.num_ids(num_pages)}")
                    pages[tier].append(ids)
                    counts[c][ti] += ids.shape[0]
                    if tier == "device" and not node.lock_ref:
                        evictable += ids.shape[0]
                    if tier == "host" and not node.host_lock_ref and (
                            node.io_status is IOStatus.NONE):
                        takeable += ids.shape[0]
                    rank = self._record_rank(rec, c, tier)
                    if rank is not None:
                        seq = rec._dev_seq if tier == "device" else rec._host_seq
                        heap = self._comp_heaps[tier][c]
                        assert live[tier][c].get(seq) == heap.expected_priority(rec, rank), (
                            f"{where}: component {c} is a {tier} eviction candidate without a "
                            "current heap entry")
                if lg.is_window:
                    kids = [ch.components[c] for ch in node.children.values()
                            if ch.components is not None]
                    assert rec._dev_children == sum(k.device is not None for k in kids), (
                        f"{where}: miscounts children holding component {c} on the device")
                    assert rec._host_children == sum(k.host is not None for k in kids), (
                        f"{where}: miscounts children holding component {c} in host memory")
        for c in range(len(self.components)):
            assert self._comp_counts[c] == counts[c], (
                f"component {c} counts {self._comp_counts[c]} page ids (device, host), nodes hold "
                f"{counts[c]}")
        assert self.device_component_evictable_pages == evictable, (
            f"device_component_evictable_pages is {self.device_component_evictable_pages}, "
            f"nodes sum to {evictable}")
        assert self.host_component_takeable_pages == takeable, (
            f"host_component_takeable_pages is {self.host_component_takeable_pages}, "
            f"nodes sum to {takeable}")
        for space, parts in pages.items():
            if parts:
                allp = torch.cat(parts)
                assert len(torch.unique(allp)) == len(allp), (
                    f"a {space} page is held twice (full and component pages share one page space)")
