"""What the connector's halves send each other through vLLM, once a step.

Scheduler -> workers: the step plan (:class:`HiCacheConnectorMetadata`, a
:class:`~hicache.integrations.vllm.common.plan.StepPlan`). Workers -> scheduler:
:class:`HiCacheWorkerMetadata`, which vLLM aggregates over the tensor-parallel ranks
(``KVOutputAggregator``) before the scheduler sees it: sets are united, per-rank
reports kept per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hicache.integrations.vllm.common.plan import StepPlan


@dataclass
class HiCacheConnectorMetadata(StepPlan, KVConnectorMetadata):
    """The step plan, as vLLM's connector metadata."""


@dataclass
class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: host pages that turned bad this step (union over workers)."""

    bad_host_pages: set[int] = field(default_factory=set)
    # vLLM blocks found to hold wrong KV (a failed load, or computed over one)
    poisoned_blocks: set[int] = field(default_factory=set)
    # Third-tier writes that ended (KV cache events on): unsalted key -> the ranks that
    # stored the page, and keys some rank did not store (failed, cancelled or dropped).
    written_keys: dict[str, set[int]] = field(default_factory=dict)
    unwritten_keys: set[str] = field(default_factory=set)
    # Prefetches (third-tier reads off the step): op id -> rank -> (leading pages read,
    # the op ended), for the ops whose progress changed this step.
    prefetch: dict[int, dict[int, tuple[int, bool]]] = field(default_factory=dict)
    # rank -> third-tier writes still in flight there (when it changed): the scheduler
    # keeps vLLM stepping until they landed (has_pending_push_work)
    pending_writes: dict[int, int] = field(default_factory=dict)
    # What reads and forwards cost (scheduler/costs.py): (tokens, seconds) of forwards,
    # (pages, seconds) of third-tier reads
    forwards: list[tuple[int, float]] = field(default_factory=list)
    reads: list[tuple[int, float]] = field(default_factory=list)
    # The run-time KV audit: op id -> outcome (common/audit.py), the worst over ranks
    audits: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, HiCacheWorkerMetadata):
            self.bad_host_pages |= other.bad_host_pages
            self.poisoned_blocks |= other.poisoned_blocks
            for key, ranks in other.written_keys.items():
                self.written_keys.setdefault(key, set()).update(ranks)
            self.unwritten_keys |= other.unwritten_keys
            for op_id, progress in other.prefetch.items():
                self.prefetch.setdefault(op_id, {}).update(progress)
            self.pending_writes.update(other.pending_writes)
            self.forwards += other.forwards
            self.reads += other.reads
            for op_id, outcome in other.audits.items():
                self.audits[op_id] = max(self.audits.get(op_id, outcome), outcome)
        return self
