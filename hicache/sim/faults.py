"""Fault and delay injection for the CPU executors, and a probe of evictions held back by IO.

Test hooks, not features of the engine: :class:`FaultyCopier` wraps the executor's
:class:`~hicache.memory.PageCopier` and :func:`install_copier` puts it in place (the
thread and manual executors call their copier's ``load``/``backup`` for every layer
range they move); :class:`EvictionProbe` wraps one tree's ``evict_device`` to count
device evictions during which an idle device leaf (unlocked, no device child) could
not be taken because its IO was in flight, and that made the eviction come up short
or take a more recently used node instead.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from hicache.cache import HiCache
from hicache.transfer import ManualExecutor, ThreadExecutor
from hicache.transfer.base import LayerCopier
from hicache.tree import IOStatus, TreeNode


class InjectedFault(RuntimeError):
    """A copy failure injected by :class:`FaultyCopier`."""


class FaultyCopier:
    """A page copier that sleeps a random time before each copy and sometimes fails.

    ``fault_rate`` is the probability that one ``load``/``backup`` call (one layer
    of a transfer on the thread executor) raises :class:`InjectedFault` instead of
    copying; earlier layers of the same transfer have landed, later ones will not.
    A worker and a caller blocked in ``wait`` may copy (different transfers) at the
    same time, so the RNGs and counters are guarded by a lock.
    """

    def __init__(self, inner: LayerCopier, seed: int, fault_rate: float = 0.0,
                 max_delay_s: float = 0.0) -> None:
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"fault_rate: expected 0 <= rate <= 1, got {fault_rate}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s: expected >= 0, got {max_delay_s}")
        self.inner = inner
        self.fault_rate = fault_rate
        self.max_delay_s = max_delay_s
        self._rng = {"load": random.Random(seed * 2 + 1), "backup": random.Random(seed * 2 + 2)}
        self.num_faults = {"load": 0, "backup": 0}
        self._lock = threading.Lock()

    @classmethod
    def wrap(cls, cache: HiCache, seed: int, fault_rate: float = 0.0,
             max_delay_s: float = 0.0) -> FaultyCopier:
        """A FaultyCopier around ``cache``'s current copier (install it with install_copier)."""
        return cls(_executor(cache)._copier, seed, fault_rate, max_delay_s)

    @property
    def faults_injected(self) -> int:
        return self.num_faults["load"] + self.num_faults["backup"]

    def _before(self, direction: str) -> None:
        with self._lock:
            rng = self._rng[direction]
            delay_s = rng.uniform(0.0, self.max_delay_s) if self.max_delay_s else 0.0
            fault = bool(self.fault_rate) and rng.random() < self.fault_rate
            if fault:
                self.num_faults[direction] += 1
        if delay_s:
            time.sleep(delay_s)
        if fault:
            raise InjectedFault(f"injected {direction} fault")

    def load(self, host_ids: torch.Tensor, device_ids: torch.Tensor, first: int, last: int):
        self._before("load")
        self.inner.load(host_ids, device_ids, first, last)

    def backup(self, device_ids: torch.Tensor, host_ids: torch.Tensor, first: int, last: int):
        self._before("backup")
        self.inner.backup(device_ids, host_ids, first, last)


def _executor(cache: HiCache) -> ThreadExecutor | ManualExecutor:
    ex = cache.transfers.executor
    if not isinstance(ex, ThreadExecutor | ManualExecutor):
        raise ValueError(
            f"copier hook: expected the 'thread' or 'manual' executor, got {cache.transfers.executor_name!r}"
        )
    return ex


def install_copier(cache: HiCache, copier: FaultyCopier) -> FaultyCopier:
    """Make ``cache``'s CPU executor move pages through ``copier`` from now on (test hook)."""
    _executor(cache)._copier = copier
    return copier


class EvictionProbe:
    """Counts device evictions held back by IO in flight (see the module docstring).

    Wraps ``cache.tree.evict_device`` on this one tree instance; scans the tree
    before and after each eviction, so it is for stress runs, not production.
    """

    def __init__(self, cache: HiCache) -> None:
        self.tree = cache.tree
        self.num_evictions = 0
        self.num_blocked_by_io = 0
        self._evict = cache.tree.evict_device
        # An instance attribute shadows the method on this one tree only.
        self.tree.__dict__["evict_device"] = self._probe

    def _device_leaves(self) -> tuple[list[TreeNode], dict[TreeNode, int]]:
        busy, on_device = [], {}
        for node in self.tree.nodes():
            if node.device_indices is None:
                continue
            on_device[node] = node.last_access
            if node.io_status is not IOStatus.NONE and not node.lock_ref and not any(
                c.device_indices is not None for c in node.children.values()
            ):
                busy.append(node)
        return busy, on_device

    def _probe(self, num_tokens, backup=None):
        busy, before = self._device_leaves()
        result = self._evict(num_tokens, backup)
        self.num_evictions += 1
        if busy:
            short = result.num_evicted_tokens + result.num_backup_tokens < num_tokens
            newest_taken = max(
                (t for n, t in before.items() if n.device_indices is None
                 or n.io_status is IOStatus.BACKING_UP and n not in busy),
                default=-1,
            )
            if short or min(n.last_access for n in busy) < newest_taken:
                self.num_blocked_by_io += 1
        return result
