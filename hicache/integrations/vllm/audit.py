"""The run-time KV audit on vLLM's connector API (``audit_rate``, ``audit_action``; see
docs/vllm.md, "Run-time KV audit").

:class:`ConnectorAudit` is a part of :class:`~hicache.integrations.vllm.connector.HiCacheConnector`
(a mixin over its state, on top of :class:`~hicache.integrations.vllm.roles.ConnectorRoles`),
kept here so that the connector module reads as vLLM's API. Scheduler side: a lookup of
an audited request answers 0 and each plan carries the step's comparisons
(:mod:`.scheduler.audit`); worker side: after the step's forward, the blocks are
compared with the pages (:mod:`.worker.audit`) and the outcomes ride on the step's
worker metadata, which the scheduler side reads back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache.integrations.vllm.roles import ConnectorRoles
from hicache.integrations.vllm.scheduler.audit import SchedulerAudit
from hicache.integrations.vllm.worker.audit import WorkerAudit

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

    from hicache.integrations.vllm.common.plan import StepPlan
    from hicache.integrations.vllm.metadata import HiCacheWorkerMetadata
    from hicache.integrations.vllm.scheduler.requests import ScheduledRequest


class ConnectorAudit(ConnectorRoles):
    """The audit's half of the connector's state and methods (off: ``audit_rate`` 0)."""

    hc_audit: SchedulerAudit | None = None  # scheduler side, made at the first lookup
    hc_worker_audit: WorkerAudit | None = None  # worker side, made at the first comparison

    # ---------------------------------------------------------- scheduler side
    def _audit_lookup(self, req_id: str, num: int | None) -> int | None:
        """The lookup's answer for vLLM: 0 for an audited request (or after
        ``stop_loads``), else the half's ``num``."""
        if self.hc_audit is None:
            if self.hc_config.audit_rate <= 0 or self.scheduler_half is None:
                return num
            self.hc_audit = SchedulerAudit(self.scheduler_half, self.hc_config)
        return self.hc_audit.lookup(req_id, num)

    def _audited_plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """The half's plan, with the comparisons of the audited pages this step completes
        (their host pages pinned while the plan's saves make room)."""
        assert self.scheduler_half is not None
        audit = self.hc_audit
        if audit is not None:
            audit.pin(scheduled)
        plan = self.scheduler_half.build_plan(scheduled)
        if audit is not None:
            plan.audits = audit.plan(scheduled, {p for op in plan.saves + plan.early_saves
                                                 for p in op.host_pages})
        return plan

    def _update_push_work(self, meta: HiCacheWorkerMetadata | None,
                          output: KVConnectorOutput) -> None:
        super()._update_push_work(meta, output)
        if meta is not None and meta.audits and self.hc_audit is not None:
            self.hc_audit.outcomes(meta.audits)

    # ------------------------------------------------------------- worker side
    def _push_report(self, plan: StepPlan | None, reporting: bool) -> dict[str, Any]:
        """The step's worker metadata fields, and the audit's outcomes: the step's
        comparisons are made here, after its forward (``build_connector_worker_meta``)."""
        out = super()._push_report(plan, reporting)
        half = self.worker_half
        if half is not None and plan is not None and plan.audits:
            if self.hc_worker_audit is None or self.hc_worker_audit.half is not half:
                self.hc_worker_audit = WorkerAudit(half)
            self.hc_worker_audit.compare(plan.audits)
        if self.hc_worker_audit is not None:
            outcomes = self.hc_worker_audit.take()
            if outcomes:
                out["audits"] = outcomes
        return out
