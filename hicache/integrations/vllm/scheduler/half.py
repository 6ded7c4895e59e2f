"""The connector's scheduler half: which blocks to load from and save to hicache's tiers.

It runs inside vLLM's scheduler process and holds no KV: hicache's radix tree
(host-resident pages only) and host page allocator, keyed by request token ids.
Lookups are answered in-process, without a round trip to the workers. Each
step it turns what vLLM scheduled into a :class:`~hicache.integrations.vllm.common.plan.StepPlan`
of block <-> host page copies that the workers carry out.

One hicache page is one vLLM block. For one request, in tokens::

    |<- vLLM's own prefix hit ->|<--- loaded from hicache --->|<- computed by vLLM ->|
    |      num_computed         |  host pages | storage pages |                     |
                                ^ a                           ^ b   (pages)

The tree holds *host* pages only: vLLM owns its blocks and evicts them itself,
so a device tier here would only shadow vLLM's prefix cache. When a block is
saved is the write policy's (:mod:`~hicache.integrations.vllm.scheduler.saves`); what a
request asked for, :mod:`~hicache.integrations.vllm.common.params`'. Nodes the current
step loads from or saves to are host-pinned until the plan is built, so making room
for one request never reuses a page another request's copy of this step touches;
ordering across steps is the workers' job (they finish copies into or out of a host
page before the next one that touches it). Not thread-safe: vLLM's scheduler loop
drives it. What a lookup may promise from storage is :mod:`.third_tier`'s; the
per-request state (and what its pages are keyed by) :mod:`.requests`'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.groups import KVGroups
from hicache.integrations.vllm.common.keys import rank_salt
from hicache.integrations.vllm.common.params import RequestControl
from hicache.integrations.vllm.common.plan import LoadOp, SaveOp, StepPlan
from hicache.integrations.vllm.scheduler.bad_pages import BadPages
from hicache.integrations.vllm.scheduler.components import ComponentPages
from hicache.integrations.vllm.scheduler.handoff import Handoffs
from hicache.integrations.vllm.scheduler.inspection import HalfInspection
from hicache.integrations.vllm.scheduler.pins import StepPins
from hicache.integrations.vllm.scheduler.prefetch import Prefetcher, num_fetched
from hicache.integrations.vllm.scheduler.requests import RequestState, ScheduledRequest
from hicache.integrations.vllm.scheduler.saves import WRITE_BACK, Saves
from hicache.integrations.vllm.scheduler.stats import (  # noqa: F401 (re-exported)
    SNAPSHOT_STATS,
    PageListener,
    SchedulerStats,
)
from hicache.integrations.vllm.scheduler.third_tier import (
    NoReads,
    StorageKeys,
    StorageProbe,
    host_room_for_fetch,
    num_promisable_pages,
)
from hicache.memory import PageAllocator
from hicache.tree import TreeNode, make_tree

_log = logging.getLogger(__name__)


class SchedulerHalf(HalfInspection):
    """Bookkeeping for the host tier (and third tier) of one vLLM engine."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        block_size: int,
        num_host_pages: int,
        storage_backend=None,
        storage_identity: tuple[str, str] | None = None,
        tp_size: int = 1,
        groups: KVGroups | None = None,
        storage_reads: bool = True,
    ) -> None:
        """``storage_identity``: ``(KV layout fingerprint, model_id)`` that third-tier keys
        are salted with (with the request's ``cache_salt`` and the tier's epoch).
        ``tp_size``: tensor-parallel ranks; each stores its shard under its own keys, and a
        page is promised from storage only when every rank's shard is there. ``groups``:
        vLLM's KV cache groups; with several (a hybrid model) the tree keeps the other
        groups' pages as components (:mod:`.components`). ``storage_reads`` False: no
        lookup finds a stored page (a producer only writes)."""
        self.config = config
        self.page_size = block_size
        self.components = (ComponentPages(self, groups)
                           if groups is not None and groups.hybrid else None)
        self.tree = make_tree(config.tree, block_size, config.eviction,
                              components=self.components.specs if self.components else ())
        self.tree.on_split = self._on_split
        self.host_allocator = PageAllocator(num_host_pages, "host pages")
        self.storage = storage_backend  # exists() (through the probe), epoch, bump_epoch
        self._probe = ((StorageProbe(storage_backend, config.storage_timeout_s)
                        if storage_reads else NoReads()) if storage_backend is not None else None)
        self._salts = [rank_salt(r, tp_size) for r in range(tp_size)]
        self._storage_keys = StorageKeys(
            storage_identity, storage_backend.epoch() if storage_backend is not None else 0,
            block_size)
        self._reqs: dict[str, RequestState] = {}
        self.pins = StepPins(self.tree)  # host locks taken this step, released by build_plan
        self._loads: list[LoadOp] = []
        # Saves of blocks computed before the next plan (request_finished's, and vLLM's own
        # hit copied in by after_alloc): the workers copy them before that plan's loads.
        self._early_saves: list[SaveOp] = []
        # vLLM's own hit copied into the host tier (after_alloc): sent with this step's
        # saves, which run after the forward.
        self._gap_saves: list[SaveOp] = []
        self._bad = BadPages()  # host pages the workers reported bad, still in the tree
        self.handoffs = Handoffs(self, config.handoff_timeout_s)  # prefill -> decode
        self.counters = SchedulerStats()
        self.saves = Saves(self, config.write_policy, config.backup_hit_threshold)
        # Third-tier hits read in the background (None: "sync", read in vLLM's step)
        self.prefetch: Prefetcher | None = None
        if storage_backend is not None and config.prefetch_policy != "sync" and not self.components:
            # (hybrid models: third-tier hits are read in the step, see docs/vllm.md)
            self.prefetch = Prefetcher(config, self.tree, self.host_allocator, block_size,
                                       tp_size, alloc=self._alloc_host, counters=self.counters,
                                       listener=lambda: self.page_listener)
        # Told of every host page cached and evicted (the connector's KV cache events):
        # ``cached(req_id, first_page, pages)``, ``evicted(pages)``; None: nobody listens.
        self.page_listener: PageListener | None = None

    # ---------------------------------------------------------------- lookups
    def _state(self, req_id: str, token_ids: Sequence[int],
               namespace: str | None) -> RequestState:
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = RequestState(token_ids, namespace)
        st.set_tokens(token_ids)
        return st

    def set_control(self, req_id: str, token_ids: Sequence[int], namespace: str | None,
                    control: RequestControl, num_prompt_tokens: int,
                    inputs: Mapping[int, bytes] | None = None) -> None:
        """The request's per-request control (:mod:`~hicache.integrations.vllm.common.params`)
        and its pages' inputs besides tokens (:mod:`~hicache.integrations.vllm.scheduler.inputs`),
        before its first lookup: ``save_max_tokens`` counts prompt tokens (whole pages)."""
        st = self._state(req_id, token_ids, namespace)
        st.inputs, st.key, st.keys = inputs or {}, b"", []
        st.skip_load, st.skip_save = control.skip_load, control.skip_save
        st.handoff = control.handoff  # pages a prefill instance stored for it (handoff.py)
        if control.save_max_tokens is not None:
            st.max_save_pages = min(control.save_max_tokens, num_prompt_tokens) // self.page_size

    def num_matched_tokens(self, req_id: str, token_ids: Sequence[int], num_computed: int,
                           namespace: str | None = None) -> int | None:
        """Tokens after ``num_computed`` that hicache can load (whole pages), or None while
        the request waits for its prefetch (:mod:`~hicache.integrations.vllm.scheduler.prefetch`);
        no side effect on the tree but a prefetch started. At least one token is always
        left for vLLM to compute.

        ``namespace`` (vLLM's ``cache_salt``): pages are shared only between requests of
        the same namespace, in the host tier and in the third tier (no salt is a
        namespace of its own)."""
        st = self._state(req_id, token_ids, namespace)
        st.lookup = None
        if self.prefetch is not None and self.prefetch.waits(req_id):
            return None
        P = self.page_size
        st.vllm_hit_pages = num_computed // P
        limit = (len(token_ids) - 1) // P  # pages that may be loaded
        c = self.counters
        c.lookups += 1
        if limit * P <= num_computed or st.skip_load:
            return 0
        c.lookup_tokens += limit * P - num_computed
        key = self._key(st, limit)
        cached = self.tree.probe_key(key, st.namespace) // P  # full-attention pages
        clean = self._first_bad(st, key, cached)  # promise nothing from a bad page on
        comps = self.components  # hybrid: a hit ends where every component serves it
        host = comps.hit_pages(key, st.namespace, clean) if comps else clean
        # Storage continues a hit only over a clean host path: after_alloc reads the
        # host tier's full-attention pages up to ``cached`` (a hybrid hit may end before
        # them, where a component lacks a page) and the rest from storage.
        clean_path = clean == cached
        # Storage pages continue whichever hit is longer: the host tier's or vLLM's own
        # (pages vLLM holds are copied from its blocks into the host tier, not read).
        start = max(host, num_computed // P)
        if st.handoff is not None and self.handoffs.waits(req_id, st, st.handoff, start, limit):
            return None  # its pages, handed off by a prefill instance, are not all there yet
        stored = 0
        if self.prefetch is not None:
            if clean_path and start < limit and not st.prefetched:
                n = self.prefetch.try_start(req_id, st.namespace, key, host, start,
                                            self._keys(st, limit)[host:limit], self._probe,
                                            self._salts, force=st.handoff is not None)
                if n:
                    st.prefetched = (host, host + n)
                    return None  # vLLM asks again next step
        elif self.storage is not None and clean_path and start < limit:
            # Room as after_alloc takes it: the cached path pinned, pages past it new.
            stored = num_promisable_pages(
                self._probe, self._keys(st, limit)[start:limit], self.tree,
                self.host_allocator, key, cached, P, extra_pages=start - cached,
                namespace=st.namespace, salts=self._salts,
            )
            if comps is not None and stored and not comps.promise_storage(
                    st, num_computed // P, start + stored, host_room_for_fetch(
                        self.tree, self.host_allocator, key, cached, P, st.namespace)
                    - max(0, start + stored - cached)):
                stored = 0  # a component page the hit reads is not stored
        num_tokens = ((start + stored) if stored else host) * P - num_computed
        if num_tokens <= 0 or num_tokens < self.config.load_threshold_tokens:
            return 0
        st.lookup = (num_computed, host, stored)
        return num_tokens

    def after_alloc(
        self, req_id: str, token_ids: Sequence[int], block_ids: Sequence[int], num_external: int,
        namespace: str | None = None, group_block_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks; hybrid models: every
        group's in ``group_block_ids``); plan the load of the ``num_external`` tokens
        promised by :meth:`num_matched_tokens`."""
        st = self._state(req_id, token_ids, namespace)
        st.block_ids, st.loading = list(block_ids), None  # loading: set again by a load
        if group_block_ids is not None:
            st.follow_tables(group_block_ids, True)
        if st.vllm_hit_pages:
            # vLLM's own hit is a hit of the host tier's copy too: a prefix vLLM keeps hot
            # must not be the host tier's first victim (its LRU/LFU order sees it). Only
            # where the host tier holds some of it: a match would make an empty namespace.
            key = self._key(st, st.vllm_hit_pages)
            if self.tree.probe_key(key, st.namespace):
                self.tree.match_key(key, st.namespace)
            save = self.saves.vllm_hit(req_id, st, st.vllm_hit_pages)  # selective
            if save is not None:
                self._gap_saves.append(save)  # after the forward, as the gap's below
            st.vllm_hit_pages = 0
        if num_external <= 0:
            return
        if st.lookup is None:
            raise ValueError(
                f"update_state_after_alloc: {num_external} external tokens for request "
                f"{req_id!r}, but the last lookup promised none"
            )
        P = self.page_size
        num_computed = st.lookup[0]
        if num_computed % P or num_external % P:
            raise ValueError(
                f"update_state_after_alloc: expected whole blocks of {P} tokens, got "
                f"num_computed={num_computed}, num_external={num_external}"
            )
        a, b = num_computed // P, (num_computed + num_external) // P
        if len(st.block_ids) < b:
            raise ValueError(
                f"update_state_after_alloc: expected at least {b} blocks for request {req_id!r}, "
                f"got {len(st.block_ids)}"
            )
        key = self._key(st, b)
        result = self.tree.match_key(key, st.namespace)
        # Every full-attention page the host tier holds of the hit is read from it, also
        # past where a hybrid hit ends (a component lacks a page there: the components'
        # pages come from storage, in components.load). The tree holds host pages only.
        nodes = (self.tree.probe_path(key, st.namespace)
                 if result.full_len > result.host_len else self.tree.host_only_path(result))
        for node in nodes:
            self.pins.pin(node)
        have = self._first_bad(st, key, result.full_len // P)
        host_pages = torch.cat([n.host_indices for n in nodes]).tolist() if nodes else []
        op = LoadOp(req_id, st.block_ids[a:b], host_pages[a:have] if have > a else [])
        c = self.counters
        if have < b:
            # The rest comes from storage; pages between the host hit and vLLM's own
            # (have < a) are copied from vLLM's blocks, so that the tree has no gap.
            fetched = self._alloc_host(b - have) if self.storage is not None else None
            if fetched is not None and not self._insert_extension(st, have, fetched, req_id):
                fetched = None
            if fetched is None:  # the lookup's room check makes this rare
                op.failed_block_ids = st.block_ids[max(a, have):b]
                op.block_ids = st.block_ids[a:max(a, have)]
                c.load_failed_tokens += (b - max(a, have)) * P
            else:
                pages = fetched.tolist()
                gap = max(0, a - have)
                if gap:
                    # After this step's forward: vLLM caches a block when it allocates
                    # it, so a block of vLLM's hit may be one another request of this
                    # very step computes (or loads) now.
                    self._gap_saves.append(
                        SaveOp(req_id, st.block_ids[have:a], pages[:gap]))
                    c.saved_tokens += gap * P
                op.host_pages += pages[gap:]
                first = max(a, have)
                op.storage_keys = self._keys(st, b)[first:b]
                c.storage_hit_tokens += (b - first) * P
        from_storage = self.storage is not None and (have < b or st.lookup[2] > 0)
        if self.components is not None and not self.components.load(st, a, b, op, from_storage):
            op.failed_block_ids = st.block_ids[a:b]  # hybrid: a load fails as a whole
        prefetched = num_fetched(st.prefetched, a, min(have, b))  # read by its prefetch
        c.storage_hit_tokens += prefetched * P
        c.host_hit_tokens += (max(0, min(have, b) - a) - prefetched) * P
        if self.saves.policy != WRITE_BACK:  # write_back records every block it holds
            st.num_checked_pages = max(st.num_checked_pages, b)
        self._loads.append(op)

    # ------------------------------------------------------------------ steps
    def build_plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """This step's plan: the loads planned since the last call, and the saves of every
        block this step completes. Releases the step's pins."""
        plan = StepPlan(loads=self._loads, saves=self._gap_saves,
                        early_saves=self._early_saves,
                        prefetches=self.prefetch.take_ops() if self.prefetch else [])
        self._loads, self._early_saves, self._gap_saves = [], [], []
        try:
            plan.early_saves += self.saves.plan_evicted()  # write_back
            for s in scheduled:
                st = self._state(s.req_id, s.token_ids, s.namespace)
                if s.group_block_ids is not None:
                    st.follow_tables(s.group_block_ids, s.resumed)
                    plan.new_block_ids.extend(b for ids in s.group_block_ids for b in ids)  # all
                if s.new_block_ids is not None:
                    if s.resumed:
                        st.block_ids = list(s.new_block_ids)
                        if self.saves.policy == WRITE_BACK:
                            st.num_checked_pages = 0  # its new blocks are recorded again
                    else:
                        st.block_ids.extend(s.new_block_ids)
                    plan.new_block_ids.extend(s.new_block_ids)
                    plan.blocks.append((s.req_id, list(s.new_block_ids), s.resumed))
                end = s.num_computed_tokens + s.num_scheduled_tokens
                plan.computes.append((s.req_id, s.num_computed_tokens, end))
                saved = st.num_checked_pages
                save = self.saves.computed(s.req_id, st, end)
                if self.components is not None:  # window tails where a prompt chunk ends
                    prompt = s.num_prompt_tokens is None or end <= s.num_prompt_tokens
                    # The same prompt sent again hits one page short of a page-aligned
                    # prompt's end (vLLM computes at least its last token): a tail there too.
                    resend = (end // self.page_size - 1 if end == s.num_prompt_tokens
                              and end % self.page_size == 0 else 0)
                    save = self.components.save(s.req_id, st, st.num_checked_pages if prompt
                                                and st.num_checked_pages > saved else 0, save,
                                                also=resend)
                if save is not None:
                    plan.saves.append(save)
        finally:
            self.pins.unpin_all()
            if self.components is not None:
                self.components.planned()
        return plan

    def mark_bad(self, host_pages) -> None:
        """The workers found these host pages bad (a save or storage read failed): lookups
        stop before them, and the next request computing them saves them again."""
        self._bad.report(host_pages, self.tree)
        if self.components is not None:
            self.components.mark_bad(host_pages)

    def _first_bad(self, st: RequestState, key: bytes, num_pages: int) -> int:
        return self._bad.first(self.tree, key, st.namespace, num_pages)

    def request_finished(
        self, req_id: str, num_computed_tokens: int | None = None,
        block_ids: Sequence[int] | None = None,
        group_block_ids: Sequence[Sequence[int]] | None = None,
    ) -> RequestState | None:
        """Forget the request; returns its state (None: it had none here).

        With ``num_computed_tokens`` and ``block_ids`` (vLLM's at finish), the blocks
        completed in the last steps, whose tokens were not all known when those steps
        were planned (async scheduling), are saved at the start of the next plan: before
        that plan's loads (which may be promised these pages) and before its forward
        writes a block vLLM freed and handed out again. vLLM frees the blocks at once.
        """
        st = self._reqs.pop(req_id, None)
        if self.prefetch is not None:
            self.prefetch.request_finished(req_id)
        if st is None or num_computed_tokens is None or block_ids is None:
            return st
        st.block_ids = list(block_ids)
        if group_block_ids is not None:
            st.follow_tables(group_block_ids, True)
        save = self.saves.computed(req_id, st, num_computed_tokens)
        if self.components is not None:  # and where it ends
            save = self.components.save(req_id, st, st.num_checked_pages, save)
        if save is not None:
            self._early_saves.append(save)  # pinned until that plan is built
        return st

    # ------------------------------------------------------------- internals
    def _key(self, st: RequestState, num_pages: int) -> bytes:
        return st.tree_key(num_pages, self.page_size)

    def _keys(self, st: RequestState, num_pages: int) -> list[str]:
        return self._storage_keys.of(st, num_pages)

    def _insert_extension(self, st: RequestState, cached: int, pages: torch.Tensor,
                          req_id: str) -> bool:
        """Cache ``pages`` as the host pages after the request's first ``cached`` pages,
        which the tree holds, and pin the new leaf; True if done.

        The caller pinned the cached prefix before allocating ``pages``, so it is still
        there; should the tree disagree anyway, ``pages`` are freed and False is
        returned (the caller skips the save or fails the load, which vLLM recomputes)
        rather than letting the insert adopt placeholder pages or leak ``pages``.
        """
        P = self.page_size
        end = cached + len(pages)
        key = self._key(st, end)
        if self.tree.probe_key(key, st.namespace) // P != cached:
            _log.warning("hicache: the host tree changed under a plan; %d pages not cached",
                         len(pages))
            self.host_allocator.free(pages)
            return False
        indices = torch.cat((torch.zeros(cached, dtype=torch.int64), pages))
        inserted = self.tree.insert_host(np.frombuffer(key, dtype=np.int32), indices,
                                         st.namespace)
        self.pins.pin(inserted.last_node)
        if self.page_listener is not None:
            self.page_listener.cached(req_id, cached, pages.tolist())
        return True

    def _alloc_host(self, num_pages: int) -> torch.Tensor | None:
        alloc = self.host_allocator
        short = num_pages - alloc.num_free_pages
        # host_takeable_tokens: exactly what evict_host can take (not the host copies
        # above a pinned node, which host eviction cannot reach while it is pinned).
        takeable = self.tree.host_takeable_tokens // self.page_size + (
            self.tree.host_component_takeable_pages if self.components is not None else 0)
        if short > takeable:
            return None  # evicting could not make room: evict nothing, keep what is cached
        if short > 0:
            self._evict_host(short * self.page_size)
        return alloc.alloc(num_pages)

    def _evict_host(self, num_tokens: int) -> None:
        """Evict at least ``num_tokens`` of host pages (LRU/LFU leaves) and free them."""
        result = self.tree.evict_host(num_tokens)
        if result.page_ids.numel():  # component pages go without full ones too
            if self._bad:
                self._bad.difference_update(result.page_ids.tolist())
            self.host_allocator.free(result.page_ids)
            self.counters.host_evicted_tokens += result.num_evicted_tokens
            if self.page_listener is not None:
                self.page_listener.evicted(result.page_ids.tolist())

    def _on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        self.pins.on_split(prefix, suffix)
        if self.prefetch is not None:
            self.prefetch.on_split(prefix, suffix)
