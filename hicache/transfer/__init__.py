"""Asynchronous copies between device and host pools: transfers, fences, executors, the engine.

Nothing here knows prefixes: a transfer moves page ids between two pools. ``base``
holds the submitted :class:`Transfer`, its fences and the executor interface;
``executors`` the CPU executors; ``cuda`` the CUDA executor; ``engine`` the
:class:`TransferEngine` that callers submit to.
"""

from hicache.transfer.base import ManualFence, Transfer, TransferKind
from hicache.transfer.cuda import host_runs, layer_load_plan
from hicache.transfer.engine import TransferEngine
from hicache.transfer.executors import ManualExecutor, ThreadExecutor

__all__ = [
    "ManualExecutor",
    "ManualFence",
    "ThreadExecutor",
    "Transfer",
    "TransferEngine",
    "TransferKind",
    "host_runs",
    "layer_load_plan",
]
