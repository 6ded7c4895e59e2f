"""The worker half's counters: what one vLLM worker copied, stored and spent.

Reported as deltas through vLLM's connector stats (summed over tensor-parallel ranks,
see :mod:`~hicache.integrations.vllm.stats`), named as :mod:`~hicache.integrations.vllm.prom`
exports them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerStats:
    """Counters of one worker since the last :meth:`WorkerHalf.take_stats`."""

    load_blocks: int = 0  # blocks loaded into vLLM's KV
    load_host_blocks: int = 0  # of which found in host memory
    load_storage_blocks: int = 0  # of which read from the third tier first
    load_failed_blocks: int = 0  # reported through get_block_ids_with_load_errors
    load_bytes: int = 0
    load_seconds: float = 0.0
    save_blocks: int = 0
    save_failed_blocks: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0
    storage_read_bytes: int = 0
    storage_read_seconds: float = 0.0
    storage_write_bytes: int = 0
    storage_write_seconds: float = 0.0
    storage_errors: int = 0
    storage_timeouts: int = 0  # reads that did not finish within storage_timeout_s
    steps: int = 0  # vLLM steps (wait_for_save calls)
    hook_seconds: float = 0.0  # spent in the connector's worker-side hooks (copies too)
    hook_cpu_seconds: float = 0.0  # of which the model runner's thread was on a core


# Counted every step: alone, not worth a report (they ride along with the next one).
CLOCK_STATS = ("steps", "hook_seconds", "hook_cpu_seconds")
