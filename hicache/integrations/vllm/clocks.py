"""The connector's own time: how long vLLM's calls into the connector take.

Decorators for :class:`~hicache.integrations.vllm.connector.HiCacheConnector`'s hooks.
A worker-side hook's time goes to the worker half's ``hook_seconds`` (the connector's
share of vLLM's step on the worker, copies made there included); a scheduler-side
hook's to the scheduler half's clock (lookups, plans, request ends).
"""

from __future__ import annotations

import functools
import time
from typing import Any


def _clocked(add):
    """A hook decorator: each call's wall and CPU seconds (this thread's) go to
    ``add(connector, wall, cpu)``. Wall time includes waits for a core, and for copies
    of other threads; CPU time is what the hook itself took from its core."""

    def decorate(hook):
        @functools.wraps(hook)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return hook(self, *args, **kwargs)
            finally:
                add(self, time.perf_counter() - start, time.thread_time() - start_cpu)

        return timed

    return decorate


def _add_worker_seconds(self: Any, wall: float, cpu: float) -> None:
    if self.worker_half is not None:
        self.worker_half.counters.hook_seconds += wall
        self.worker_half.counters.hook_cpu_seconds += cpu


def _add_scheduler_seconds(self: Any, wall: float, cpu: float) -> None:
    self._scheduler_report.add_seconds(wall, cpu)


# A worker-side hook's time goes to the worker's ``hook_seconds`` (the connector's share
# of vLLM's step on the worker, copies made there included); a scheduler-side hook's to
# the scheduler half's clock (lookups, plans, request ends).
timed_worker_hook = _clocked(_add_worker_seconds)
timed_scheduler_hook = _clocked(_add_scheduler_seconds)
