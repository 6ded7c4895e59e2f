"""The host tier's pages of a hybrid model's other KV cache groups: tree components.

A hybrid model (vLLM's hybrid KV cache manager on, :mod:`~hicache.integrations.vllm.common.groups`)
has one full-attention group and groups of sliding-window or recurrent-state layers.
The scheduler half's tree keeps the full-attention group's pages as ever, and the
others as tree *components* (:mod:`hicache.components`, docs/design.md "Hybrid
models: components"): one window component per sliding-window size, one state
component for the recurrent-state groups, each as wide as it has groups (slot ``j``
of a component is its ``j``-th group, in group order). A host page holds one block of
one group, as a full-attention page does.

* Saves: at every end a request's pages are saved to, the tree says which component
  pages it lacks there (``component_gaps``: a window's tail before the end, the state
  checkpoint at the end); those are copied from the group's block at that position
  (a window) or from the block vLLM handed over for that boundary (a state, vLLM's
  ``boundary_state_offloads``), into host pages allocated now. A page vLLM no longer
  holds (the null block) is not given: the tree then serves no hit there.
* Loads: a hit ``[a, b)`` (pages) fills, per group, the positions it reads
  (:meth:`~hicache.integrations.vllm.common.groups.KVGroup.needed_positions`) that
  vLLM's table holds a block for, from the pages ``component_table`` names.
* Bad pages: a component page the workers report bad is taken off its node
  (``detach_component``) and freed; the tree then no longer serves the hits that
  read it.

Block and page ids of every group go into the same load and save ops as the
full-attention ones: the workers copy blocks, whatever group holds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.integrations.vllm.common.groups import NULL_BLOCK, STATE, WINDOW, KVGroup

if TYPE_CHECKING:
    from hicache.integrations.vllm.common.groups import KVGroups
    from hicache.integrations.vllm.common.plan import LoadOp, SaveOp
    from hicache.integrations.vllm.scheduler.requests import RequestState

HOST = "host"


class ComponentPages:
    """The components of one scheduler half's tree (see the module docstring)."""

    def __init__(self, half: Any, groups: KVGroups) -> None:
        """``half``: the :class:`~hicache.integrations.vllm.scheduler.half.SchedulerHalf`
        whose tree, pins and host pages these are (not imported: it imports this)."""
        from hicache.components import ComponentSpec

        self._half = half
        self.groups = groups
        self.members: list[list[KVGroup]] = []  # per component: its groups, slot order
        specs = []
        for window in sorted({g.window_tokens for g in groups.groups if g.kind == WINDOW}):
            members = [g for g in groups.groups if g.kind == WINDOW and g.window_tokens == window]
            specs.append(ComponentSpec("window", window_tokens=window, width=len(members)))
            self.members.append(members)
        states = [g for g in groups.groups if g.kind == STATE]
        if states:
            specs.append(ComponentSpec("state", width=len(states)))
            self.members.append(states)
        self.specs = tuple(specs)
        self._bad: set[int] = set()  # component pages reported bad, not yet detached

    # ---------------------------------------------------------------- lookups
    def hit_pages(self, key: bytes, namespace: str | None, limit: int | None = None) -> int:
        """Pages of ``key`` (its first ``limit`` pages) a hit may serve: the deepest end
        at which every component can serve it (``probe_hit_key``)."""
        P = self._half.page_size
        if limit is not None:
            key = key[: limit * P * 4]
        return self._half.tree.probe_hit_key(key, namespace) // P

    def load(self, st: RequestState, node: Any, first: int, end: int, op: LoadOp) -> bool:
        """Add the component pages a hit of pages ``[first, end)`` ending at ``node``
        reads to ``op`` (blocks from the request's tables); False when the tree lacks one
        (the request's load then fails as a whole)."""
        tables = st.tables or []
        for c, members in enumerate(self.members):
            ids = self._half.tree.component_table(node, c, HOST).tolist()
            width = len(members)
            for slot, group in enumerate(members):
                table = tables[group.group_id] if group.group_id < len(tables) else []
                for i in group.needed_positions(first, end):
                    block = table[i] if i < len(table) else NULL_BLOCK
                    if block == NULL_BLOCK:
                        continue  # vLLM keeps no block there: nothing to fill
                    page = ids[i * width + slot] if i * width + slot < len(ids) else -1
                    if page < 0:
                        return False
                    op.block_ids.append(block)
                    op.host_pages.append(page)
        return True

    # ------------------------------------------------------------------ saves
    def save(self, req_id: str, st: RequestState, end: int, op: SaveOp | None) -> SaveOp | None:
        """Save the component pages the tree lacks at the request's ends up to page
        ``end`` (whose full-attention pages it holds): into ``op`` (or a new op, which
        is returned). Nothing when the host tier has no room."""
        half = self._half
        P = half.page_size
        ends = sorted({k // P for k in st.states if k % P == 0 and 0 < k // P < end} | {end})
        for e in ends:
            op = self._save_end(req_id, st, e, op)
        return op

    def _save_end(self, req_id: str, st: RequestState, end: int,
                  op: SaveOp | None) -> SaveOp | None:
        half, tree, ns = self._half, self._half.tree, st.namespace
        P = half.page_size
        key = half._key(st, end)
        if tree.probe_key(key, ns) // P < end:
            return op  # its full-attention pages are not all cached: nothing to attach to
        given: list[torch.Tensor] = []
        copies: list[tuple[int, int, int]] = []  # (component, index in its ids, block)
        for c, members in enumerate(self.members):
            gaps = tree.component_gaps(key, c, HOST, ns)
            width = len(members)
            ids = torch.full((end * width,), -1, dtype=torch.int64)
            for i in torch.nonzero(gaps.reshape(-1)).flatten().tolist()[: end]:
                blocks = self._blocks(st, members, i, P)
                if blocks is None:
                    continue  # vLLM no longer holds it: the tree serves no hit needing it
                for slot, block in enumerate(blocks):
                    copies.append((c, i * width + slot, block))
            given.append(ids)
        if not copies:
            return op
        half.pins.pin(tree.probe_path(key, ns)[-1])  # making room must not evict the path
        pages = half._alloc_host(len(copies))
        if pages is None:
            half.counters.save_skipped_tokens += P * len(copies)
            return op
        for (c, index, _), page in zip(copies, pages.tolist(), strict=True):
            given[c][index] = page
        result = tree.insert_host(np.frombuffer(key, dtype=np.int32),
                                  torch.zeros(end, dtype=torch.int64), ns, components=given)
        unused = set(result.unused_pages.tolist())
        if unused:
            half.host_allocator.free(torch.tensor(sorted(unused), dtype=torch.int64))
        from hicache.integrations.vllm.common.plan import SaveOp

        if op is None:
            op = SaveOp(req_id, [], [])
        for (c, index, block), page in zip(copies, pages.tolist(), strict=True):
            if page not in unused:
                op.block_ids.append(block)
                op.host_pages.append(page)
        half.counters.saved_component_pages += len(copies) - len(unused)
        return op

    def _blocks(self, st: RequestState, members: list[KVGroup], page: int,
                P: int) -> list[int] | None:
        """The block of each of ``members`` that holds position ``page`` (a window) or
        the state after ``page + 1`` pages (a state), or None if one is missing."""
        tables = st.tables or []
        out = []
        for group in members:
            if group.kind == STATE:
                block = st.states.get((page + 1) * P, {}).get(group.group_id, NULL_BLOCK)
            else:
                table = tables[group.group_id] if group.group_id < len(tables) else []
                block = table[page] if page < len(table) else NULL_BLOCK
            if block == NULL_BLOCK:
                return None
            out.append(block)
        return out

    # ------------------------------------------------------------ requests
    def boundary_states(self, offloads: dict[str, list[tuple[int, int, int]]]) -> None:
        """vLLM's recurrent-state hand-over (Mamba "align" mode) for the step being
        planned: request id -> [(group id, block id, boundary tokens)]: after this step's
        forward, the block holds the group's state after that many tokens (held for
        this step only: the half clears it once the plan is built)."""
        for req_id, entries in offloads.items():
            st = self._half._reqs.get(req_id)
            for group, block, boundary in entries if st is not None else ():
                st.states.setdefault(boundary, {})[group] = block

    def loads_failed(self, req_ids) -> None:
        """vLLM was told these requests' loads failed: they are recomputed, and not
        loaded again (a load that keeps failing would loop)."""
        for req_id in req_ids:
            st = self._half._reqs.get(req_id)
            if st is not None:
                st.skip_load = True

    # ------------------------------------------------------------- bad pages
    def mark_bad(self, host_pages) -> None:
        """The workers found these host pages bad: the component data holding one is
        taken off its node and freed (now, or once the node is unpinned)."""
        self._bad.update(int(p) for p in host_pages)
        if not self._bad:
            return
        tree = self._half.tree
        for node in list(tree.nodes()):
            for c in range(len(self.specs)):
                pages = node.component_pages(c, HOST)
                if pages is None or self._bad.isdisjoint(pages.tolist()):
                    continue
                if node.host_lock_ref:
                    continue  # pinned by a step being planned, or a prefetch: later
                freed = tree.detach_component(node, c, HOST)
                self._bad.difference_update(freed.tolist())
                self._half.host_allocator.free(freed)
        # Pages no node holds any more (evicted meanwhile, or full pages): nothing to do.
        held = {p for node in tree.nodes() for c in range(len(self.specs))
                for p in (node.component_pages(c, HOST) or torch.empty(0)).tolist()}
        self._bad &= held

    def num_host_pages(self) -> int:
        """Host pages the tree's components hold."""
        return sum(self._half.tree.num_component_pages(c, HOST) for c in range(len(self.specs)))
