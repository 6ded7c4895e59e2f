"""``HiCacheConnector``: vLLM's v1 KV connector API over the two halves.

vLLM builds one connector in the scheduler process and one in every worker. This
class translates vLLM's objects into the halves' plain arguments: the scheduler half
(:mod:`.scheduler.half`) decides, the worker half (:mod:`.worker.half`) copies::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_gb": 64, "storage": "file:/var/cache/hicache"}}'

Loads land layer by layer in the step that needs them (a hybrid model's: per
request, asynchronously); saves are asynchronous. A finished request's blocks are
freed at once (its last saves run before the next step's loads and forward) unless
it is handed off to a decode instance. See docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache.integrations.vllm.audit import ConnectorAudit
from hicache.integrations.vllm.clocks import HookClock
from hicache.integrations.vllm.clocks import timed_scheduler_hook as _timed_scheduler
from hicache.integrations.vllm.clocks import timed_worker_hook as _timed
from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.groups import KVGroups
from hicache.integrations.vllm.common.identity import layout_planes, storage_identity
from hicache.integrations.vllm.common.keys import rank_salt
from hicache.integrations.vllm.common.params import ERROR_KEY, RequestControl
from hicache.integrations.vllm.common.plan import StepPlan
from hicache.integrations.vllm.common.tp import check_parallelism, vllm_rank_group
from hicache.integrations.vllm.metadata import HiCacheConnectorMetadata, HiCacheWorkerMetadata
from hicache.integrations.vllm.scheduled import scheduled_requests
from hicache.integrations.vllm.scheduler.control import resolve_request
from hicache.integrations.vllm.scheduler.half import SchedulerHalf
from hicache.integrations.vllm.scheduler.inputs import InputReader
from hicache.integrations.vllm.scheduler.pool_hooks import EvictionHook
from hicache.integrations.vllm.stats import HiCacheConnectorStats, SchedulerReport
from hicache.integrations.vllm.worker.half import WorkerHalf
from hicache.transfer.affinity import io_cpus, threads_start_on

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hicache.integrations.vllm.scheduler.kv_events import HostTierEvents
    from hicache.integrations.vllm.scheduler.tier_events import StorageTierEvents
    from hicache.storage import StorageBackend

_log = logging.getLogger(__name__)


class HiCacheConnector(ConnectorAudit, KVConnectorBase_V1, SupportsHMA):
    """hicache's host tier and third tier behind vLLM's prefix cache (``kv_role`` and
    the prefill-to-decode hand-off: :mod:`~hicache.integrations.vllm.roles`).

    Hybrid models (several KV cache groups: sliding-window or Mamba layers beside full
    attention, vLLM's hybrid KV cache manager on, :mod:`.common.groups`): loads are
    asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS`` for one step) and a
    failed one fails its request (``failed_recving``), never single blocks, which vLLM
    cannot map back to requests when there are several groups.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.hc_config = ConnectorConfig.from_sources(extra)  # extra > HICACHE_* > file
        check_parallelism(vllm_config.parallel_config)
        self.groups = KVGroups.from_config(kv_cache_config, self.hc_config.write_policy)
        self.block_size = self.groups.block_size
        self.page_nbytes = self.groups.page_nbytes
        self.num_host_pages = self.hc_config.num_host_pages(self.block_size, self.page_nbytes)
        layout, model_id = storage_identity(vllm_config, kv_cache_config, self.hc_config)
        # Hybrid: a page is one group's block, not the same model's without vLLM's hybrid manager
        self._identity = (f"{layout}-{self.groups.fingerprint()}" if self.groups.hybrid
                          else layout, model_id)
        self._requests: dict[str, Request] = {}
        self._hit_sources: dict[str, tuple[int, int]] = {}
        self._scheduler_report = SchedulerReport()  # the scheduler side's stats and clock
        self._worker_clock = HookClock()  # the worker side's time per hook, and the forward
        self._block_pool: BlockPool | None = None  # vLLM's (scheduler side)
        self._eviction_hook: EvictionHook | None = None  # vLLM's evictions -> write_back
        self._controls: dict[str, tuple[RequestControl, str | None]] = {}  # + namespace
        self._inputs = InputReader()  # what the KV depends on besides the tokens
        self._events: HostTierEvents | None = None  # the host tier's KV cache events, when on
        self._tier_events: StorageTierEvents | None = None  # the third tier's, when on
        events = getattr(vllm_config, "kv_events_config", None)
        self._events_on = events is not None and events.enable_kv_cache_events
        self._rank = 0  # this worker's tensor-parallel rank (worker side)
        self.scheduler_half: SchedulerHalf | None = None
        self.worker_half: WorkerHalf | None = None
        self._init_roles(self._kv_transfer_config.kv_role)
        if role == KVConnectorRole.SCHEDULER:
            backend = self._open_storage()
            self.scheduler_half = SchedulerHalf(
                self.hc_config, block_size=self.block_size, num_host_pages=self.num_host_pages,
                storage_backend=backend, storage_identity=self._identity,
                tp_size=vllm_config.parallel_config.tensor_parallel_size, groups=self.groups,
                storage_reads=self.reads_storage,
            )
            self._scheduler_report.start(self.scheduler_half)
            if self._events_on:
                from hicache.integrations.vllm.scheduler.kv_events import HostTierEvents
                from hicache.integrations.vllm.scheduler.tier_events import StorageTierEvents

                self._events = HostTierEvents(
                    self.block_size, self._requests.get,
                    getattr(kv_cache_config, "hash_block_size", None), group_idx=self.groups.full,
                    group_specs=self.groups.event_specs())
                self.scheduler_half.page_listener = self._events
                if backend is not None:
                    self._tier_events = StorageTierEvents(
                        self._events, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load runs in attention: a full CUDA graph would skip it.
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, not lost KV

    def _open_storage(self) -> StorageBackend | None:
        """The configured third tier, opened (None: none configured); a client's own
        threads start off the model runner's core (``threads_start_on``)."""
        from hicache.storage import make_storage

        if not self.hc_config.storage:
            return None
        with threads_start_on(io_cpus()):
            return make_storage(self.hc_config.storage, page_nbytes=self.page_nbytes,
                                secret=self.hc_config.storage_secret, **self.hc_config.storage_options)

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        backend = self._open_storage()
        tp = self._vllm_config.parallel_config.tensor_parallel_size
        ranks = vllm_rank_group() if tp > 1 else None
        self.worker_half = WorkerHalf(
            self.hc_config, kv_caches, num_blocks=self._kv_cache_config.num_blocks,
            block_size=self.block_size, num_host_pages=self.num_host_pages,
            storage_backend=backend, rank_group=ranks,
            key_salt=rank_salt(ranks.rank, ranks.world_size) if ranks is not None else None,
            per_request_loads=self.groups.hybrid,
        )
        self._rank = ranks.rank if ranks is not None else 0
        if self._events_on and backend is not None:
            self.worker_half.write_reports = ([], [])  # for the third tier's events
        if self.worker_half.layout.page_nbytes != self.page_nbytes:
            raise ValueError(f"HiCacheConnector: registered KV holds "
                             f"{self.worker_half.layout.page_nbytes} bytes per block, the KV "
                             f"cache spec says {self.page_nbytes}")
        planes = layout_planes(self._vllm_config)  # a shared third tier must not mix layouts
        if backend is not None and self.worker_half.layout.planes_per_layer != planes:
            raise ValueError(f"HiCacheConnector: expected {planes} plane(s) per layer and block "
                             f"(the storage identity), got {self.worker_half.layout.fingerprint()}")

    def _plan(self) -> StepPlan | None:
        return self._connector_metadata if isinstance(self._connector_metadata, StepPlan) else None

    @_timed
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker_half is not None and isinstance(kv_connector_metadata, StepPlan):
            self.worker_half.begin_step(kv_connector_metadata)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.loads and self.worker_half is not None:
            self.worker_half.start_loads(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Once per layer and step: untimed (the clocks cost ~2 µs a call) unless a load
        # is in flight, the only case in which it can wait.
        if self.worker_half is not None and self.worker_half.loading:
            self._wait_for_layer_load(layer_name)

    @_timed
    def _wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker_half is not None:
            self.worker_half.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing per layer: saves go once per step (wait_for_save), one transfer of
        every layer's blocks, ordered after the whole forward by the compute fence."""

    def wait_for_save(self) -> None:  # once per step; untimed: a step that computes
        self._wait_for_save()  # nothing then waits for the storage threads (roles.py)
        self._yield_when_idle(self._plan())

    @_timed
    def _wait_for_save(self) -> None:
        plan = self._plan()
        if self.worker_half is not None:
            self.worker_half.counters.steps += 1
            if plan is not None:
                self.worker_half.end_step(plan)  # little to do when the plan is empty

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_half is None:
            return None, None
        sent = self.worker_half.finished(finished_req_ids)  # held requests' writes ended
        return sent or None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Hybrid models: the requests whose asynchronous load ended, failed ones too.
        out = super().get_transfer_results(finished_req_ids)
        if self.worker_half is not None:
            done, failed = self.worker_half.take_finished_loads()
            out.finished_recving |= done | failed
            out.failed_recving |= failed
        return out

    @_timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.load_errors() if self.worker_half is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler_half is not None:  # vLLM's scheduler asks too, every step
            return self._scheduler_report.take(self.scheduler_half)
        if self.worker_half is None:
            return None
        data = self.worker_half.take_stats()
        if data is None:
            return None  # the clocks ride along with the next report
        data.update(self._worker_clock.take())
        return HiCacheConnectorStats(data=data)

    @_timed
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker_half is None:
            return None
        half = self.worker_half
        progress = half.take_prefetch_progress(self._plan())  # before the bad pages
        bad, poisoned = half.take_bad_pages(), half.take_poisoned_blocks()
        written, unwritten = half.write_reports or ((), ())
        reporting = bool(bad or poisoned or written or unwritten or progress)
        push = self._push_report(self._plan(), reporting)  # writes in flight, costs
        if not (reporting or push):
            return None
        if half.write_reports is not None:
            half.write_reports = ([], [])
        return HiCacheWorkerMetadata(
            bad_host_pages=bad, poisoned_blocks=poisoned,
            written_keys={key: {self._rank} for key in written}, unwritten_keys=set(unwritten),
            prefetch={op_id: {self._rank: state} for op_id, state in progress.items()}, **push)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HiCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """hicache's counters on vLLM's ``/metrics`` (see :mod:`~hicache.integrations.vllm.prom`)."""
        from hicache.integrations.vllm.prom import HiCachePromMetrics

        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.close()
            self.worker_half = None
        if self._eviction_hook is not None:
            self._eviction_hook.close()
        if self.scheduler_half is not None:
            self.scheduler_half.close()

    # ========================================================= scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._block_pool = gpu_block_pool
        half = self.scheduler_half
        if half is not None and half.saves.policy == "write_back":
            if not getattr(gpu_block_pool, "enable_caching", True):
                _log.warning("hicache: write_back saves blocks vLLM evicts from its prefix "
                             "cache, which is off: nothing will be saved")
            self._eviction_hook = EvictionHook(gpu_block_pool, half.saves.block_evicted)

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._namespace(request)

    def _namespace(self, request: Request) -> str | None:
        """The request's namespace in hicache's tiers; its control is parsed (and given
        to the scheduler half) the first time. A mistake fails closed (params.py)."""
        known = self._controls.get(request.request_id)
        if known is not None:
            return known[1]
        control, namespace = resolve_request(request, self._role_control, self._inputs,
                                             self.block_size, self.scheduler_half)
        self._controls[request.request_id] = (control, namespace)
        return namespace

    @_timed_scheduler
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_half is not None, "scheduler-side call on a worker connector"
        self._requests[request.request_id] = request
        num = self._audit_lookup(request.request_id, self.scheduler_half.num_matched_tokens(
            request.request_id, request.all_token_ids, num_computed_tokens,
            self._namespace(request),
        ))  # an audited hit (audit.py) is computed, then compared: 0
        if num is not None:  # a hand-off's outcome is counted at its first answer
            self.scheduler_half.handoffs.looked_up(request.request_id, num_computed_tokens, num)
        return num, bool(num) and self.groups.hybrid  # hybrid: loaded off the forward

    @_timed_scheduler
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler_half is not None, "scheduler-side call on a worker connector"
        half = self.scheduler_half
        before = (half.counters.host_hit_tokens, half.counters.storage_hit_tokens)
        tables = blocks.get_block_ids()
        half.after_alloc(
            request.request_id, request.all_token_ids, tables[self.groups.full],
            num_external_tokens, self._namespace(request),
            group_block_ids=tables if self.groups.hybrid else None,
        )
        if num_external_tokens:
            self._hit_sources[request.request_id] = (
                half.counters.host_hit_tokens - before[0],
                half.counters.storage_hit_tokens - before[1],
            )

    @_timed_scheduler
    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        host, disk = self._hit_sources.pop(request.request_id, (num_external_tokens, 0))
        return {k: v for k, v in ((CacheHitSource.HOST, host), (CacheHitSource.DISK, disk)) if v}

    @_timed_scheduler
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_half is not None, "scheduler-side call on a worker connector"
        self._scheduler_report.steps += 1  # once per step
        scheduled = scheduled_requests(scheduler_output, self._requests.get, self._namespace,
                                       self.groups)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None and block_state.boundary_state_offloads:
            comps = self.scheduler_half.components
            if comps is not None:
                comps.boundary_states(block_state.boundary_state_offloads)
        plan = self._audited_plan(scheduled)  # the half's, and the audit's comparisons
        plan.held = self.scheduler_half.handoffs.take_held()  # vLLM holds their blocks
        if self._tier_events is not None:
            self._tier_events.planned(plan.early_saves + plan.saves)
        return HiCacheConnectorMetadata(**vars(plan))

    @_timed_scheduler
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._update_push_work(meta if isinstance(meta, HiCacheWorkerMetadata) else None,
                               connector_output)
        comps = self.scheduler_half.components if self.scheduler_half is not None else None
        if comps is not None and (connector_output.finished_recving or connector_output.failed_recving):
            comps.loads_ended(connector_output.finished_recving, connector_output.failed_recving)
        if isinstance(meta, HiCacheWorkerMetadata) and self.scheduler_half is not None:
            self.scheduler_half.mark_bad(meta.bad_host_pages)
            if self._tier_events is not None:
                self._tier_events.written(meta.written_keys, meta.unwritten_keys)
            self.scheduler_half.saves.forget_blocks(meta.poisoned_blocks)  # never saved
            if meta.prefetch and self.scheduler_half.prefetch is not None:
                self.scheduler_half.prefetch.progress(meta.prefetch)  # after: frees pages
            if meta.poisoned_blocks and self._block_pool is not None:
                # No later request may hit them in vLLM's prefix cache (one holding a block
                # is recomputed, or its saves were dropped); the blocks are not freed.
                hook = self._eviction_hook
                with hook.paused() if hook is not None else contextlib.nullcontext():
                    self._block_pool.evict_blocks(meta.poisoned_blocks)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        return self.request_finished_all_groups(request, (block_ids,))  # one group

    @_timed_scheduler
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._hit_sources.pop(request.request_id, None)
        control, namespace = self._controls.pop(request.request_id, (None, None))
        handoff = None
        if self.scheduler_half is not None:
            self._requests[request.request_id] = request  # its last saves are announced
            st = self.scheduler_half.request_finished(
                request.request_id, request.num_computed_tokens,
                block_ids[self.groups.full] if block_ids else None,
                group_block_ids=block_ids if self.groups.hybrid else None,
            )
            self.scheduler_half.handoffs.request_finished(request.request_id)
            if control is not None:  # its pages keyed as they were saved (inputs)
                handoff = self._hand_off(request, control, namespace,
                                         st.inputs if st is not None else None)
        self._requests.pop(request.request_id, None)
        # Never delays the free for a save: the last blocks are saved before the next
        # forward can write a block vLLM hands out again (see StepPlan.early_saves). A
        # hand-off holds them until the workers' third-tier writes of them ended.
        if control is not None and control.error is not None:
            return False, {ERROR_KEY: control.error}  # in the request's output
        return handoff if handoff is not None else (False, None)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The host tier's and the third tier's ``BlockStored`` / ``BlockRemoved`` events
        since the last call (published with vLLM's: :mod:`.scheduler.kv_events`, :mod:`.scheduler.tier_events`)."""
        if self._events is None:
            return ()
        return self._events.take() + (self._tier_events.take() if self._tier_events else [])

    def reset_cache(self) -> bool | None:
        if self.scheduler_half is None:
            return None
        epoch = self.scheduler_half.epoch
        ok = self.scheduler_half.reset()
        if self._tier_events is not None and self.scheduler_half.epoch != epoch:
            self._tier_events.invalidated()
        return ok
