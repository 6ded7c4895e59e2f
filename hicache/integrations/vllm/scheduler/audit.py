"""The run-time KV audit, scheduler side: which hits are not served but checked, and
what a page found wrong costs (docs/vllm.md, "Run-time KV audit").

A lookup whose request is sampled (``audit_rate``, :func:`~..common.audit.sampled`)
answers 0: vLLM computes the blocks the hit would have loaded. Each step, for every
page of such a hit that the step's forward completes, the plan carries an
:class:`~..common.audit.AuditOp`: the block, and the host page the host tier would serve
for it now (read from the tree as the plan is built), or else the third-tier key. No pin
outlives the plan: a host page evicted later is written only by a later step, after the
workers compared it in this one.

A mismatch is counted, logged once with the page's identity (request id, page index,
tier; never a salt or a key), and the page goes out of service with everything below
it: in the host tier every page from it down its subtree is marked bad (lookups stop
before it, the next request computing those blocks saves them again, eviction frees
them), in the third tier its key is deleted (every rank's) and never read again by this
process (the chained keys below it are reached only through it). ``audit_action``
``"stop_loads"``: no hit is served from then on.

Full-attention pages only: a hybrid model's sliding-window tails and state checkpoints
are not compared.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache.integrations.vllm.common.audit import MATCH, MISMATCH, AuditOp, sampled
from hicache.integrations.vllm.common.keys import salt_keys

if TYPE_CHECKING:
    from hicache.integrations.vllm.common.config import ConnectorConfig
    from hicache.integrations.vllm.scheduler.half import SchedulerHalf
    from hicache.integrations.vllm.scheduler.requests import ScheduledRequest

_log = logging.getLogger("hicache.integrations.vllm.scheduler")

MAX_IN_FLIGHT = 1 << 16  # comparisons awaiting their outcome (a lost report is forgotten)
MAX_LOGGED = 1024  # pages whose mismatch is logged (one line each); then counted only


@dataclass
class _Hit:
    """The hit an audited request was not served: pages ``[first, end)``, of which
    ``[first, host_end)`` from the host tier and ``[storage_first, end)`` from storage."""

    first: int
    host_end: int
    storage_first: int
    end: int
    next: int = -1  # first page not yet compared (or skipped)

    def __post_init__(self) -> None:
        if self.next < 0:
            self.next = self.first


@dataclass
class _Sent:
    """One comparison sent to the workers: what to take out of service on a mismatch."""

    req_id: str
    page: int
    namespace: str | None
    key: bytes  # tree key of the request's pages up to and including ``page``
    host_page: int  # -1: compared with the third tier's page
    storage_key: str  # "" without a third tier


class DenyingProbe:
    """The lookups' ``exists`` on the third tier, never past a key the audit found wrong
    (every rank's salted key of it): what is chained below it is not reached either."""

    def __init__(self, inner, denied: set[str]) -> None:
        self.inner = inner
        self.denied = denied

    def exists(self, keys: Sequence[str]) -> int:
        if self.denied:
            for i, k in enumerate(keys):
                if k in self.denied:
                    return self.inner.exists(keys[:i]) if i else 0
        return self.inner.exists(keys)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class SchedulerAudit:
    """The audit's state in one scheduler half."""

    def __init__(self, half: SchedulerHalf, config: ConnectorConfig) -> None:
        self.half = half
        self.rate = config.audit_rate
        self.action = config.audit_action
        self.timeout_s = config.storage_timeout_s
        self.loads_stopped = False  # audit_action "stop_loads" after a mismatch
        self._pending: dict[str, _Hit] = {}  # looked up, not allocated yet
        self._active: dict[str, _Hit] = {}  # allocated: compared as vLLM computes them
        self._audited: set[str] = set()  # live requests audited: never served
        self._sent: dict[int, _Sent] = {}  # op id -> comparison awaiting its outcome
        self._next_id = 0
        self._denied: set[str] = set()  # salted third-tier keys never read again
        self._logged: set[tuple[str, object]] = set()  # pages whose mismatch was logged
        self._deletes: queue.SimpleQueue | None = None  # third-tier keys to delete
        self._deletes_done = threading.Event()
        self._deletes_done.set()
        if half._probe is not None:
            half._probe = DenyingProbe(half._probe, self._denied)  # type: ignore[assignment]

    # ------------------------------------------------------------ lookups
    def lookup(self, req_id: str, num: int | None) -> int | None:
        """The lookup's answer to give vLLM: 0 for an audited request (its hit is
        recorded, to be compared), and for every request once loads stopped."""
        if self.loads_stopped or req_id in self._audited:
            return 0
        if not num:
            return num
        st = self.half._reqs.get(req_id)
        if st is None or st.lookup is None or st.handoff is not None:
            return num
        if not sampled(req_id, self.rate):
            return num
        P = self.half.page_size
        num_computed, host, stored = st.lookup
        first = num_computed // P
        end = (num_computed + num) // P
        storage_first = max(host, first) if stored else end
        hit = self._pending[req_id] = _Hit(first, min(max(host, first), end), storage_first, end)
        st.lookup = None  # nothing promised
        self._pin(st, hit.host_end)  # until this step's plan is built, as a served hit's
        return 0

    def _activate(self, req_id: str) -> None:
        """vLLM scheduled a request whose hit was not served: compared from now on."""
        hit = self._pending.pop(req_id)
        self._audited.add(req_id)
        self._active[req_id] = hit
        c = self.half.counters
        c.audited_requests += 1
        c.audit_computed_tokens += (hit.end - hit.first) * self.half.page_size

    def _forget_finished(self) -> None:
        """Requests the half forgot (finished, aborted) are forgotten here too."""
        live = self.half._reqs
        for table in (self._pending, self._active):
            for req_id in [r for r in table if r not in live]:
                del table[req_id]
        self._audited &= live.keys()

    # -------------------------------------------------------------- plans
    def pin(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Before the step's plan is built: host-pin the pages this step's comparisons
        read (the plan's saves evict to make room), until the plan is built."""
        for s in scheduled:
            hit = self._active.get(s.req_id)
            st = self.half._reqs.get(s.req_id)
            if hit is not None and st is not None and hit.next < hit.host_end:
                self._pin(st, min(hit.host_end, (s.num_computed_tokens
                                                 + s.num_scheduled_tokens) // self.half.page_size))

    def _pin(self, st, num_pages: int) -> None:
        """Host-pin the tree's path over the request's first ``num_pages`` pages (the
        deepest node: eviction takes leaves) until the plan is built."""
        if num_pages <= 0:
            return
        path = self.half.tree.probe_path(self.half._key(st, num_pages), st.namespace)
        if path:
            self.half.pins.pin(path[-1])

    def plan(self, scheduled: Sequence[ScheduledRequest],
             saving: Collection[int] = ()) -> list[AuditOp]:
        """This step's comparisons: every audited page the step's forward completes.
        ``saving``: host pages this step's plan saves into (a page evicted since the
        lookup and saved again from the audited block itself compares nothing)."""
        if self._pending or self._active or self._audited:
            self._forget_finished()
            for s in scheduled:
                if s.req_id in self._pending:  # looked up and allocated in this step
                    self._activate(s.req_id)
        if not self._active:
            return []
        half = self.half
        P = half.page_size
        ops: list[AuditOp] = []
        for s in scheduled:
            hit = self._active.get(s.req_id)
            st = half._reqs.get(s.req_id)
            if hit is None or st is None:
                continue
            upto = min(hit.end, (s.num_computed_tokens + s.num_scheduled_tokens) // P,
                       len(st.block_ids))
            if upto <= hit.next:
                continue
            key = half._key(st, upto)
            cached = half.tree.probe_key(key, st.namespace) // P
            path = half.tree.probe_path(key, st.namespace) if cached > hit.next else []
            ids = torch.cat([n.host_indices for n in path]).tolist()[:cached] if path else []
            keys = half._keys(st, upto) if half.storage is not None else []
            for i in range(hit.next, upto):
                host_page = ids[i] if i < hit.host_end and i < len(ids) else -1
                if host_page in half._bad or host_page in saving:
                    host_page = -1
                skey = keys[i] if keys else ""
                if host_page < 0 and not (i >= hit.storage_first and skey
                                          and not self._denied_key(skey)):
                    half.counters.audit_skipped_pages += 1  # it left the tiers meanwhile
                    continue
                op_id = self._next_id
                self._next_id += 1
                self._sent[op_id] = _Sent(s.req_id, i, st.namespace, key[: (i + 1) * P * 4],
                                          host_page, skey)
                ops.append(AuditOp(op_id, s.req_id, i, st.block_ids[i], host_page,
                                   "" if host_page >= 0 else skey))
            hit.next = upto
            if hit.next >= hit.end:
                del self._active[s.req_id]
        while len(self._sent) > MAX_IN_FLIGHT:
            del self._sent[next(iter(self._sent))]
        return ops

    def _denied_key(self, key: str) -> bool:
        return bool(self._denied) and salt_keys([key], self.half._salts[0])[0] in self._denied

    # ----------------------------------------------------------- outcomes
    def outcomes(self, results: Mapping[int, int]) -> None:
        """The workers' outcomes (op id -> MATCH, SKIPPED or MISMATCH, the worst over ranks)."""
        c = self.half.counters
        for op_id, outcome in results.items():
            sent = self._sent.pop(op_id, None)
            if sent is None:
                continue
            if outcome == MATCH:
                c.audited_pages += 1
            elif outcome == MISMATCH:
                c.audited_pages += 1
                c.audit_mismatched_pages += 1
                self._mismatch(sent)
            else:
                c.audit_skipped_pages += 1

    def _mismatch(self, sent: _Sent) -> None:
        tier = "host" if sent.host_page >= 0 else "storage"
        where: object = sent.host_page if sent.host_page >= 0 else sent.storage_key
        if (tier, where) not in self._logged and len(self._logged) <= MAX_LOGGED:
            self._logged.add((tier, where))
            if len(self._logged) > MAX_LOGGED:
                _log.warning("hicache audit: %d pages found wrong; further ones are counted "
                             "(vllm:hicache_audit_mismatches_total), not logged", MAX_LOGGED)
                return self._take_out(sent)
            _log.warning("hicache audit: request %s page %d: the KV vLLM computed differs from "
                         "the %s tier's page; the page and every page below it are taken out "
                         "of service%s", sent.req_id, sent.page, tier,
                         "; loads from hicache stop (audit_action stop_loads)"
                         if self.action == "stop_loads" else "")
        self._take_out(sent)

    def _take_out(self, sent: _Sent) -> None:
        dropped = self._drop_host(sent)
        self.half.counters.audit_dropped_pages += dropped
        if sent.storage_key:
            self._drop_stored(sent.storage_key)
        if self.action == "stop_loads":
            self.loads_stopped = True

    def _drop_host(self, sent: _Sent) -> int:
        """Mark bad the host page that was compared, if the tree still holds it there,
        and every page below it; returns how many. (A third-tier page found wrong has no
        host copy to drop: what the host tier holds there now was computed since.)"""
        half = self.half
        P = half.page_size
        tree = half.tree
        if sent.host_page < 0 or tree.probe_key(sent.key, sent.namespace) // P <= sent.page:
            return 0
        path = tree.probe_path(sent.key, sent.namespace)
        ids = torch.cat([n.host_indices for n in path]).tolist()
        if ids[sent.page] != sent.host_page:
            return 0  # evicted since, and the position filled again
        pages = ids[sent.page:]  # the last node may hold pages past it: below it
        stack = list(path[-1].children.values())
        while stack:
            node = stack.pop()
            if node.host_indices is not None:
                pages += node.host_indices.tolist()
            stack.extend(node.children.values())
        half.mark_bad(pages)
        return len(pages)

    def _drop_stored(self, key: str) -> None:
        """Never read ``key`` again (every rank's), and delete it from the tier in the
        background (a hung store keeps it, unread; never the scheduler's loop)."""
        half = self.half
        salted = [salt_keys([key], salt)[0] for salt in half._salts]
        self._denied.update(salted)
        if half.storage is None:
            return
        if self._deletes is None:
            self._deletes = queue.SimpleQueue()
            threading.Thread(target=self._delete_loop, args=(half.storage, self._deletes),
                             name="hicache-audit-delete", daemon=True).start()
        self._deletes_done.clear()
        self._deletes.put(salted)

    def _delete_loop(self, backend, jobs: queue.SimpleQueue) -> None:
        while True:
            keys = jobs.get()
            try:
                backend.delete(keys)
            except Exception as exc:  # noqa: BLE001 - the key stays, never read here
                _log.warning("hicache audit: a third-tier page found wrong could not be "
                             "deleted (%s); this process never reads it", type(exc).__name__)
            if jobs.empty():
                self._deletes_done.set()

    def wait_deletes(self, timeout_s: float = 10.0) -> bool:
        """Wait until the deletes asked for so far ended (tests); False on timeout."""
        return self._deletes_done.wait(timeout_s)

    @property
    def num_in_flight(self) -> int:
        """Comparisons sent whose outcome has not come back."""
        return len(self._sent)
