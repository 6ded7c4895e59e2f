"""``HiCacheConnectorStats``: the connector's counters as vLLM's ``KVConnectorStats``.

Each report holds deltas since the previous one (the workers' counters, summed over
ranks, and the scheduler half's), plus the host tier's occupancy (snapshots, see
:data:`~hicache.integrations.vllm.scheduler.half.SNAPSHOT_STATS`). vLLM ships ``data`` from
the engine core to the front end, where :mod:`~hicache.integrations.vllm.prom` records
it on ``/metrics`` and ``reduce`` gives the log line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from hicache.integrations.vllm.clocks import HookClock
from hicache.integrations.vllm.scheduler.half import SNAPSHOT_STATS, SchedulerHalf

# The scheduler side reports its clock alone every this many steps (not with every step).
REPORT_EVERY_STEPS = 32


@dataclass
class HiCacheConnectorStats(KVConnectorStats):
    """Counters of one interval: the workers' (see
    :class:`~hicache.integrations.vllm.worker.stats.WorkerStats`), the scheduler half's (see
    :class:`~hicache.integrations.vllm.scheduler.half.SchedulerStats`, and its
    ``scheduler_steps``, ``scheduler_hook_seconds``, ``scheduler_hook_cpu_seconds``),
    both sides' time per hook and the worker's forward (see
    :class:`~hicache.integrations.vllm.clocks.HookClock`), and the host tier's
    ``host_pages_used`` / ``host_pages_free`` (snapshots)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in SNAPSHOT_STATS:  # occupancy: the later report holds
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = dict(d)
        for kind in ("load", "save"):
            secs = d.get(f"{kind}_seconds", 0.0)
            out[f"{kind}_gbps"] = d.get(f"{kind}_bytes", 0) / secs / 1e9 if secs else 0.0
        for prefix in ("", "scheduler_"):
            steps = d.get(f"{prefix}steps", 0)
            for clock in ("", "cpu_"):
                secs = d.get(f"{prefix}hook_{clock}seconds", 0.0)
                out[f"{prefix}hook_{clock}ms_per_step"] = secs / steps * 1e3 if steps else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class SchedulerReport:
    """The scheduler side's stats: the connector's clock in its scheduler-side hooks and
    the scheduler half's counters, reported as deltas since the last report."""

    def __init__(self) -> None:
        self.steps = 0  # plans built since the last report
        self.seconds = 0.0  # wall seconds in scheduler-side hooks since the last report
        self.cpu_seconds = 0.0  # of which the hooks' thread ran
        self.clock = HookClock("scheduler_")  # the same, per hook
        self._reported: dict[str, int] = {}  # the half's counters at the last report

    def start(self, half: SchedulerHalf) -> None:
        self._reported = dict(vars(half.counters))

    def add_seconds(self, wall: float, cpu: float, hook: str | None = None) -> None:
        """One hook call's wall and CPU seconds (per hook too, when ``hook`` is named)."""
        self.seconds += wall
        self.cpu_seconds += cpu
        if hook is not None:
            self.clock.add(hook, 0.0, wall, cpu)

    def take(self, half: SchedulerHalf) -> HiCacheConnectorStats | None:
        """A report when a counter moved since the last one (a scrape then sees a hit in
        the step it was planned), else the clock alone every 32 steps; else None."""
        counters = vars(half.counters)
        if counters == self._reported and self.steps < REPORT_EVERY_STEPS:
            return None
        data: dict[str, Any] = {"scheduler_steps": self.steps,
                                "scheduler_hook_seconds": self.seconds,
                                "scheduler_hook_cpu_seconds": self.cpu_seconds,
                                **self.clock.take()}
        for name, value in counters.items():
            data[name] = value - self._reported.get(name, 0)
        data["host_pages_used"] = half.host_allocator.num_used_pages
        data["host_pages_free"] = half.host_allocator.num_free_pages
        if half.components is not None:
            data.update(half.components.occupancy())
        self._reported = dict(counters)
        self.steps, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        return HiCacheConnectorStats(data=data)
