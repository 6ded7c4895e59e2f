"""The hybrid tree along a key: which prefixes every component serves, and what an insert keeps.

* ``match_key`` / ``probe_hit_key``: the full-attention match as ever, then the
  deepest node ends every component can serve (:meth:`HybridPaths._servable`):
  on the device part with device data, and below it, on host-only nodes, with
  each node's data in its own tier (what a load brings back).
* ``insert_key`` / ``insert_host`` with ``components``: the full-attention
  insert as ever, then each component keeps the caller's pages at the *hit
  ends* of the path (:meth:`HybridPaths._hit_ends`): the key's end, the end the
  new leaf hangs from, and every branch point. A window keeps the ``w`` pages
  before each hit end (a node that straddles the window's start is split there);
  a state keeps the checkpoint at it. Ends made by those splits are not hit
  ends, so later inserts through them keep nothing more.
* ``component_gaps``, ``component_table``, ``attach_component``,
  ``detach_component``: reads and single-record changes.

Contracts: docs/design.md, "Hybrid models: components".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.checks import check_page_count, check_page_tensor
from hicache.tree.guards import check_component, check_component_pages, check_key, check_tier
from hicache.tree.protocol import RadixTreeLike
from hicache.tree.python.hybrid_records import HybridRecords, data_of
from hicache.tree.python.kinds import KindLogic
from hicache.tree.python.node import EMPTY_PAGES, TreeNode, copy_pages
from hicache.tree.types import (
    NO_PAGES,
    InsertResult,
    IOStatus,
    MatchResult,
    Tier,
    TokenLike,
    token_key,
)

# One step of a path: (node, pages of it on the path, whether the path ends inside it).
PathEntry = tuple[TreeNode, int, bool]


class HybridPaths(HybridRecords):
    """Serving and inserting along a key (see the module docstring)."""

    # ------------------------------------------------------------ serving
    def _servable(self, entries: Sequence[PathEntry], num_device: int) -> tuple[int, int]:
        """The deepest servable node ends of a path: (in the device part, in all of it).

        ``entries`` root side first, the first ``num_device`` on the device. Indices,
        -1 for the root. An end in the host part is read in each node's view: the
        device nodes above it lend their device data (a window reaching into them),
        the host-only nodes their host data.
        """
        logic = self._logic
        carry_device = [0] * len(logic)
        carry_view = [0] * len(logic)
        depth = 0
        best_device = best_host = -1
        for i, (node, num_pages, inside) in enumerate(entries):
            depth += num_pages
            on_device = i < num_device
            records = node.components
            assert records is not None, "records on every node"
            ok_device = on_device
            ok_view = True
            for c, lg in enumerate(logic):
                rec = records[c]
                held = rec.device is not None
                viewed = held if on_device else rec.host is not None
                if inside:  # the prefix of a split there
                    held, viewed = lg.split_prefix_holds(held), lg.split_prefix_holds(viewed)
                carry_device[c], ok = lg.serves(carry_device[c], held, num_pages, depth)
                ok_device = ok_device and ok
                carry_view[c], ok = lg.serves(carry_view[c], viewed, num_pages, depth)
                ok_view = ok_view and ok
            if ok_device:
                best_device = i
            elif not on_device and ok_view:
                best_host = i
        return best_device, max(best_device, best_host)

    def match_key(self, key: bytes, namespace: str | None = None) -> MatchResult:
        """:meth:`RadixTree.match_key`, cut back to what every component serves.

        ``full_len`` is the full-attention match; the component data the returned
        hit reads gets its access stamps.
        """
        result = super().match_key(key, namespace)
        full_len = result.device_len + result.host_len
        if not full_len:
            return result
        pnb = self._key_nbytes_per_page
        entries = [(n, len(n.key) // pnb, False) for n in self.path_to(result.last_node)]
        num_device = sum(1 for n, _, _ in entries if n.device_indices is not None)
        i_device, i_hit = self._servable(entries, num_device)
        self._touch_hit(entries, i_hit)
        root = self.root(namespace)
        P = self.page_size
        device_len = P * sum(n for _, n, _ in entries[: i_device + 1])
        hit_len = P * sum(n for _, n, _ in entries[: i_hit + 1])
        return MatchResult(
            device_len,
            hit_len - device_len,
            entries[i_device][0] if i_device >= 0 else root,
            entries[i_hit][0] if i_hit >= 0 else root,
            full_len,
        )

    def _touch_hit(self, entries: Sequence[PathEntry], i: int) -> None:
        """Stamp the records a hit ending at ``entries[i]``'s end reads."""
        if i < 0:
            return
        depth = sum(n for _, n, _ in entries[: i + 1])
        for c, lg in enumerate(self._logic):
            need = min(lg.window_pages, depth) if lg.is_window else 1
            j = i
            while need > 0 and j >= 0:
                node, num_pages, _ = entries[j]
                assert node.components is not None, "records on every node"
                self._touch(node.components[c], c)
                need -= num_pages
                j -= 1

    def host_only_path(self, result: MatchResult) -> list[TreeNode]:
        """The host-only nodes of a match, root side first (a hybrid match's host part may
        start below device nodes its hit reads nothing of: those are not loaded)."""
        return [n for n in super().host_only_path(result) if n.device_indices is None]

    def probe_hit_key(self, key: bytes, namespace: str | None = None) -> int:
        """Tokens of ``key`` a match would serve (``device_len + host_len``), read-only."""
        key = check_key(key, self._key_nbytes_per_page)
        left = self._probe(key, namespace, None) // self.page_size
        entries: list[PathEntry] = []
        for node in self.probe_path(key, namespace):
            num_pages = len(node.key) // self._key_nbytes_per_page
            if left <= 0:
                break
            entries.append((node, min(num_pages, left), num_pages > left))
            left -= num_pages
        num_device = sum(1 for n, _, _ in entries if n.device_indices is not None)
        _, i_hit = self._servable(entries, num_device)
        return self.page_size * sum(n for _, n, _ in entries[: i_hit + 1])

    # ------------------------------------------------------------ inserting
    def insert_key(
        self, key: bytes, device_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """:meth:`RadixTree.insert_key`; then each component keeps its pages at the hit ends."""
        key = check_key(key, self._key_nbytes_per_page)
        num_pages = len(key) // self._key_nbytes_per_page
        check_page_count("device_indices", device_indices, num_pages)
        given = self._given_components(components, num_pages)
        result = super().insert_key(key, device_indices, namespace)
        unused = self._adopt(result.last_node, given, "device")
        return InsertResult(result.num_cached_tokens, result.last_node, unused)

    def insert_host(
        self, tokens: TokenLike, host_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """:meth:`RadixTree.insert_host`; then each component keeps its host pages at the
        hit ends (on nodes with a host copy)."""
        key = token_key(tokens, self.page_size)
        num_pages = len(key) // self._key_nbytes_per_page
        check_page_count("host_indices", host_indices, num_pages)
        given = self._given_components(components, num_pages)
        result = super().insert_host(tokens, host_indices, namespace)
        unused = self._adopt(result.last_node, given, "host")
        return InsertResult(result.num_cached_tokens, result.last_node, unused)

    def _given_components(
        self, components: Sequence[torch.Tensor | None], num_pages: int
    ) -> list[torch.Tensor | None]:
        return check_component_pages(components, [lg.width for lg in self._logic], num_pages)

    def _hit_ends(self, path: Sequence[TreeNode], created: int) -> list[TreeNode]:
        """The nodes of an inserted path whose ends are hit ends (module docstring).

        ``created``: the clock tick of the insert (its new leaf has it as ``created``).
        """
        last = path[-1]
        ends = [n for n in path[:-1] if len(n.children) > 1]
        if last.created == created and len(path) > 1 and path[-2] not in ends:
            ends.append(path[-2])  # the end the new leaf hangs from
        ends.append(last)
        return ends

    def _adopt(self, last: TreeNode, given: Sequence[torch.Tensor | None], tier: str) -> torch.Tensor:
        """Give the hit ends on the path to ``last`` what the caller gave; return the rest."""
        if all(ids is None for ids in given):
            return NO_PAGES
        path = self.path_to(last)
        ends = self._hit_ends(path, self._clock) if path else []
        pnb = self._key_nbytes_per_page
        end_page = {}
        depth = 0
        for node in path:
            depth += len(node.key) // pnb
            end_page[node] = depth
        unused = []
        for c, (ids, lg) in enumerate(zip(given, self._logic, strict=True)):
            if ids is None:
                continue
            taken = torch.zeros(ids.shape[0], dtype=torch.bool)
            for end_node in ends:
                end = end_page[end_node]
                start = lg.kept_start(0, end)
                node = end_node
                low = end - 1 if start is None else start  # first page whose ids it keeps
                while end > low and node.parent is not None:
                    node_start = end - len(node.key) // pnb
                    if self._may_adopt(node, c, tier):
                        first = max(node_start, low) if start is not None else node_start
                        part = lg.given(ids, first, end)
                        if part is not None:
                            if first > node_start:  # a window split: keep only [first, end)
                                self._split(node, first - node_start)
                            self._set_data(node, c, tier, copy_pages(part))
                            lo = (end - 1 if start is None else first) * lg.width
                            taken[lo : end * lg.width] = True
                    end = node_start
                    node = node.parent
            unused.append(ids[(ids >= 0) & ~taken])
        return torch.cat(unused) if len(unused) > 1 else unused[0] if unused else NO_PAGES

    def _may_adopt(self, node: TreeNode, c: int, tier: str) -> bool:
        """``node`` may take component ``c``'s data in ``tier``: it has its full copy there
        and none of ``c``."""
        assert node.components is not None, "records on every node"
        copy = node.device_indices if tier == "device" else node.host_indices
        return copy is not None and data_of(node.components[c], tier) is None

    # ------------------------------------------------------------ reads
    def component_table(self, node: TreeNode, c: int, tier: Tier) -> torch.Tensor:
        """Component ``c``'s page ids in ``tier`` along the path root..``node``, per token page.

        ``-1`` where a node holds none (docs/design.md, "Hybrid models: components").
        """
        check_tier(tier, "component_table")
        check_component(c, len(self.components), "component_table")
        self._check_live(node, "component_table")
        lg = self._logic[c]
        parts = []
        for n in self.path_to(node):
            assert n.components is not None, "records on every node"
            num_ids = (len(n.key) // self._key_nbytes_per_page) * lg.width
            ids = data_of(n.components[c], tier)
            part = torch.full((num_ids,), -1, dtype=torch.int64)
            if ids is not None:
                part[num_ids - ids.shape[0] :] = ids
            parts.append(part)
        if not parts:
            return EMPTY_PAGES
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def component_gaps(
        self, key: bytes, c: int, tier: Tier, namespace: str | None = None
    ) -> torch.Tensor:
        """Per page of ``key``: would an insert keep ``c``'s page there, and does the tree lack it?

        For ``tier="host"`` the insert is ``insert_host`` (nodes without a host copy
        take no host data); for ``"device"``, ``insert``.
        """
        check_tier(tier, "component_gaps")
        check_component(c, len(self.components), "component_gaps")
        key = check_key(key, self._key_nbytes_per_page)
        return gaps_along(self, self._logic[c], key, c, tier, namespace)

    # ------------------------------------------------------------ one record
    def attach_component(self, node: TreeNode, c: int, tier: Tier, pages: torch.Tensor) -> None:
        """Give ``node`` component ``c``'s data in ``tier`` (a load's or a backup's target).

        ``node`` holds its full copy in ``tier`` and none of ``c`` there; ``pages``: a
        window's ids for every page of the node, or a state's ``width`` ids.
        """
        check_tier(tier, "attach_component")
        check_component(c, len(self.components), "attach_component")
        self._check_live(node, "attach_component")
        check_page_tensor("pages", pages)
        self._refuse_reentry("attach_component", backup_may=True)
        copy = node.device_indices if tier == "device" else node.host_indices
        if node.parent is None or copy is None:
            raise ValueError(
                f"attach_component: expected a non-root node with a {tier} copy, got {node}")
        assert node.components is not None, "records on every node"
        if data_of(node.components[c], tier) is not None:
            raise ValueError(
                f"attach_component: node {node.id} already holds component {c} in {tier}")
        lg = self._logic[c]
        expected = lg.num_ids(len(node.key) // self._key_nbytes_per_page)
        if pages.shape[0] != expected:
            raise ValueError(f"attach_component: expected {expected} page ids, got {pages.shape[0]}")
        if expected and int(pages.min()) < 0:
            raise ValueError(f"attach_component: expected page ids >= 0, got {int(pages.min())}")
        self._set_data(node, c, tier, copy_pages(pages))

    def detach_component(self, node: TreeNode, c: int, tier: Tier) -> torch.Tensor:
        """Take component ``c``'s data in ``tier`` from ``node``; return its pages.

        ``node`` is unlocked in that tier and has no IO in flight.
        """
        check_tier(tier, "detach_component")
        check_component(c, len(self.components), "detach_component")
        self._check_live(node, "detach_component")
        self._refuse_reentry("detach_component")
        assert node.components is not None, "records on every node"
        ids = data_of(node.components[c], tier)
        locked = node.lock_ref if tier == "device" else node.host_lock_ref
        if ids is None or locked or node.io_status is not IOStatus.NONE:
            raise ValueError(
                f"detach_component: expected a node holding component {c} in {tier}, unlocked "
                f"there, with no IO in flight, got {node}"
            )
        self._set_data(node, c, tier, None)
        return ids


def gaps_along(
    tree: RadixTreeLike, lg: KindLogic, key: bytes, c: int, tier: Tier, namespace: str | None
) -> torch.Tensor:
    """:meth:`HybridPaths.component_gaps` over any tree's reads (the native tree's too).

    The path an insert of ``key`` leaves: the cached nodes (the last one split where
    the key leaves it), then the new leaf; its hit ends as :meth:`HybridPaths._hit_ends`
    finds them after the insert; then each hit end's kept pages where the node there
    lacks ``c`` in ``tier`` (and, for ``"host"``, has a host copy).
    """
    P = tree.page_size
    num_pages = len(key) // (4 * P)
    gaps = torch.zeros(num_pages, dtype=torch.bool)
    if not num_pages:
        return gaps
    cached = tree.probe_key(key, namespace) // P
    spans: list[tuple[int, int, bool, bool]] = []  # (start, end, lacks c there, hit end)
    start = 0
    for node in tree.probe_path(key, namespace):
        if start >= cached:
            break
        num = node.num_tokens // P
        end = min(start + num, cached)
        inside = end < start + num
        holds = node.component_pages(c, tier) is not None
        if inside:
            holds = lg.split_prefix_holds(holds)
        copy = tier == "device" or node.host_indices is not None
        leaf_below = end == cached < num_pages  # the new leaf hangs from this end
        kids = (1 if inside else len(node.children)) + int(leaf_below)
        spans.append((start, end, copy and not holds, end == num_pages or leaf_below or kids > 1))
        start = end
    if cached < num_pages:
        spans.append((cached, num_pages, True, True))
    for k, (_, end, _, hit) in enumerate(spans):
        if not hit:
            continue
        first = lg.kept_start(0, end)
        low = end - 1 if first is None else first
        j = k
        while j >= 0 and spans[j][1] > low:
            span_start, span_end, lacking, _ = spans[j]
            if lacking:
                gaps[max(span_start, low) : span_end] = True
            j -= 1
    return gaps
