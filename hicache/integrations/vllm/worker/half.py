"""The connector's worker half: copies between vLLM's KV tensors and a host pool.

It runs in each vLLM worker process and carries out the scheduler's
:class:`~hicache.integrations.vllm.common.plan.StepPlan`: it owns the host pool
(hicache's :class:`~hicache.memory.HostPool`, pinned on CUDA), hicache's transfer
engine (CUDA executor on GPU; on CPU copy threads on the cores vLLM keeps free of
compute, or copies between forwards) and, with a third tier, a storage backend. It
knows host page ids and block ids, not tokens or the tree.
Its parts: the transfer engine is built by :mod:`.worker_setup`; the third tier on
the step (synchronous reads, write-behind, what a copy into a host page waits for) is
:mod:`.worker_tier`; the background prefetch reads are :mod:`.worker_storage`.

One step, as vLLM calls it::

    handle_preemptions  begin_step   block tables; saves of earlier steps' blocks start;
                                     saves still reading a block reallocated now land
    start_load_kv       start_loads  storage -> host pages (sync), host -> blocks (async)
    (each layer)        wait_layer   the load of that layer has landed
    wait_for_save       end_step     load finished; which blocks hold wrong KV; saves
                                     of this step's right blocks submitted (async)
    get_finished        finished     finished requests' block tables dropped
                        load_errors  blocks vLLM must recompute

Ordering across steps: a copy into or out of a host page waits for the copies
still in flight that touch the same page (the scheduler may have evicted and
reused it meanwhile). A host page whose content is not what the scheduler's
tree says (a save or a storage read failed, or a save was dropped because the
request's load failed) is *bad*: a load from it is reported as a load error
until a later save or read fills it again, and it is reported to the scheduler
(``take_bad_pages``), which stops promising it and has it saved again.

A *block* whose load failed holds wrong KV, and so does every block a forward
computes over it (attention read it), whichever request computes it: the worker
follows vLLM's block tables and what each step computes (the plan carries both)
and never saves such a block; a block rewritten over right KV is right again.
Such blocks are reported to the scheduler (``take_poisoned_blocks``), which takes
them out of vLLM's prefix cache. A step without transfers does little more than
follow the block tables.
"""

from __future__ import annotations

import logging
import time

import torch

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.plan import StepPlan
from hicache.integrations.vllm.common.tp import RankGroup, share_load_errors
from hicache.integrations.vllm.worker.layout import BlockLayout
from hicache.integrations.vllm.worker.prefetch import PrefetchReader, SaveRecord, free_for_read
from hicache.integrations.vllm.worker.sends import HeldRequests, num_writes_in_flight
from hicache.integrations.vllm.worker.stats import CLOCK_STATS, WorkerStats
from hicache.integrations.vllm.worker.third_tier import WorkerThirdTier, id_tensor
from hicache.integrations.vllm.worker.transfers import build_transfers
from hicache.integrations.vllm.worker.wrong_kv import PoisonedBlocks
from hicache.memory import HostPool
from hicache.transfer import Transfer
from hicache.transfer.affinity import io_cpus

_log = logging.getLogger(__name__)


class WorkerHalf(WorkerThirdTier):
    """Host pool, transfer engine and third tier of one vLLM worker."""

    def __init__(
        self,
        config: ConnectorConfig,
        kv_caches: dict[str, torch.Tensor],
        *,
        num_blocks: int,
        block_size: int,
        num_host_pages: int,
        storage_backend=None,
        key_salt: str | None = None,
        rank_group: RankGroup | None = None,
        native: bool | None = None,
        copier_hook=None,
        per_request_loads: bool = False,
    ) -> None:
        """``key_salt``: this rank's storage key salt; ``rank_group``: the engine's
        tensor-parallel ranks (None with one), with which this worker shares each
        step's load errors. ``copier_hook`` (tests): wraps the CPU copier, e.g. to
        delay or fail copies. ``per_request_loads`` (hybrid models): every load is
        vLLM's asynchronous kind, reported per request (:meth:`take_finished_loads`),
        never as block errors."""
        self.config = config
        self.layout = BlockLayout(kv_caches, num_blocks, block_size)
        kv = self.layout.host_kv_config()
        # Zeroed now: a host page's first save would otherwise pay its page faults on
        # the worker's compute core (on CUDA, pinning maps the pages in anyway).
        self.host_pool = HostPool(kv, num_host_pages, reserve_nbytes=config.host_reserve_nbytes,
                                  prefault=True)
        self.transfers, storage_backend = build_transfers(
            config, self.layout, self.host_pool, rank_group,
            storage_backend=storage_backend, native=native, copier_hook=copier_hook)
        self._layer_index = self.layout.region_of  # every layer, overlays included
        self.storage = None
        if storage_backend is not None:
            from hicache.storage.worker import StorageTier

            self.storage = StorageTier(storage_backend, self.host_pool, cpus=io_cpus())
        self._key_salt = key_salt
        self._ranks = rank_group
        # Third-tier writes that ended (stored, not stored), for the KV cache events
        # (tier_events.py); None: not reported (events off).
        self.write_reports: tuple[list[str], list[str]] | None = None
        # Background third-tier reads (the scheduler's prefetch policies)
        self.prefetch = (PrefetchReader(self.storage, self._salted)
                         if self.storage is not None else None)
        self._load: Transfer | None = None
        self._load_blocks: list[int] = []
        self._saves: list[SaveRecord] = []  # saves and their storage writes in flight
        self._bad_pages: set[int] = set()
        self._newly_bad: set[int] = set()  # not yet reported to the scheduler
        self._errors: set[int] = set()
        self._quarantine: set[int] = set()  # host pages a timed-out storage read may write
        self._store_stalled = False  # a storage wait hit its deadline; no job ended since
        self._reads_in_flight: list = []  # those reads (StorageJob)
        self._markers: set = set()  # markers of failed writes in flight (StorageJob)
        self._tables: dict[str, list[int]] = {}  # vLLM's block table of each live request
        self._poisoned = PoisonedBlocks()  # blocks whose content is not their tokens' KV
        self.per_request_loads = per_request_loads
        self._finished_loads: tuple[set[str], set[str]] = (set(), set())  # done, failed
        self.counters = WorkerStats()
        self.held = HeldRequests(config.storage_timeout_s)  # handed off, blocks held by vLLM
        # (pages, seconds) of third-tier reads since the last report, for the scheduler's
        # read-or-recompute decision (scheduler/costs.py); None: not wanted
        self.read_samples: list[tuple[int, float]] | None = (
            [] if self.storage is not None and config.prefetch_policy != "sync"
            and config.prefetch_threshold_tokens is None else None)

    # ------------------------------------------------------------------ steps
    def begin_step(self, plan: StepPlan) -> None:
        """Before this step's loads and forward: block tables follow vLLM's, saves of
        blocks computed in earlier steps start, and saves reading a block reallocated
        now land."""
        self._poll()
        if plan.prefetches:
            self._start_prefetches(plan)
        if plan.held:
            self.held.hold(plan.held)
        tables = self._tables
        for req_id, ids, replace in plan.blocks:
            if replace:
                tables[req_id] = list(ids)
                self._poisoned.forget(req_id)  # computed again from its tokens
            else:
                tables.setdefault(req_id, []).extend(ids)
        if plan.early_saves:
            self._submit_saves(plan.early_saves)
        if self._saves and plan.new_block_ids:
            reused = set(plan.new_block_ids)
            for rec in list(self._saves):
                if rec.handle is not None and not rec.blocks.isdisjoint(reused):
                    rec.handle.wait()
            self._poll()

    def _start_prefetches(self, plan: StepPlan | None) -> None:
        if plan is not None and plan.prefetches and self.prefetch is None:
            raise ValueError("prefetch ops for a worker without a third tier")
        if self.prefetch is not None:
            self.prefetch.take(plan.prefetches if plan is not None else (), lambda pages:
                               free_for_read(pages, self._saves, self._quarantine, self.storage))

    def take_prefetch_progress(self, plan: StepPlan | None = None) -> dict:
        """Prefetch ops whose progress changed since the last call: op id -> (leading
        pages read here, ended here); starts the reads that can start (``plan``: this
        step's, in case ``begin_step`` did not see it)."""
        if self.prefetch is None:
            return {}
        self._poll()
        self._start_prefetches(plan)
        return self.prefetch.progress()

    def start_loads(self, plan: StepPlan) -> None:
        """Read third-tier pages, then start the host -> block copy of every load."""
        if not plan.loads:
            return
        host_ids: list[int] = []
        block_ids: list[int] = []
        c = self.counters
        # The scheduler never loads a page a prefetch still writes; should it, it fails.
        reading = self.prefetch.busy_pages() if self.prefetch is not None else set()
        for op in plan.loads:
            if op.failed_block_ids:
                self._fail_blocks(op.failed_block_ids)
            if len(op.host_pages) != len(op.block_ids) or len(op.storage_keys) > len(
                op.host_pages
            ):
                raise ValueError(
                    f"load of {op.req_id!r}: expected one host page per block and at most as "
                    f"many storage keys, got {len(op.block_ids)} blocks, {len(op.host_pages)} "
                    f"pages, {len(op.storage_keys)} keys"
                )
            num_stored = len(op.storage_keys)
            # Copying out of a host page only waits for copies writing into it.
            self._wait_pages(op.host_pages[: len(op.host_pages) - num_stored], readers=False)
            if op.storage_keys:
                self._read_storage(op.storage_keys, op.host_pages[-num_stored:])
                c.load_storage_blocks += num_stored
            c.load_host_blocks += len(op.host_pages) - len(op.storage_keys)
            for block, page in zip(op.block_ids, op.host_pages, strict=True):
                if page in self._bad_pages or page in reading:
                    self._fail_blocks([block])
                else:
                    host_ids.append(page)
                    block_ids.append(block)
        if block_ids:
            self._load = self.transfers.load(id_tensor(host_ids), id_tensor(block_ids))
            self._load_blocks = block_ids

    @property
    def loading(self) -> bool:
        """A load of this step is in flight (``wait_layer`` may block)."""
        return self._load is not None

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's load of ``layer_name`` landed (no-op without a load)."""
        if self._load is None:
            return
        i = self._layer_index.get(layer_name)
        if i is not None:
            self._load.wait_layer(i)  # a failure is seen when the load is applied

    def end_step(self, plan: StepPlan) -> None:
        """Finish this step's load, follow which blocks now hold wrong KV, then submit
        this step's saves of blocks that hold the right KV (they land later)."""
        if self._load is not None:
            self._load.wait()
            self._poll()
        if self.per_request_loads:
            self._end_request_loads(plan)
        elif plan.loads and self._ranks is not None:  # every rank: the plan is the same
            self._errors = share_load_errors(self._ranks, self._errors)
        if not (plan.loads or plan.saves or self._errors or self._poisoned
                or self._poisoned.tainted):
            return  # most decode steps: nothing moves, nothing to follow
        loaded = [b for op in plan.loads for b in op.block_ids]
        if loaded or self._errors:
            self._poisoned.difference_update(loaded)
            self._poison(self._errors)
            failed = [op.req_id for op in plan.loads if op.failed_block_ids
                      or not self._errors.isdisjoint(op.block_ids)]
            if failed:
                _log.warning("hicache worker: load failed for request(s) %s; vLLM recomputes "
                             "or fails them (kv_load_failure_policy)", failed)
        if self._poisoned or self._poisoned.tainted:
            self._follow_computes(plan.computes)
        if plan.saves:
            self._submit_saves(plan.saves)

    def _end_request_loads(self, plan: StepPlan) -> None:
        """Asynchronous loads (hybrid models): each request's load ended, or failed if
        one of its blocks did. vLLM recomputes or fails such a request before any
        forward reads its blocks, so they poison nothing; each rank reports its own
        (vLLM fails a request that failed on any rank)."""
        errors, self._errors = self._errors, set()
        done, failed = self._finished_loads
        for op in plan.loads:
            broken = op.failed_block_ids or not errors.isdisjoint(op.block_ids)
            (failed if broken else done).add(op.req_id)
            if broken:
                _log.warning("hicache worker: load failed for request %s; vLLM recomputes or "
                             "fails it (kv_load_failure_policy)", op.req_id)

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load ended since the last call, and of those the
        ones whose load failed: ``(done, failed)``, disjoint."""
        done, failed = self._finished_loads
        self._finished_loads = (set(), set())
        return done - failed, failed

    def _submit_saves(self, saves) -> None:
        """Copy blocks to host pages. A save reading a block that holds wrong KV (a load
        into it failed, or it was computed over such a block) is dropped: its pages are
        bad, so they are never served."""
        host_ids: list[int] = []
        block_ids: list[int] = []
        keys: list[str] = []
        write_pages: list[int] = []
        req_ids: set[str] = set()
        busy: set[int] = set()
        if self.storage is not None and (self._saves or self._quarantine):
            deadline = time.monotonic() + self.config.storage_timeout_s
            busy = self._settle_pages([p for op in saves for p in op.host_pages], deadline)
        for op in saves:
            if (self._poisoned and not self._poisoned.isdisjoint(op.block_ids)) or (
                busy and not busy.isdisjoint(op.host_pages)
            ):
                self._mark_bad(op.host_pages)
                self._report_write(op.storage_keys, 0)
                self.counters.save_failed_blocks += len(op.block_ids)
                continue
            host_ids += op.host_pages
            block_ids += op.block_ids
            if op.storage_keys:  # none: pages the tier holds (a gap below a storage hit)
                keys += op.storage_keys
                write_pages += op.host_pages
            req_ids.add(op.req_id)
        if not host_ids:
            return
        self._wait_pages(host_ids)
        handle = self.transfers.backup(id_tensor(block_ids), id_tensor(host_ids))
        self._saves.append(SaveRecord(handle, req_ids, block_ids, host_ids, keys, write_pages))
        self._poll()

    def _poison(self, block_ids) -> None:
        self._poisoned.add_new(block_ids)

    def _follow_computes(self, computes) -> None:
        self._poisoned.follow(computes, self._tables, self.layout.block_size)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Forget the block tables of requests vLLM finished; returns the held requests
        (handed off) whose saves and third-tier writes here ended: vLLM frees their
        blocks (:mod:`~hicache.integrations.vllm.worker.sends`)."""
        for req_id in finished_req_ids:
            self._tables.pop(req_id, None)
            self._poisoned.forget(req_id)
        if not (self.held.num_held or finished_req_ids):
            return set()
        if self.held.num_held:
            self._poll()
        return self.held.ended(finished_req_ids, self._saves)

    def num_writes_in_flight(self) -> int:
        """Third-tier writes not yet ended (at most ``storage_timeout_s`` old)."""
        return num_writes_in_flight(self._saves, self.config.storage_timeout_s)

    def take_poisoned_blocks(self) -> set[int]:
        """Blocks found to hold wrong KV since the last call: the scheduler takes them out
        of vLLM's prefix cache, so that no later request is served them."""
        return self._poisoned.take_new()

    def load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them). Always
        empty with per-request loads (hybrid models): a failed one fails its request at
        the step's end, also where vLLM asks for block errors first (speculative decoding
        defers ``wait_for_save``); with several KV groups vLLM raises on block errors."""
        if self.per_request_loads:
            return set()
        errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> dict | None:
        """Counters since the last call, or None when nothing moved. Steps and hook time
        alone are not worth a report each step: they ride along with the next one."""
        s = vars(self.counters)  # flat numbers: no deep copy (asdict) on every step
        if not any(v for k, v in s.items() if k not in CLOCK_STATS):
            return None
        self.counters = WorkerStats()
        return dict(s)

    def take_bad_pages(self) -> set[int]:
        """Host pages that turned bad since the last call: the scheduler stops promising
        them and has the next request that computes those blocks save them again."""
        bad, self._newly_bad = self._newly_bad, set()
        return bad

    # ------------------------------------------------------------- internals
    def _mark_bad(self, pages) -> None:
        self._bad_pages.update(pages)
        self._newly_bad.update(pages)

    def _mark_good(self, pages) -> None:
        self._bad_pages.difference_update(pages)
        self._newly_bad.difference_update(pages)

    def _fail_blocks(self, block_ids) -> None:
        self._errors.update(block_ids)
        self.counters.load_failed_blocks += len(block_ids)

    def _poll(self) -> None:
        """Apply finished transfers and storage writes."""
        c = self.counters
        for handle in self.transfers.poll():
            if handle is self._load:
                self._load = None
                if handle.error is not None:
                    self._fail_blocks(self._load_blocks)
                else:
                    c.load_blocks += handle.num_pages
                    c.load_bytes += handle.nbytes
                    c.load_seconds += handle.seconds or 0.0
                self._load_blocks = []
                continue
            rec = next(r for r in self._saves if r.handle is handle)
            rec.handle = None
            if handle.error is not None:
                c.save_failed_blocks += handle.num_pages
                self._mark_bad(rec.host_pages)
                self._report_write(rec.keys, 0)
                self._saves.remove(rec)
                continue
            c.save_blocks += handle.num_pages
            c.save_bytes += handle.nbytes
            c.save_seconds += handle.seconds or 0.0
            self._mark_good(rec.host_pages)
            if self.storage is not None and rec.keys:
                from hicache.storage.worker import StorageJob

                rec.job = self.storage.submit(
                    StorageJob("write", self._salted(rec.keys), id_tensor(rec.write_pages))
                )
            else:
                self._saves.remove(rec)
        self._apply_storage_jobs()

    # ------------------------------------------------------------ inspection
    @property
    def num_in_flight(self) -> int:
        """Saves (and their storage writes) not yet landed; loads never outlive a step."""
        return (len(self._saves) + (self._load is not None) + len(self._reads_in_flight)
                + (self.prefetch.num_reading if self.prefetch is not None else 0))

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until every copy in flight has landed and been applied."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight:
            for rec in list(self._saves):
                rec.wait(max(0.0, deadline - time.monotonic()))
            if self._load is not None:
                self._load.wait()
            for job in self._reads_in_flight:
                job.done.wait(max(0.0, deadline - time.monotonic()))
            if self.prefetch is not None:
                self.prefetch.wait(max(0.0, deadline - time.monotonic()))
            self._poll()
            self._start_prefetches(None)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.num_in_flight} copies still in flight")

    def close(self, timeout_s: float = 60.0) -> None:
        """Let what is in flight land (a hung store: at most ``timeout_s``, then left
        behind), then stop the copy threads and the storage tier."""
        if self.transfers.executor_name != "manual":
            try:
                self.drain(timeout_s)
            except TimeoutError as e:
                _log.warning("hicache worker: closing with %s", e)
        self.transfers.close()
        if self.storage is not None:
            self.storage.close()

