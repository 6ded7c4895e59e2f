"""The worker half's side of the hand-off: when a held request's writes have ended.

A prefill request handed off to a decode instance (scheduler/handoff.py) has finished,
but vLLM holds its blocks (its ``request_finished`` returned True) until every worker
names it among the finished sends of ``get_finished``. A worker names it once no save
of the request is in flight here: its block -> host copies landed and their third-tier
writes ended (stored or failed), or ``timeout_s`` after it finished (a hung store; the
decode side stops waiting on its own). Also here: how many third-tier writes this
worker still has in flight, which keeps vLLM stepping until they landed
(``has_pending_push_work``): writes land by the step's polls, and an idle engine would
otherwise leave its last ones for the next request.

What it knows: request ids and the worker's saves in flight, not blocks or tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.integrations.vllm.worker.prefetch import SaveRecord

# Requests vLLM named finished before a plan named them held (the two normally come in
# one step): remembered this many, newest first, so the hold still finds them.
RECENTLY_FINISHED = 4096


class HeldRequests:
    """Finished requests whose blocks vLLM holds for this worker's writes of them."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._held: set[str] = set()  # named by a plan, not yet seen finished
        self._finished: dict[str, float] = {}  # held and seen finished -> since when
        self._recent: OrderedDict[str, None] = OrderedDict()  # finished, not held (yet)

    def hold(self, req_ids: Iterable[str]) -> None:
        """The plan names these requests held (vLLM finished them in the same step, or
        the step before)."""
        now = self._clock()
        for req_id in req_ids:
            if self._recent.pop(req_id, 0) is None:
                self._finished[req_id] = now
            else:
                self._held.add(req_id)

    def ended(self, finished_req_ids: Iterable[str], saves: list[SaveRecord]) -> set[str]:
        """Held requests whose writes here ended (or timed out), from those vLLM has
        finished (``finished_req_ids``: this step's); each is named once."""
        now = self._clock()
        for req_id in finished_req_ids:
            if req_id in self._held:
                self._held.discard(req_id)
                self._finished[req_id] = now
            else:
                self._recent[req_id] = None
        while len(self._recent) > RECENTLY_FINISHED:
            self._recent.popitem(last=False)
        if not self._finished:
            return set()
        busy = {r for rec in saves for r in rec.req_ids}
        done = {req_id for req_id, since in self._finished.items()
                if req_id not in busy or now - since >= self.timeout_s}
        for req_id in done:
            del self._finished[req_id]
        return done

    @property
    def num_held(self) -> int:
        return len(self._held) + len(self._finished)


def num_writes_in_flight(saves: list[SaveRecord], timeout_s: float,
                         now: float | None = None) -> int:
    """Saves with a third-tier write not yet ended, submitted less than ``timeout_s`` ago
    (an older one waits on a hung store: no reason to keep vLLM stepping for it)."""
    now = time.monotonic() if now is None else now
    return sum(1 for rec in saves if rec.keys and now - rec.since < timeout_s)
