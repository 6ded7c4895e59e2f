"""Which executor copies a worker's blocks, and on which cores (``executor: auto``).

On a GPU the CUDA executor (copy streams). On CPU, vLLM's worker binds one compute
thread to each of its cores, and a thread the connector starts inherits the model
runner's single-core affinity: a copy thread left there can only preempt a compute
thread, and the others then wait for it at the next barrier of the forward (measured
on 2 cores: decode steps ~10% slower while saving). So copy threads go to the cores
vLLM keeps off its workers (for the scheduler and KV connectors) and copy while the
forward runs; with none, ``sync`` copies between two forwards, in the model runner's
thread. With tensor parallelism those cores are shared out, one per rank
(:func:`~hicache.integrations.vllm.common.tp.rank_copy_cpus`).

This module only decides; the worker half builds the executor.

A KV connector also changes how many threads vLLM's CPU worker computes on: unless
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set, vLLM reserves one more core when one is
configured (for the connector's threads), so vLLM alone and vLLM with hicache compute
on different numbers of threads, and in reduced precision that alone changes greedy
replies. :func:`thread_count_warning` says so at start-up (docs/vllm.md, "Which replies
are identical, and to what").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.tp import RankGroup, rank_copy_cpus
from hicache.transfer.affinity import spare_cpus


class ExecutorChoice(NamedTuple):
    name: str  # "cuda", "thread", "sync" (or what the config names)
    copy_cpus: frozenset[int] | None  # cores of the copy threads (None: unpinned)
    detected: bool  # copy_cpus were found here, not configured: "sync" if unusable


def choose_executor(config: ConnectorConfig, device_type: str,
                    group: RankGroup | None = None) -> ExecutorChoice:
    """The executor for ``config.executor`` on a ``device_type`` ("cuda", "cpu") worker.
    ``group``: this engine's tensor-parallel ranks; every rank must call this (it
    exchanges the ranks' compute cores) when ``auto`` looks for spare cores."""
    executor = config.executor
    copy_cpus = None if config.copy_cpus is None else frozenset(config.copy_cpus)
    if executor != "auto":
        return ExecutorChoice(executor, copy_cpus, False)
    if device_type == "cuda":
        return ExecutorChoice("cuda", copy_cpus, False)
    if copy_cpus is not None:
        return ExecutorChoice("thread", copy_cpus, False)
    spare = rank_copy_cpus(group) if group is not None else spare_cpus()
    if not spare:
        return ExecutorChoice("sync", None, False)
    return ExecutorChoice("thread", frozenset(spare), True)


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def thread_count_warning(device_type: str, num_threads: int,
                         environ: Mapping[str, str] = os.environ) -> str | None:
    """The start-up warning of a CPU worker computing on ``num_threads`` threads whose
    count vLLM chose with a KV connector configured (``VLLM_CPU_NUM_OF_RESERVED_CPU``
    unset); None on GPU or when the variable pins the count for both."""
    if device_type != "cpu" or RESERVED_CPU_ENV in environ:
        return None
    return (f"hicache worker: vLLM computes on {num_threads} thread(s) here; with a KV "
            f"connector configured its CPU backend keeps one more core off the worker than "
            f"without ({RESERVED_CPU_ENV} unset), so vLLM alone may compute on another "
            "number of threads, and in bfloat16 or float16 that alone changes some greedy "
            f"replies; set {RESERVED_CPU_ENV} to the same value with and without hicache to "
            "compare replies (docs/vllm.md, 'Which replies are identical, and to what')")
