"""Asynchronous copies between device and host pools: transfers, fences, executors, the engine.

Nothing here knows prefixes: a transfer moves page ids between two pools.
"""

from hicache.transfer.engine import (
    ManualExecutor,
    ManualFence,
    ThreadExecutor,
    TransferEngine,
    TransferHandle,
    TransferKind,
    host_runs,
    layer_load_plan,
)

__all__ = [
    "ManualExecutor",
    "ManualFence",
    "ThreadExecutor",
    "TransferEngine",
    "TransferHandle",
    "TransferKind",
    "host_runs",
    "layer_load_plan",
]
