"""The connector's ``kv_role`` and its prefill-to-decode hand-off, on vLLM's API.

``kv_transfer_config.kv_role`` says what an instance does with hicache's tiers:

============== ========================================================================
``kv_both``    loads and saves (one instance, or instances sharing a third tier)
``kv_producer`` a prefill instance: saves; never loads from the third tier unless
               ``producer_reads_storage`` (its own host tier still serves it); hands a
               request off to a decode instance when the request asks
               (``{"do_remote_decode": true}``, what vLLM's P/D proxies send); never
               waits for a hand-off a request carries
``kv_consumer`` a decode instance: loads (waits for a hand-off's pages); saves nothing
               unless ``save_decode`` (then the next turn's prefill can reuse its KV)
============== ========================================================================

:class:`ConnectorRoles` is a part of :class:`~hicache.integrations.vllm.connector.HiCacheConnector`
(a mixin over its state), kept here so that the connector module reads as vLLM's API:
the role's effect on each request, the hand-off's params and held blocks (scheduler
side, :mod:`~hicache.integrations.vllm.scheduler.handoff`), and the work that keeps
vLLM stepping until every third-tier write landed (``has_pending_push_work``), with
the workers' measurements for the read-or-recompute decision
(:mod:`~hicache.integrations.vllm.scheduler.costs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.integrations.vllm.common.handoff import HANDOFF_KEY, asks_remote_decode
from hicache.integrations.vllm.common.params import PARAMS_KEY, RequestControl

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hicache.integrations.vllm.clocks import HookClock
    from hicache.integrations.vllm.common.config import ConnectorConfig
    from hicache.integrations.vllm.common.plan import StepPlan
    from hicache.integrations.vllm.metadata import HiCacheWorkerMetadata
    from hicache.integrations.vllm.scheduler.half import SchedulerHalf
    from hicache.integrations.vllm.worker.half import WorkerHalf

PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"
# A step that computes nothing waits at most this long for a storage job to end
# (:meth:`ConnectorRoles._yield_when_idle`): a request arriving then starts this much later.
IDLE_STEP_IO_WAIT_S = 0.01
REPORT_EVERY_SAMPLES = 16  # cost samples ride along with other reports, or this many


class ConnectorRoles:
    """The role-dependent half of the connector's state and methods."""

    hc_config: ConnectorConfig
    scheduler_half: SchedulerHalf | None
    worker_half: WorkerHalf | None
    _worker_clock: HookClock
    _rank: int

    def _init_roles(self, kv_role: str | None) -> None:
        self.kv_role = kv_role or BOTH
        # Consumers save nothing unless save_decode (every request skips its saves).
        self._saves_off = self.kv_role == CONSUMER and not self.hc_config.save_decode
        self._pending_writes: dict[int, int] = {}  # rank -> third-tier writes in flight
        self._reported_writes = 0  # worker side: the count last reported
        self._forwards: list[tuple[int, float]] = []  # worker side: cost samples to report

    @property
    def reads_storage(self) -> bool:
        """Lookups may be served from the third tier (not a producer, unless asked)."""
        return self.kv_role != PRODUCER or self.hc_config.producer_reads_storage

    def _role_control(self, control: RequestControl) -> RequestControl:
        """The request's control under this instance's role. A producer ignores a
        hand-off a request carries (a decode's params sent to a prefill instance): it
        never waits for pages it is not meant to read."""
        if self._saves_off and control.error is None:
            control = control._replace(skip_save=True)
        if self.kv_role == PRODUCER and control.handoff is not None:
            control = control._replace(handoff=None)
        return control

    # ---------------------------------------------------------- scheduler side
    def _hand_off(self, request: Request, control: RequestControl, namespace: str | None,
                  inputs: Mapping[int, bytes] | None = None,
                  ) -> tuple[bool, dict[str, Any] | None] | None:
        """A finished prefill request asking for a remote decode: its hand-off params, and
        whether vLLM holds its blocks until the workers' writes of them ended. None when
        the request is not handed off (no third tier, a consumer, aborted, ...)."""
        from vllm.v1.request import RequestStatus

        half = self.scheduler_half
        if (half is None or half.storage is None or self.kv_role == CONSUMER
                or control.error is not None or control.skip_save
                or not asks_remote_decode(getattr(request, "kv_transfer_params", None))
                or request.status not in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH_CAPPED)):
            return None
        handoff = half.handoffs.offer(request.request_id, request.all_token_ids,
                                      request.num_prompt_tokens, namespace, inputs)
        params: dict[str, Any] = {HANDOFF_KEY: handoff.to_params()}
        if control.namespace is not None:  # the decode request's pages are the same tenant's
            params["namespace"] = control.namespace
        return handoff.pages > 0, {PARAMS_KEY: params}

    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while a finished request's last saves are not sent, a held
        request's writes have not ended, or a worker has third-tier writes in flight:
        they land by the step's polls, not by themselves."""
        half = self.scheduler_half
        if half is None:
            return False
        return bool(half.has_unsent_saves or half.handoffs.num_held
                    or any(self._pending_writes.values()))

    def _update_push_work(self, meta: HiCacheWorkerMetadata | None,
                          output: KVConnectorOutput) -> None:
        """The workers' held requests done, writes in flight and cost samples."""
        half = self.scheduler_half
        if half is None:
            return
        if output.finished_sending:
            half.handoffs.sent(output.finished_sending)
        if meta is None:
            return
        self._pending_writes.update(meta.pending_writes)
        if (meta.forwards or meta.reads) and half.prefetch is not None:
            half.prefetch.costs.observe(meta.forwards, meta.reads)

    # ------------------------------------------------------------- worker side
    def _yield_when_idle(self, plan: StepPlan | None) -> None:
        """A step that computes and loads nothing (vLLM steps an idle engine while there
        is push work) lets the storage threads run: it waits for one of their jobs, at
        most ``IDLE_STEP_IO_WAIT_S`` (why: ``WorkerThirdTier.yield_to_storage``, in
        :mod:`~hicache.integrations.vllm.worker.third_tier`)."""
        if self.worker_half is not None and plan is not None and not (
                plan.computes or plan.loads):
            self.worker_half.yield_to_storage(IDLE_STEP_IO_WAIT_S)

    def _push_report(self, plan: StepPlan | None, reporting: bool) -> dict[str, Any]:
        """Fields of this step's worker metadata: writes in flight (when the count
        changed) and, with a cost-decided prefetch, the forward's and reads' costs (sent
        when the step reports anyway, ``reporting``, or once enough gathered)."""
        half = self.worker_half
        if half is None:
            return {}
        out: dict[str, Any] = {}
        pending = half.num_writes_in_flight()
        if pending != self._reported_writes:
            out["pending_writes"] = {self._rank: pending}
            self._reported_writes = pending
        if half.read_samples is None:
            return out
        seconds = self._worker_clock.last_model_seconds
        if plan is not None and not plan.loads and seconds is not None:
            tokens = sum(end - start for _, start, end in plan.computes)
            if tokens:  # a step that loaded also waited for its load: not a compute sample
                self._forwards.append((tokens, seconds))
        if (out or reporting) or len(self._forwards) + len(half.read_samples) >= \
                REPORT_EVERY_SAMPLES:
            out["forwards"], self._forwards = self._forwards, []
            out["reads"], half.read_samples = half.read_samples, []
        return out
