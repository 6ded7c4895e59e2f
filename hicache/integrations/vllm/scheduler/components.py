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
from hicache.integrations.vllm.common.keys import component_key, salt_keys

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
        self._with_states: set[str] = set()  # requests given states for this step

    # ---------------------------------------------------------------- lookups
    def hit_pages(self, key: bytes, namespace: str | None, limit: int | None = None) -> int:
        """Pages of ``key`` (its first ``limit`` pages) a hit may serve: the deepest end
        at which every component can serve it (``probe_hit_key``)."""
        P = self._half.page_size
        if limit is not None:
            key = key[: limit * P * 4]
        return self._half.tree.probe_hit_key(key, namespace) // P

    def needed(self, first: int, end: int) -> list[tuple[int, int, KVGroup, int]]:
        """What a hit of pages ``[first, end)`` reads of the components: ``(component,
        slot, group, position)``, a state's position being the page it ends."""
        return [(c, slot, group, i) for c, members in enumerate(self.members)
                for slot, group in enumerate(members) for i in group.needed_positions(first, end)]

    def storage_key(self, st: RequestState, c: int, slot: int, position: int) -> str:
        """The third-tier key of component ``c``'s page (slot ``slot``) at ``position``."""
        page_key = self._half._keys(st, position + 1)[position]
        return component_key(page_key, f"{self.specs[c].describe()}#{slot}")

    def promise_storage(self, st: RequestState, first: int, end: int, room: int) -> bool:
        """A third-tier hit of the request's pages up to ``end`` (from vLLM's own hit at
        ``first``) can be served: every component page it reads is stored for every
        rank, and host memory has ``room`` for them."""
        keys = [self.storage_key(st, c, slot, i) for c, slot, _, i in self.needed(first, end)]
        if len(keys) > room:
            return False
        half = self._half
        return all(half._probe.exists(salt_keys(keys, salt)) >= len(keys) for salt in half._salts)

    def load(self, st: RequestState, first: int, end: int, op: LoadOp, storage: bool) -> bool:
        """Add the component pages a hit of pages ``[first, end)`` reads to ``op`` (blocks
        from the request's tables), from the host tier, or with ``storage`` read from the
        third tier into host pages allocated now (those the host tier lacks); False when
        one cannot be had (the request's load then fails as a whole)."""
        half, tree, ns = self._half, self._half.tree, st.namespace
        st.loading = (first, end)  # until vLLM reports the load done (loads_ended)
        if op.failed_block_ids:
            return False  # its full-attention pages could not be had
        key = half._key(st, end)
        tables = st.tables or []
        reads = []
        for c, slot, group, i in self.needed(first, end):
            table = tables[group.group_id] if group.group_id < len(tables) else []
            block = table[i] if i < len(table) else NULL_BLOCK
            if block != NULL_BLOCK:  # else vLLM keeps no block there: nothing to fill
                reads.append((c, slot, i, block))
        mine: dict[int, int] = {}  # host page allocated now -> its index in reads
        if storage and reads:
            pages = half._alloc_host(len(reads))
            if pages is None:
                return False
            given = [torch.full((end * len(m),), -1, dtype=torch.int64) for m in self.members]
            for (c, slot, i, _), page in zip(reads, pages.tolist(), strict=True):
                given[c][i * len(self.members[c]) + slot] = page
                mine[page] = len(mine)
            unused = self._insert(key, end, ns, given)
            for page in unused:
                del mine[page]
        node = tree.probe_path(key, ns)[-1]
        tables_c = [tree.component_table(node, c, HOST).tolist() for c in range(len(self.specs))]
        num_stored, ok = len(op.storage_keys), True
        for c, slot, i, block in reads:
            ids = tables_c[c]
            index = i * len(self.members[c]) + slot
            page = ids[index] if index < len(ids) else -1
            if page < 0:
                ok = False  # the load fails, but the pages the tree took are still read
                continue
            self._count(c, "loaded")
            if page in mine:  # read from the third tier first: last in the op
                self._announce(op.req_id, c, slot, i, page)
                op.block_ids.append(block)
                op.host_pages.append(page)
                op.storage_keys.append(self.storage_key(st, c, slot, i))
            else:  # in host memory: before the pages read from the third tier
                at = len(op.host_pages) - num_stored
                op.block_ids.insert(at, block)
                op.host_pages.insert(at, page)
        return ok

    # ------------------------------------------------------------------ saves
    def save(self, req_id: str, st: RequestState, end: int, op: SaveOp | None, *,
             also: int = 0) -> SaveOp | None:
        """Save the component pages the tree lacks at page ``end`` (0: none), at page
        ``also`` (0: none; the page before a page-aligned prompt's end, where the same
        prompt sent again hits) and at every boundary vLLM handed a state over for this
        step, into ``op`` (or a new op, returned). Nothing when the host tier has no room.

        The caller names the ends a later request is likely to hit: where a prompt
        chunk ends and where the request ends. A window's tail at every page a decode
        step completes would cost ``cdiv(W - 1, block_size)`` pages per group for ends
        no prompt comes back to (a chat's next turn continues from the request's end);
        a state checkpoint costs one page per group, and vLLM offers it only once."""
        if st.skip_save:  # its control, or a consumer's role: nothing of it is saved
            return op
        P = self._half.page_size
        ends = {k // P for k in st.states if k % P == 0 and 0 < k // P <= st.num_checked_pages}
        ends |= {e for e in (end, also) if e > 0}
        for e in sorted(ends):
            op = self._save_end(req_id, st, e, op)
        return op

    def _save_end(self, req_id: str, st: RequestState, end: int,
                  op: SaveOp | None) -> SaveOp | None:
        half, tree, ns = self._half, self._half.tree, st.namespace
        P = half.page_size
        key = half._key(st, end)
        if end <= 0 or tree.probe_key(key, ns) // P < end:
            return op  # its full-attention pages are not all cached: nothing to attach to
        copies: list[tuple[int, int, int]] = []  # (component, position, slot)
        for c, members in enumerate(self.members):
            gaps = tree.component_gaps(key, c, HOST, ns).reshape(-1)
            for i in torch.nonzero(gaps).flatten().tolist():
                blocks = self._blocks(st, members, i, P)
                if blocks is not None:  # else vLLM no longer holds it: no hit needs it
                    copies += [(c, i, slot) for slot in range(len(blocks))]
        if not copies:
            return op
        half.pins.pin(tree.probe_path(key, ns)[-1])  # making room must not evict the path
        pages = half._alloc_host(len(copies))
        if pages is None:
            half.counters.save_skipped_tokens += P * len(copies)
            return op
        given = [torch.full((end * len(m),), -1, dtype=torch.int64) for m in self.members]
        for (c, i, slot), page in zip(copies, pages.tolist(), strict=True):
            given[c][i * len(self.members[c]) + slot] = page
        unused = self._insert(key, end, ns, given)
        from hicache.integrations.vllm.common.plan import SaveOp

        op = op if op is not None else SaveOp(req_id, [], [])
        for (c, i, slot), page in zip(copies, pages.tolist(), strict=True):
            if page in unused:
                continue
            op.block_ids.append(self._blocks(st, self.members[c], i, P)[slot])  # type: ignore[index]
            self._announce(req_id, c, slot, i, page)
            op.host_pages.append(page)
            if half.storage is not None:
                op.storage_keys.append(self.storage_key(st, c, slot, i))
            self._count(c, "saved")
        return op

    def _announce(self, req_id: str, c: int, slot: int, position: int, page: int) -> None:
        listener = self._half.page_listener
        if listener is not None:
            listener.cached_component(req_id, self.members[c][slot].group_id, position, page)

    def _count(self, c: int, what: str) -> None:
        kind = "window" if self.specs[c].is_window else "state"
        name = f"{kind}_pages_{what}"
        counters = self._half.counters
        setattr(counters, name, getattr(counters, name) + 1)

    def _blocks(self, st: RequestState, members: list[KVGroup], page: int,
                P: int) -> list[int] | None:
        """The block of each of ``members`` that holds position ``page`` (a window) or
        the state after ``page + 1`` pages (a state), or None if one is missing."""
        tables = st.tables or []
        if st.loading is not None and st.loading[0] <= page < st.loading[1]:
            return None  # a load not known to have landed writes it (or failed to)
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

    def _insert(self, key: bytes, end: int, namespace: str | None,
                given: list[torch.Tensor]) -> set[int]:
        """Give the tree component pages along ``key`` (whose full-attention pages it
        holds); the pages it did not take are freed and returned."""
        half = self._half
        result = half.tree.insert_host(np.frombuffer(key, dtype=np.int32),
                                       torch.zeros(end, dtype=torch.int64), namespace,
                                       components=given)
        unused = result.unused_pages
        if unused.numel():
            half.host_allocator.free(unused)
        return set(unused.tolist())

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
                self._with_states.add(req_id)

    def planned(self) -> None:
        """The step's plan is built and its pins released: vLLM's state hand-over held
        for that step's forward only, and bad pages on nodes pinned until now go."""
        for req_id in self._with_states:
            st = self._half._reqs.get(req_id)
            if st is not None:
                st.states.clear()
        self._with_states.clear()
        if self._bad:
            self.mark_bad(())

    def loads_ended(self, done, failed) -> None:
        """vLLM's workers finished these requests' loads (``done``), of which ``failed``
        failed: those are recomputed (or failed by vLLM), and not loaded again (a load
        that keeps failing would loop); the others' loaded blocks may be saved from."""
        for req_id in set(done or ()) | set(failed or ()):
            st = self._half._reqs.get(req_id)
            if st is None:
                continue
            if req_id in (failed or ()):
                st.skip_load = True
            else:
                st.loading = None

    # ------------------------------------------------------------- bad pages
    def mark_bad(self, host_pages) -> None:
        """The workers found these host pages bad: the component data holding one is
        taken off its node and freed (now, or once the node is unpinned)."""
        self._bad.update(int(p) for p in host_pages)
        if not self._bad:
            return
        tree, held = self._half.tree, set[int]()
        for node in list(tree.nodes()):
            for c in range(len(self.specs)):
                pages = node.component_pages(c, HOST)
                ids = pages.tolist() if pages is not None else []
                if self._bad.isdisjoint(ids):
                    continue
                if node.host_lock_ref:  # pinned by a step being planned, or a prefetch
                    held.update(ids)
                    continue
                freed = tree.detach_component(node, c, HOST)
                self._half.host_allocator.free(freed)
                if self._half.page_listener is not None:  # they left the host tier
                    self._half.page_listener.evicted(freed.tolist())
        self._bad &= held  # pages no node holds (evicted meanwhile, full ones): forgotten

    def num_host_pages(self) -> int:
        """Host pages the tree's components hold."""
        return sum(self._half.tree.num_component_pages(c, HOST) for c in range(len(self.specs)))

    def occupancy(self) -> dict[str, int]:
        """Host pages holding window tails and state checkpoints (``host_window_pages``,
        ``host_state_pages``)."""
        out = {"host_window_pages": 0, "host_state_pages": 0}
        for c, spec in enumerate(self.specs):
            kind = "window" if spec.is_window else "state"
            out[f"host_{kind}_pages"] += self._half.tree.num_component_pages(c, HOST)
        return out
