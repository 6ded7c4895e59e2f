"""The scheduler half's side of the prefill-to-decode hand-off through the third tier.

What travels between the instances is :mod:`~hicache.integrations.vllm.common.handoff`'s.

**Prefill** (``kv_producer`` or ``kv_both``; a request asking ``do_remote_decode``):
when the request finishes, :meth:`Handoffs.offer` names the leading prompt pages the
host tier holds for it. Each was saved with its third-tier write behind it (by this
request or an earlier one), so they are in the tier or on their way. The request's
blocks are held (vLLM's delayed free) until every worker reports that its writes of the
request ended (``get_finished``, at most ``storage_timeout_s``): the engine keeps
stepping until then (``has_pending_push_work``), so the writes land without waiting
for a next request.

**Decode** (``kv_consumer`` or ``kv_both``; a request carrying a hand-off): it waits
(its lookup answers None, vLLM asks again next step) until the third tier holds
exactly the pages handed off, at most ``handoff_timeout_s``, then is served them as
any stored hit (a prefetch, whatever the prefetch threshold, waited for as long as the
pages at least; or read in the step under ``prefetch_policy: sync``). Timeline of one
request, the decode asked at once::

    prefill   |-- forward --|answer|.. writes land ..|
    decode                         |lookup: None ... None|pages there|read|load|forward
                                   |<- at most handoff_timeout_s ->|

What was not served is computed, never a load error; the reason is counted
(:class:`~hicache.integrations.vllm.scheduler.stats.SchedulerStats`, ``handoff_*``):
``epoch`` (keyed under another epoch), ``identity`` (the last page's key differs from
ours: another model, layout, tenant or tokens), ``timeout`` (not all there in time),
``store`` (the tier could not be asked), ``failed`` (the prefill's write of the first
page missing failed: its worker stored a marker, ``write_failed_key``, and the decode
stops waiting at once), ``short`` (found, fewer loaded: a read failed, host memory was
full). A request waits for its hand-off once: preempted and looked up again, it takes
what the tiers hold then, without waiting. Not thread-safe: vLLM's scheduler loop
drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hicache.integrations.vllm.common.handoff import Handoff, write_failed_key
from hicache.integrations.vllm.common.keys import salt_keys
from hicache.integrations.vllm.scheduler.requests import RequestState

_log = logging.getLogger("hicache.integrations.vllm.scheduler")

PROBE_INTERVAL_S = 0.005  # a waiting request asks the tier at most this often
REASONS = ("epoch", "identity", "timeout", "store", "failed", "short")


@dataclass
class _Wait:
    """A decode request waiting for (or done waiting for) its handed-off pages."""

    wanted: int  # leading pages it may load of those handed off (at most its hit limit)
    started: float
    deadline: float
    next_probe: float = 0.0
    waiting: bool = True
    reason: str | None = None  # why it stopped waiting short of every page


class Handoffs:
    """Both sides of the hand-off in one scheduler half (see the module docstring)."""

    def __init__(self, half: Any, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``half``: the :class:`~hicache.integrations.vllm.scheduler.half.SchedulerHalf`
        whose tree, keys and storage probe this uses (not imported: it imports this)."""
        self._half = half
        self.timeout_s = timeout_s
        self._clock = clock
        self._waits: dict[str, _Wait] = {}  # decode requests, until their outcome is counted
        self._consumed: set[str] = set()  # live requests whose outcome was counted
        self._held: dict[str, float] = {}  # prefill requests whose blocks vLLM holds for us
        self._new_held: list[str] = []  # for the next plan

    # ------------------------------------------------------------- prefill
    def offer(self, req_id: str, token_ids, num_prompt_tokens: int, namespace: str | None,
              inputs: Mapping[int, bytes] | None = None) -> Handoff:
        """What a finished prefill request hands off: the leading whole prompt pages the
        host tier holds (none past a bad one), keyed with the ``inputs`` its pages
        depend on besides their tokens (:mod:`.inputs`), and on a hybrid model up to
        the last end every component serves. Call after the request's last saves were
        planned; with any page, the request is held from now on (vLLM keeps its blocks
        until the workers name it, :meth:`take_held`, :meth:`sent`)."""
        half = self._half
        P = half.page_size
        st = RequestState(token_ids, namespace)
        st.inputs = inputs or {}
        num_pages = min(num_prompt_tokens, len(token_ids)) // P
        key = half._key(st, num_pages)
        comps = half.components
        cached = (comps.hit_pages(key, namespace) if comps is not None
                  else half.tree.probe_key(key, namespace) // P)
        pages = half._first_bad(st, key, cached)
        if pages:
            self._held[req_id] = self._clock()
            self._new_held.append(req_id)
        half.counters.handoff_offered_tokens += pages * P
        last = half._keys(st, pages)[-1] if pages else ""
        return Handoff(pages, half.epoch, last)

    def take_held(self) -> list[str]:
        """Requests held since the last call (the workers report when their writes end)."""
        held, self._new_held = self._new_held, []
        return held

    def sent(self, req_ids) -> None:
        """The workers' writes of these held requests ended: vLLM frees their blocks."""
        for req_id in req_ids:
            self._held.pop(req_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # --------------------------------------------------------------- decode
    def waits(self, req_id: str, st: RequestState, handoff: Handoff, start: int,
              limit: int) -> bool:
        """Whether the request goes on waiting for its handed-off pages (its lookup then
        answers None). ``start``: pages it has already (vLLM's hit or the host tier's);
        ``limit``: pages it may load at most."""
        if req_id in self._consumed:  # preempted after its hand-off: never waits again
            return False
        w = self._waits.get(req_id)
        now = self._clock()
        if w is None:
            w = self._waits[req_id] = _Wait(min(handoff.pages, limit), now,
                                            now + self.timeout_s)
            self._half.counters.handoff_tokens += w.wanted * self._half.page_size
            w.reason = self._mismatch(st, handoff)
            w.waiting = w.reason is None and w.wanted > start
        if not w.waiting:
            return False
        if handoff.epoch != self._half.epoch:  # a reset here meanwhile: never ours now
            return self._stop(w, now, "epoch")
        if now < w.next_probe:
            return True
        ready = self._stored(st, start, w.wanted)
        if ready is None:
            return self._stop(w, now, "store")
        if start + ready >= w.wanted:
            return self._stop(w, now, None)
        if self._write_failed(st, start + ready):
            return self._stop(w, now, "failed")
        if now >= w.deadline:
            return self._stop(w, now, "timeout")
        w.next_probe = now + PROBE_INTERVAL_S
        return True

    def looked_up(self, req_id: str, num_computed: int, num_tokens: int) -> None:
        """The request's lookup answered ``num_tokens`` after ``num_computed``: its
        hand-off's outcome is counted (once)."""
        w = self._waits.pop(req_id, None)
        if w is None:
            return
        self._consumed.add(req_id)
        c = self._half.counters
        served = min(w.wanted, (num_computed + num_tokens) // self._half.page_size)
        c.handoff_served_tokens += served * self._half.page_size
        reason = None if served >= w.wanted else (w.reason or "short")
        if reason is None:
            c.handoff_served += 1
            return
        setattr(c, f"handoff_{reason}", getattr(c, f"handoff_{reason}") + 1)
        _log.warning("hicache: request %s computes %d of the %d pages a prefill instance "
                     "handed off (%s)", req_id, w.wanted - served, w.wanted, reason)

    def request_finished(self, req_id: str) -> None:
        self._waits.pop(req_id, None)
        self._consumed.discard(req_id)

    def _stop(self, w: _Wait, now: float, reason: str | None) -> bool:
        """Stop waiting (``reason``: why not every page came; counted if short)."""
        w.waiting, w.reason = False, reason
        self._half.counters.handoff_wait_seconds += now - w.started
        return False

    def _mismatch(self, st: RequestState, handoff: Handoff) -> str | None:
        """Why the pages handed off are not ours to read (None: they are)."""
        if handoff.pages == 0:
            return None
        if handoff.epoch != self._half.epoch:
            return "epoch"
        if len(st.token_ids) < handoff.pages * self._half.page_size or \
                self._half._keys(st, handoff.pages)[-1] != handoff.key:
            return "identity"
        return None

    def _stored(self, st: RequestState, start: int, end: int) -> int | None:
        """Leading pages ``start..end`` the tier holds for every rank (None: it could not
        be asked)."""
        from hicache.storage import StorageError

        probe = self._half._probe
        if probe is None:
            return None
        keys = self._half._keys(st, end)[start:end]
        try:
            return min(probe.exists(salt_keys(keys, salt)) for salt in self._half._salts)
        except StorageError:
            return None

    def _write_failed(self, st: RequestState, page: int) -> bool:
        """Whether a rank's write of page ``page`` (missing) failed: its worker stored
        the page's marker (:func:`~hicache.integrations.vllm.common.handoff.write_failed_key`)."""
        from hicache.storage import StorageError

        probe = self._half._probe
        key = self._half._keys(st, page + 1)[page]
        try:
            return any(probe.exists([write_failed_key(salt_keys([key], salt)[0])])
                       for salt in self._half._salts)
        except StorageError:
            return False
