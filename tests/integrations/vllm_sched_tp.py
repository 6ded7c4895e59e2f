"""vLLM's scheduler driving HiCacheConnector over tensor-parallel ranks, without a model.

As :class:`vllm_sched.Engine`, with ``tp`` worker connectors, one per rank, each with
its own KV tensors, host pool, rank-salted third-tier keys (the rank salt vLLM's worker
would get) and fault injector. They share load errors through an in-process rank group
(threads meeting at a barrier, in place of vLLM's gloo group), so the hook that
exchanges them (``wait_for_save``) runs on every rank at once, one thread per rank, as
vLLM's worker processes do. Every rank's step output goes through vLLM's own
``KVOutputAggregator`` (as vLLM's multiprocess executor does) before the scheduler
sees it: load errors, bad host pages and poisoned blocks are the union over ranks.

The "model" is vllm_sched's, sharded: rank ``r``'s KV of a token is its prefix value
plus ``r * RANK_OFFSET``, and a token is computed right only when *every* rank read
right KV (attention outputs are all-reduced over the ranks): wrong KV on one rank
makes what every rank computes wrong. Checks: vllm_sched's, for every rank (reads,
host pages), and :meth:`TPEngine.storage_errors`: every page the third tier holds
under a rank's keys is that rank's shard of the right KV.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm_sched import LAYERS, POISON, B, D, Engine, Faults, H, prefix_values

from hicache.tree import token_key

RANK_OFFSET = 10_000_000.0


class ThreadRanks:
    """An in-process rank group: rank ``r``'s member (:meth:`member`) is a
    ``hicache.integrations.vllm.common.tp.RankGroup`` for a thread playing rank ``r``."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=30)
        self._slots: list[Any] = [None] * world_size
        self.num_gathers = 0  # all_gather rounds completed (counted by rank 0)

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)


@dataclass
class _Member:
    ranks: ThreadRanks
    rank: int

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def all_gather(self, obj: Any) -> list[Any]:
        r = self.ranks
        r._slots[self.rank] = obj
        r._barrier.wait()
        out = list(r._slots)
        r._barrier.wait()  # nobody writes the next round's slot before all have read
        if self.rank == 0:
            r.num_gathers += 1
        return out


def on_ranks(fns) -> None:
    """Run ``fns`` (one per rank) at once, one thread each; re-raise the first error."""
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hangs in a collective"


def gloo_rank(rank: int, path: str, out: str) -> None:
    """Rank ``rank`` of a 2-process gloo group (``torch.multiprocessing`` child): shares
    its load errors (rank 1 has one, block ``11``) and writes the union to ``out.RANK``."""
    import json

    import torch.distributed as dist

    from hicache.integrations.vllm.common.tp import TorchRankGroup, share_load_errors

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        errors = share_load_errors(TorchRankGroup(dist.group.WORLD, rank, 2),
                                   {10 + rank} if rank else set())
        with open(f"{out}.{rank}", "w") as f:
            json.dump(sorted(errors), f)
    finally:
        dist.destroy_process_group()


@dataclass
class TPEngine(Engine):
    """vLLM's scheduler and ``tp`` worker connectors (ranks), stepped by hand."""

    tp: int = 2
    share_load_errors: bool = True  # False: the ranks do not exchange (the bug it fixes)

    def __post_init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from hicache.integrations.vllm import HiCacheConnector
        from hicache.integrations.vllm.common.keys import rank_salt
        from hicache.integrations.vllm.worker.half import WorkerHalf

        self.parallel = {**(self.parallel or {}), "tensor_parallel_size": self.tp}
        super().__post_init__()
        self.worker.worker_half.close()  # the base's single rank: rebuilt as rank 0
        self.ranks = ThreadRanks(self.tp)
        self.workers, self.kvs, self.rank_faults = [], [], []
        for r in range(self.tp):
            kv = {name: torch.zeros(self.num_blocks, H, B, 2 * D) for name in LAYERS}
            w = self.worker if r == 0 else HiCacheConnector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            faults = self.faults if r == 0 else Faults(self.seed + 1000 * r)
            cfg = w.hc_config
            w.worker_half = WorkerHalf(
                cfg, kv, num_blocks=self.num_blocks, block_size=B,
                num_host_pages=w.num_host_pages,
                storage_backend=w._open_storage(),
                key_salt=rank_salt(r, self.tp),
                rank_group=self.ranks.member(r) if self.share_load_errors else None,
                copier_hook=faults,
            )
            if w.worker_half.storage is not None:
                tier = w.worker_half.storage
                tier.backend = faults.wrap_backend(tier.backend)
                if self.kv_events:  # as register_kv_caches does
                    w.worker_half.write_reports = ([], [])
            w._rank = r
            self.workers.append(w)
            self.kvs.append(kv)
            self.rank_faults.append(faults)
        self.kv = self.kvs[0]
        self.aggregator = KVOutputAggregator(expected_finished_count=self.tp)
        self.num_load_steps = 0  # steps whose plan had loads

    # --------------------------------------------------------------- steps
    def _execute(self, out):
        from vllm.v1.outputs import KVConnectorOutput

        self.step_no += 1
        n = self.step_no
        meta = out.kv_connector_metadata
        self.num_load_steps += bool(getattr(meta, "loads", None))
        scheduled = self._follow_tables(out)
        # Before the forward nothing is exchanged: each rank in turn.
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                w.start_load_kv(None)
            for name in LAYERS:
                w.wait_for_layer_load(name)
        reads = self._forward(scheduled)
        if not out.has_sync_kv_loads:
            for w in self.workers:
                w.start_load_kv(None)
        on_ranks([w.wait_for_save for w in self.workers])  # ranks exchange load errors
        outputs = []
        for w in self.workers:
            finished_sending, finished_recving = w.get_finished(out.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            kv_out = KVConnectorOutput(
                finished_sending=finished_sending, finished_recving=finished_recving,
                invalid_block_ids=invalid, kv_connector_worker_meta=w.build_connector_worker_meta(),
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            w.clear_connector_metadata()
            outputs.append(self._runner_output(scheduled, kv_out))
        result = self.aggregator.aggregate(outputs)
        invalid = set(result.kv_connector_output.invalid_block_ids)
        for r, w in enumerate(self.workers):
            self._check_reads(n, [(rid, wrong[r], done) for rid, wrong, done in reads],
                              invalid, w.worker_half._poisoned)
        return result

    def _forward(self, scheduled):
        """Write every rank's KV of every scheduled token; returns, per request, the
        blocks each rank read wrong."""
        for _ in range(len(scheduled) + 1):
            changed = False
            for rid, done, num in scheduled:
                changed |= self._compute(rid, done, num)
            if not changed:
                break
        return [(rid, [self._wrong_blocks_of(r, rid, done) for r in range(self.tp)], done)
                for rid, done, _ in scheduled]

    def _wrong_blocks_of(self, rank: int, rid: str, done: int) -> set[int]:
        if done == 0:
            return set()
        blocks, slots = self._slots(rid, 0, done)
        k = self.kvs[rank][LAYERS[0]]
        got = k[torch.tensor(blocks), 0, torch.tensor(slots), 0].double().numpy()
        want = self._expected(rid, 0, done) + rank * RANK_OFFSET
        return {blocks[i] for i in np.nonzero(got != want)[0]}

    def _wrong_blocks(self, rid: str, done: int) -> set[int]:
        return set().union(*(self._wrong_blocks_of(r, rid, done) for r in range(self.tp)))

    def _compute(self, rid: str, done: int, num: int) -> bool:
        ok = not self._wrong_blocks(rid, done)  # all-reduced: one rank's wrong read is every rank's
        blocks, slots = self._slots(rid, done, done + num)
        b, s = torch.tensor(blocks), torch.tensor(slots)
        changed = False
        for rank, kvs in enumerate(self.kvs):
            values = (self._expected(rid, done, done + num) + rank * RANK_OFFSET if ok
                      else np.full(num, POISON))
            for layer, name in enumerate(LAYERS):
                v = torch.tensor(values + (0 if not ok else 2_000_000 * layer),
                                 dtype=torch.float32)
                if not torch.equal(kvs[name][b, 0, s, 0], v):
                    changed = True
                kvs[name][b, :, s, :] = v[:, None, None]
        return changed

    # -------------------------------------------------------------- checks
    def host_page_errors(self) -> list[str]:
        """Every rank's host pages that the scheduler's tree offers and that do not hold
        that rank's shard of their prefix's KV."""
        half = self.connector.scheduler_half
        errors = []
        for rank, w in enumerate(self.workers):
            pool = w.worker_half.host_pool
            seen: set[int] = set()
            for tokens in self.sequences:
                key = token_key(np.asarray(tokens), B)
                num_pages = half.tree.probe_key(key) // B
                if not num_pages:
                    continue
                path = half.tree.probe_path(key)
                pages = torch.cat([nd.host_indices for nd in path]).tolist()[:num_pages]
                values = prefix_values(tokens) + rank * RANK_OFFSET
                for i, page in enumerate(pages):
                    if page in seen or page in half._bad:
                        continue
                    seen.add(page)
                    got = pool.buffer[page].reshape(len(LAYERS), H, B, 2 * D)[0, 0, :, 0]
                    if not np.array_equal(got.double().numpy(), values[i * B:(i + 1) * B]):
                        errors.append(f"rank {rank}: host page {page} (page {i} of a "
                                      f"{len(tokens)}-token sequence) holds wrong KV")
        return errors

    def storage_errors(self) -> list[str]:
        """Pages the third tier holds under a rank's keys that are not that rank's shard
        of their prefix's KV (every sequence this engine saw, every rank)."""
        from hicache.integrations.vllm.common.keys import rank_salt, salt_keys
        from hicache.integrations.vllm.scheduler.requests import RequestState

        half = self.connector.scheduler_half
        backend = self.worker._open_storage()  # not a rank's, which may inject faults
        pool = self.worker.worker_half.host_pool
        errors = []
        for tokens in self.sequences:
            st = RequestState(tokens, None)
            keys = half._keys(st, len(tokens) // B)
            values = prefix_values(tokens)
            for rank in range(self.tp):
                salted = salt_keys(keys, rank_salt(rank, self.tp))
                num = backend.exists(salted)
                if not num:
                    continue
                pages = torch.zeros(num, *pool.buffer.shape[1:])
                for i in range(backend.get_into(salted[:num], list(pages))):
                    got = pages[i].reshape(len(LAYERS), H, B, 2 * D)[0, 0, :, 0].double().numpy()
                    if not np.array_equal(got, values[i * B:(i + 1) * B] + rank * RANK_OFFSET):
                        errors.append(f"rank {rank}: stored page {i} of a {len(tokens)}-token "
                                      "sequence holds wrong KV")
        backend.close()
        return errors

    def quiesce(self) -> None:
        """Finish the last async update, land every rank's copies, hand the union of their
        bad pages to the scheduler (as vLLM's aggregator would)."""
        from vllm.v1.outputs import KVConnectorOutput

        from hicache.integrations.vllm.connector import HiCacheWorkerMetadata

        self.update_held()
        bad: set[int] = set()
        prefetch: dict[int, dict[int, tuple[int, bool]]] = {}
        for r, w in enumerate(self.workers):
            w.worker_half.drain()
            for op_id, state in w.worker_half.take_prefetch_progress().items():
                prefetch.setdefault(op_id, {})[r] = state
            bad |= w.worker_half.take_bad_pages()
        if bad or prefetch:
            self.connector.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=HiCacheWorkerMetadata(bad_host_pages=bad,
                                                               prefetch=prefetch)))

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()

    def check(self) -> None:
        super().check()
        for w in self.workers[1:]:
            if not self.scheduler.has_requests():
                assert w.worker_half.num_in_flight == 0
                assert not w.worker_half._tables, "a block table leaked"
