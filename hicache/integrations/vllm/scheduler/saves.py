"""The write policies of the connector: when a vLLM block gets its host copy.

* ``write_through``: every block a step completes is saved (after that step's
  forward) unless the host tier has it.
* ``write_through_selective``: a block is saved once vLLM's own prefix cache served it
  ``backup_hit_threshold`` times (hit counts in a bounded LRU map, keyed by the page's
  chained key: its namespace and every token up to it).
* ``write_back``: a block is saved when vLLM evicts it from its prefix cache to reuse
  it. The eviction happens while vLLM's scheduler allocates the step's blocks; the
  save is planned with that step's plan (``early_saves``) and the workers copy it
  before that step's loads and forward, the first that may overwrite the block.
  Blocks a running request holds are never evicted by vLLM, so until then the block
  holds the KV it was cached with. Host-tier traffic then follows vLLM's evictions.

A host copy needs host copies of the pages before it (the tree is a radix tree):
pages before a saved one that the host tier lacks are saved with it, from the blocks
that hold them; a write-back save whose earlier pages are neither in the host tier
nor in vLLM's blocks any more is dropped (no lookup could reach it).

What vLLM's blocks hold is recorded as the scheduler half plans each step (for
``write_back``): ``block id -> (request state, page index, block table)``. This
module knows the scheduler half's tree and pins, not vLLM: the connector tells it
of evictions (:mod:`~hicache.integrations.vllm.scheduler.pool_hooks`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hicache.integrations.vllm.common.plan import SaveOp

if TYPE_CHECKING:
    from hicache.integrations.vllm.scheduler.requests import RequestState
    from hicache.tree import TreeNode

WRITE_THROUGH = "write_through"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_BACK = "write_back"
MAX_HIT_COUNTS = 65_536  # pages whose vLLM hits write_through_selective counts


class BlockRecord(NamedTuple):
    """What one vLLM block holds (write_back): page ``page`` of ``st``'s tokens."""

    req_id: str
    st: RequestState
    page: int
    table: list[int]  # the request's block table when recorded (table[page] is the block)


class Saves:
    """The write policy of one scheduler half (see the module docstring)."""

    def __init__(self, half: Any, policy: str, hit_threshold: int,
                 max_hit_counts: int = MAX_HIT_COUNTS) -> None:
        """``half``: the :class:`~hicache.integrations.vllm.scheduler.half.SchedulerHalf` whose
        tree, host pages and pins the saves use (not imported: it imports this module)."""
        if policy not in (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK):
            raise ValueError(f"write_policy: expected one of {WRITE_THROUGH!r}, "
                             f"{WRITE_THROUGH_SELECTIVE!r}, {WRITE_BACK!r}, got {policy!r}")
        self.policy = policy
        self._half = half
        self._threshold = hit_threshold
        self._max_hit_counts = max_hit_counts
        self._hits: OrderedDict[str, int] = OrderedDict()  # page key -> vLLM hits (selective)
        self._blocks: dict[int, BlockRecord] = {}  # vLLM block id -> what it holds (write_back)
        self._evicted: dict[int, BlockRecord] = {}  # evicted since the last plan (write_back)

    # ------------------------------------------------------ blocks computed
    def computed(self, req_id: str, st: RequestState, num_done: int) -> SaveOp | None:
        """The request's first ``num_done`` tokens are computed (or will be by the step
        being planned): write_through saves the whole blocks among them, write_back
        records what they hold."""
        if st.skip_save or self.policy == WRITE_THROUGH_SELECTIVE:
            return None
        P = self._half.page_size
        # Only tokens known now: with async scheduling the last sampled one may not be.
        full = min(num_done, len(st.token_ids), len(st.block_ids) * P) // P
        if st.max_save_pages is not None:
            full = min(full, st.max_save_pages)
        if full <= st.num_checked_pages:
            return None
        first, st.num_checked_pages = st.num_checked_pages, full
        if self.policy == WRITE_BACK:
            table = st.block_ids
            for page in range(first, full):
                self._blocks[table[page]] = BlockRecord(req_id, st, page, table)
            return None
        return self.save_pages(req_id, st, full, st.block_ids)

    # ------------------------------------------------------ vLLM's own hits
    def vllm_hit(self, req_id: str, st: RequestState, num_pages: int) -> SaveOp | None:
        """vLLM's prefix cache served the request's first ``num_pages`` pages (its blocks
        are ``st.block_ids``): write_through_selective saves the leading pages hit
        ``backup_hit_threshold`` times, after this step's forward (vLLM caches a block
        when it allocates it: another request of this step may be computing it)."""
        if self.policy != WRITE_THROUGH_SELECTIVE or st.skip_save or num_pages <= 0:
            return None
        if st.max_save_pages is not None:
            num_pages = min(num_pages, st.max_save_pages)
        hits = self._hits
        num_hot = 0
        for i, key in enumerate(self._half._keys(st, num_pages)):
            n = hits.pop(key, 0) + 1
            hits[key] = n
            if n >= self._threshold and num_hot == i:
                num_hot += 1
        while len(hits) > self._max_hit_counts:
            hits.popitem(last=False)
        return self.save_pages(req_id, st, num_hot, st.block_ids) if num_hot else None

    # ----------------------------------------------------- vLLM's evictions
    def block_evicted(self, block_id: int, cached: bool, reused: bool = True) -> None:
        """vLLM took ``block_id`` out of its prefix cache (``cached``: it held an entry
        until now; write_back saves it with the next plan) or hands it out again (else
        what it held is forgotten); ``reused``: for the step being scheduled.

        A reused block's save is planned at once when the host tier has free pages for
        it: a lookup later in the same scheduler step then finds the page (its load, in
        the same plan, runs after the save). Otherwise making room could evict a page a
        lookup of this step promised before its ``after_alloc`` pinned it: planned with
        the plan instead."""
        rec = self._blocks.pop(block_id, None)
        if rec is None or not cached or self.policy != WRITE_BACK:
            return
        self._evicted[block_id] = rec
        if (reused and not rec.st.skip_save
                and self._half.host_allocator.num_free_pages > rec.page):
            del self._evicted[block_id]
            op = self._save_evicted(rec, self._evicted)
            if op is not None:
                self._half._early_saves.append(op)  # pinned until the plan is built

    def forget_blocks(self, block_ids) -> None:
        """These blocks hold wrong KV (or are no longer vLLM's to trust): never saved."""
        for block_id in block_ids:
            self._blocks.pop(block_id, None)
            self._evicted.pop(block_id, None)

    def forget_all(self) -> None:
        """vLLM's prefix cache or the host tier was reset: nothing recorded is saved."""
        self._blocks.clear()
        self._evicted.clear()
        self._hits.clear()

    def plan_evicted(self) -> list[SaveOp]:
        """Saves of the blocks vLLM evicted since the last plan (write_back), parents
        first, so that a child finds its parent's page in the tree."""
        evicted, self._evicted = self._evicted, {}
        ops = []
        for rec in sorted(evicted.values(), key=lambda r: r.page):
            if rec.st.skip_save:
                continue
            op = self._save_evicted(rec, evicted)
            if op is not None:
                ops.append(op)
        return ops

    def _save_evicted(self, rec: BlockRecord, evicted: dict[int, BlockRecord]) -> SaveOp | None:
        half = self._half
        st, full = rec.st, rec.page + 1
        key = half._key(st, full)
        cached = half.tree.probe_key(key, st.namespace) // half.page_size
        first = min(cached, half._first_bad(st, key, cached))  # repairs read blocks too
        for page in range(first, rec.page):
            if not self._holds(rec.table[page], st, page, evicted):
                half.counters.save_skipped_tokens += (full - cached) * half.page_size
                return None  # an earlier page is in neither tier: no lookup reaches it
        return self.save_pages(rec.req_id, st, full, rec.table)

    def _holds(self, block_id: int, st: RequestState, page: int,
               evicted: dict[int, BlockRecord]) -> bool:
        """``block_id`` still holds page ``page`` of ``st``'s tokens (it is cached by vLLM,
        or was evicted in this step: the workers save before the forward reuses it)."""
        other = evicted.get(block_id) or self._blocks.get(block_id)
        if other is None or other.page != page:
            return False
        if other.st is st:
            return True
        o, n = other.st, page + 1
        # The tree keys (built once per request) compare in C, token lists would not.
        return (o.namespace == st.namespace and len(o.token_ids) >= n * self._half.page_size
                and self._half._key(o, n) == self._half._key(st, n))

    @property
    def num_recorded_blocks(self) -> int:
        """vLLM blocks whose content write_back knows (at most vLLM's block count)."""
        return len(self._blocks)

    # ------------------------------------------------------------ one save
    def save_pages(self, req_id: str, st: RequestState, full: int,
                   table: list[int]) -> SaveOp | None:
        """Save the request's first ``full`` pages that the host tier lacks (and those it
        holds bad) from the blocks ``table[:full]``, into host pages allocated and
        cached now (pinned until the plan is built); None when nothing is to be saved
        or the host tier has no room."""
        half = self._half
        P = half.page_size
        key = half._key(st, full)
        ns = st.namespace
        tree = half.tree
        cached = tree.probe_key(key, ns) // P
        # Bad pages this request computed again: saved again, into the same host pages.
        repair_from = half._first_bad(st, key, cached)
        repair: list[int] = []
        path: list[TreeNode] = []
        if repair_from < cached:
            path = tree.probe_path(key, ns)
            held = [n.host_indices for n in path if n.host_indices is not None]  # all of them
            repair = torch.cat(held).tolist()[repair_from:cached]
            for node in path:
                half.pins.pin(node)
            half._bad.difference_update(repair)
        if cached >= full and not repair:
            return None
        new_pages: list[int] = []
        if cached < full:
            if cached and not path:
                # The new pages extend the cached prefix: pin it, or making room for them
                # could evict it (nothing else pins it when vLLM's own cache served the
                # request) and the insert would then adopt placeholder pages for it.
                # Pinning the deepest node protects its ancestors (eviction takes leaves).
                half.pins.pin(tree.probe_path(key, ns)[-1])
            pages = half._alloc_host(full - cached)
            if pages is not None and not half._insert_extension(st, cached, pages, req_id):
                pages = None
            if pages is None:
                half.counters.save_skipped_tokens += (full - cached) * P
                full = cached
            else:
                new_pages = pages.tolist()
        if not repair and not new_pages:
            return None
        first = repair_from if repair else cached
        half.counters.saved_tokens += (full - first) * P
        keys = half._keys(st, full)[first:full] if half.storage is not None else []
        return SaveOp(req_id, table[first:full], repair + new_pages, keys)
