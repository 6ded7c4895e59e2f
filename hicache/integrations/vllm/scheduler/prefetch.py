"""The scheduler half's asynchronous third-tier prefetch: a request waits, others compute.

A lookup (``get_num_new_matched_tokens``) that finds pages in storage beyond the hit
vLLM and the host tier already have, whose read pays (reading them is expected to take
less than computing their tokens, :mod:`~hicache.integrations.vllm.scheduler.costs`; or,
with ``prefetch_threshold_tokens`` set, at least that many tokens) starts a *fetch*: host pages are allocated for the stored pages, a
:class:`~hicache.integrations.vllm.common.plan.PrefetchOp` goes to the workers with the
step's plan, and the lookup answers None ("not determined yet": vLLM keeps the request
waiting and asks again next step) while the workers read the pages off vLLM's step.
Each step the workers report how far each op got (per rank); the leading run every
rank has is inserted into the tree as ordinary host pages. When the policy says so,
the request stops waiting and its lookup answers the host hit, which now includes the
pages that arrived; they load into blocks as any host hit does::

    |<- vLLM hit ->|<-- host hit -->|<------ fetch: pages in storage ------->|
                                    |  arrived (in the tree) |  in flight    |
                                    ^ first                  ^ first + ready

Policies (``prefetch_policy``, SGLang HiCache's names): ``best_effort`` uses what
arrived when the request is next asked about; ``wait_complete`` waits until every
page arrived or failed; ``timeout`` waits until then or until ``prefetch_budget_s``
passed. A fetch outlives its request's wait: pages that arrive later are still
inserted (if their prefix is still cached and no reset came), the others are freed
once every rank's read ended; no page an op may still write is freed or reused. A
failed read only shortens the hit (what did not arrive is computed); it is never a
load error.

A fetch pins the deepest tree node it builds on (the host hit, then the pages
inserted), so nothing it extends is evicted under it. Not thread-safe: vLLM's
scheduler loop drives it, like the rest of the scheduler half.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.integrations.vllm.common.plan import PrefetchOp
from hicache.integrations.vllm.scheduler.costs import CostModel
from hicache.integrations.vllm.scheduler.stats import PageListener
from hicache.integrations.vllm.scheduler.third_tier import num_promisable_pages
from hicache.tree import TreeNode

_log = logging.getLogger("hicache.integrations.vllm.scheduler")


@dataclass
class Fetch:
    """One request's pages on their way from storage to host pages."""

    op_id: int
    req_id: str
    namespace: str | None
    first: int  # page index (in the request) of the first fetched page
    pages: list[int]  # host pages, one per fetched page, allocated to the fetch
    key: bytes  # the request's tree key up to the last fetched page
    deadline: float  # "timeout": the request waits until then (time.monotonic)
    ranks: dict[int, tuple[int, bool]] = field(default_factory=dict)  # rank -> (read, ended)
    inserted: int = 0  # leading pages handed to the tree (or freed as duplicates)
    pinned: list[TreeNode] = field(default_factory=list)  # host-locked by the fetch
    waiting: bool = True  # its request waits for it
    stale: bool = False  # a reset came: nothing more goes into the tree
    asked: int = 0  # lookups answered "not yet"


class Prefetcher:
    """Every fetch of one scheduler half (see the module docstring)."""

    def __init__(self, config, tree, allocator, page_size: int, tp_size: int, *,
                 alloc: Callable[[int], torch.Tensor | None], counters,
                 listener: Callable[[], PageListener | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``alloc(n)``: ``n`` host pages (evicting if needed) or None; ``counters``: the
        half's :class:`~hicache.integrations.vllm.scheduler.stats.SchedulerStats`;
        ``listener()``: the half's page listener (KV cache events) or None; ``clock``:
        seconds, for the ``timeout`` policy (tests pass their own)."""
        self.config = config
        self.policy = config.prefetch_policy
        self.tree = tree
        self.allocator = allocator
        self.page_size = page_size
        self.tp_size = tp_size
        self._alloc = alloc
        self._clock = clock
        self._next_id = 1
        self._fetches: dict[int, Fetch] = {}  # op id -> fetch, until done and released
        self._by_req: dict[str, Fetch] = {}  # requests still waiting
        self._ops: list[PrefetchOp] = []  # for the next plan
        self._listener = listener
        self.counters = counters
        self.costs = CostModel(page_size)  # read or recompute (the workers' measurements)

    # ---------------------------------------------------------------- lookups
    def waits(self, req_id: str) -> bool:
        """The request still waits for its fetch (its lookup answers None). When it
        stops waiting, the fetch goes on alone (see :meth:`_release`)."""
        f = self._by_req.get(req_id)
        if f is None:
            return False
        if not f.stale and not self._ended(f) and (
            self.policy == "wait_complete"
            or (self.policy == "timeout" and self._clock() < f.deadline)
        ):
            f.asked += 1
            return True
        self._release(f)
        return False

    def try_start(self, req_id: str, namespace: str | None, key: bytes, host: int,
                  start: int, keys: list[str], probe, salts, *, force: bool = False) -> int:
        """Fetch the stored pages after the ``host`` cached pages of ``key`` (``keys``:
        the storage keys from there on) when reading them pays for the pages past page
        ``start`` (the longer of vLLM's hit and the host hit; see :meth:`_pays`), or with
        ``force`` (a prefill instance's hand-off) when there are any past it, as far as
        host memory can take them. Returns the pages fetched (0: none, nothing changed)."""
        P = self.page_size
        stored = num_promisable_pages(probe, keys, self.tree, self.allocator, key, host, P,
                                      namespace=namespace, salts=salts)
        if stored <= 0 or host + stored <= start:
            return 0
        if not force and not self._pays(stored, host + stored - start):
            self.counters.prefetch_declined_tokens += (host + stored - start) * P
            return 0
        path = self.tree.probe_path(key[: host * P * 4], namespace) if host else []
        # A hand-off's pages are all stored (its wait just saw them), and computing them
        # is what the decode instance is there not to do: it waits as long for the read
        # as it may wait for the pages, under "timeout" (a read stalled past the usual
        # budget, 1.1 s for 16 pages, once in 300 hand-offs on 2 cores).
        ok = self.start(req_id, namespace, key, host, keys[:stored],
                        anchor=path[-1] if path else None,
                        min_budget_s=self.config.handoff_timeout_s if force else 0.0)
        return stored if ok else 0

    def start(self, req_id: str, namespace: str | None, key: bytes, first: int,
              keys: list[str], *, anchor: TreeNode | None,
              min_budget_s: float = 0.0) -> bool:
        """Fetch the pages after the first ``first`` pages of ``key`` (the request's
        tree key; ``keys``: their storage keys). ``anchor``: the deepest node of the
        host hit (None when it is empty), pinned from now on. Under "timeout" the request
        waits for it the configured budget for its tokens, at least ``min_budget_s``.
        False when host memory could not take them (nothing changed then)."""
        pin = [anchor] if anchor is not None else []
        for node in pin:
            self.tree.host_lock(node)  # before allocating: eviction must not take it
        pages = self._alloc(len(keys))
        if pages is None:
            for node in pin:
                self.tree.host_unlock(node)
            return False
        P = self.page_size
        end = first + len(keys)
        budget = max(self.config.prefetch_budget_s(len(keys) * P), min_budget_s)
        f = Fetch(self._next_id, req_id, namespace, first, pages.tolist(),
                  key[: end * P * 4], self._clock() + budget, pinned=pin)
        self._next_id += 1
        self._fetches[f.op_id] = self._by_req[req_id] = f
        self._ops.append(PrefetchOp(f.op_id, list(keys), list(f.pages)))
        self.counters.prefetch_tokens += len(keys) * P
        return True

    def _pays(self, num_read: int, num_saved: int) -> bool:
        """Reading ``num_read`` pages for ``num_saved`` pages past the hit is worth it: by
        the measured costs, or by SGLang's fixed threshold when one is set."""
        threshold = self.config.prefetch_threshold_tokens
        if threshold is not None:
            return num_saved * self.page_size >= max(1, threshold)
        return self.costs.read_pays(num_read, num_saved)

    def take_ops(self) -> list[PrefetchOp]:
        """Ops started since the last call (sent with this step's plan)."""
        ops, self._ops = self._ops, []
        return ops

    # --------------------------------------------------------------- progress
    def progress(self, reports: dict[int, dict[int, tuple[int, bool]]]) -> None:
        """The workers' reports, op id -> rank -> (leading pages read, op ended there),
        possibly from several steps apart: arrived pages go into the tree, and a fetch
        every rank ended frees what did not arrive."""
        for op_id, ranks in reports.items():
            f = self._fetches.get(op_id)
            if f is None:
                continue
            f.ranks.update(ranks)
            self._attach(f)
            if self._ended(f):
                _log.debug("hicache: prefetch %d (request %s) ended: %d of %d pages read%s",
                           op_id, f.req_id, self._ready(f), len(f.pages),
                           ", after a reset" if f.stale else "")
                self._free(f.pages[f.inserted:])
                f.inserted = len(f.pages)
                if not f.waiting:
                    self._forget(f)

    def _ready(self, f: Fetch) -> int:
        """Leading pages every rank has read."""
        if len(f.ranks) < self.tp_size:
            return 0
        return min(read for read, _ in f.ranks.values())

    def _ended(self, f: Fetch) -> bool:
        return len(f.ranks) >= self.tp_size and all(e for _, e in f.ranks.values())

    def _attach(self, f: Fetch) -> None:
        """Insert the pages that arrived since the last call into the tree, and move the
        fetch's pin to the new leaf. Pages the tree got meanwhile (another request
        computed and saved them) are freed instead."""
        ready = self._ready(f)
        if f.stale or ready <= f.inserted:
            return
        P = self.page_size
        done = f.first + f.inserted  # pages of the key the tree must hold already
        end = f.first + ready
        key = f.key[: end * P * 4]
        if self.tree.probe_key(key, f.namespace) // P < done:
            f.stale = True  # cannot happen while pinned; never attach to a gap
            return
        new = f.pages[f.inserted:ready]
        indices = torch.cat((torch.zeros(done, dtype=torch.int64),
                             torch.tensor(new, dtype=torch.int64)))
        result = self.tree.insert_host(np.frombuffer(key, dtype=np.int32), indices,
                                       f.namespace)
        num_dup = max(0, min(end, result.num_cached_tokens // P) - done)
        if num_dup:  # duplicates, not losses
            self.allocator.free(torch.tensor(new[:num_dup], dtype=torch.int64))
        self.counters.prefetch_arrived_tokens += len(new) * P
        listener = self._listener()
        if listener is not None and num_dup < len(new):
            listener.cached(f.req_id, done + num_dup, new[num_dup:])
        self.tree.host_lock(result.last_node)
        self._unpin(f)
        f.pinned = [result.last_node]
        f.inserted = ready

    # ------------------------------------------------------------ lifecycle
    def request_finished(self, req_id: str) -> None:
        """The request finished or was aborted: its fetch goes on alone."""
        f = self._by_req.get(req_id)
        if f is not None:
            self._release(f)

    def _release(self, f: Fetch) -> None:
        f.waiting = False
        self._by_req.pop(f.req_id, None)
        if self._ended(f) or f.stale:
            self._unpin(f)
        if self._ended(f):
            self._forget(f)

    def _forget(self, f: Fetch) -> None:
        self._unpin(f)
        self._fetches.pop(f.op_id, None)

    def reset(self) -> None:
        """``reset_prefix_cache(reset_connector=True)``: nothing more is inserted, pins are
        dropped (the tree can be emptied), pages still being read are freed when every
        rank's read ended."""
        for f in self._fetches.values():
            f.stale = True
            self._unpin(f)

    def _unpin(self, f: Fetch) -> None:
        for node in f.pinned:
            self.tree.host_unlock(node)
        f.pinned = []

    def _free(self, pages: list[int]) -> None:
        if pages:
            self.allocator.free(torch.tensor(pages, dtype=torch.int64))
            self.counters.prefetch_dropped_tokens += len(pages) * self.page_size

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """The tree split ``suffix``, copying its host locks to ``prefix``."""
        for f in self._fetches.values():
            if suffix in f.pinned:
                f.pinned.append(prefix)

    # ------------------------------------------------------------ inspection
    @property
    def num_fetches(self) -> int:
        """Fetches not yet done with (reads in flight, or a request still waiting)."""
        return len(self._fetches)

    @property
    def num_held_pages(self) -> int:
        """Host pages allocated to fetches and not in the tree."""
        return sum(len(f.pages) - f.inserted for f in self._fetches.values())

    def num_pins(self, node: TreeNode) -> int:
        return sum(f.pinned.count(node) for f in self._fetches.values())


def num_fetched(prefetched: tuple[int, int] | None, first: int, end: int) -> int:
    """Of the pages ``first`` to ``end`` of a request, those its prefetch read
    (``prefetched``: the request's ``(first, end)`` pages fetched, or None)."""
    if prefetched is None:
        return 0
    return max(0, min(end, prefetched[1]) - max(first, prefetched[0]))
