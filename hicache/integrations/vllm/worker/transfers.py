"""How a worker half builds its transfer engine: executor, block copier, injected faults.

The executor comes from :func:`~hicache.integrations.vllm.worker.executor_choice.choose_executor`;
on CPU the copies go through a :class:`~hicache.integrations.vllm.worker.layout.BlockCopier`
(wrapped by a test's ``copier_hook``), on CUDA through the executor's copy streams.
With ``HICACHE_FAULTS`` set, the copier and the storage backend fail at the
configured rates (fault-injection runs only).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.tp import RankGroup
from hicache.integrations.vllm.worker.executor_choice import (
    choose_executor,
    thread_count_warning,
)
from hicache.integrations.vllm.worker.faults import ENV as FAULTS_ENV
from hicache.integrations.vllm.worker.faults import FaultRates, FaultyBackend, FaultyCopier
from hicache.integrations.vllm.worker.layout import BlockCopier, BlockLayout, BlockPool
from hicache.memory import HostPool
from hicache.transfer import TransferEngine
from hicache.transfer.base import LayerCopier

_log = logging.getLogger("hicache.integrations.vllm.worker")


def build_transfers(
    config: ConnectorConfig,
    layout: BlockLayout,
    host_pool: HostPool,
    rank_group: RankGroup | None,
    *,
    storage_backend: Any = None,
    native: bool | None = None,
    copier_hook: Any = None,
) -> tuple[TransferEngine, Any]:
    """The transfer engine between ``layout``'s blocks and ``host_pool``, and the
    storage backend to use (``storage_backend``, wrapped when faults are injected).

    Raises ValueError when the CUDA executor is chosen for a layout it cannot copy.
    """
    pool = BlockPool(layout, host_pool.kv)
    threads = thread_count_warning(layout.device.type, torch.get_num_threads())
    if threads is not None and (rank_group is None or rank_group.rank == 0):
        _log.warning(threads)
    executor, copy_cpus, detected = choose_executor(config, layout.device.type, rank_group)
    copier: LayerCopier | None = None
    if executor == "cuda":
        if pool.k_buffers is None:
            raise ValueError(
                "kv caches: the CUDA executor copies the split K/V layout (2, num_blocks, "
                f"...); got {layout.planes_per_layer} plane(s) per block"
            )
    else:
        copier = BlockCopier(layout, host_pool, native=native, max_threads=1)
        if copier_hook is not None:
            copier = copier_hook(copier)
    faults = FaultRates.from_env(rank_group.rank if rank_group is not None else 0)
    if faults is not None:
        _log.warning("hicache worker: %s set, injecting faults %s", FAULTS_ENV, faults)
        if copier is not None:
            copier = FaultyCopier(copier, faults)
        if storage_backend is not None:
            storage_backend = FaultyBackend(storage_backend, faults)
    try:
        transfers = TransferEngine(pool, host_pool, executor, copier=copier,
                                   copy_cpus=copy_cpus)
    except ValueError:
        if not detected:
            raise
        # The spare cores are outside this process's cpuset (taskset, containers).
        transfers = TransferEngine(pool, host_pool, "sync", copier=copier)
    cpus = getattr(transfers.executor, "cpus", None)
    _log.info("hicache worker: %s executor%s, %d host pages of %d bytes",
              transfers.executor_name, f" on CPUs {sorted(cpus)}" if cpus else "",
              host_pool.num_pages, host_pool.page_nbytes)
    return transfers, storage_backend
