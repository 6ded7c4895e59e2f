"""Asynchronous page transfers between the device pool and the host pool.

``load`` copies host pages to device pages layer by layer; ``backup`` copies device
pages to host pages, all layers. Both return a :class:`~hicache.transfer.base.Transfer`
at once. The cache learns about completions only by calling :meth:`TransferEngine.poll`
from its own thread: worker threads never call back into cache code, so the cache
needs no locks. Until ``poll`` has reported a transfer, its source and destination
pages must stay allocated (the caller's IO locks), and the transfer keeps its page
id tensors alive.

Ordering rules (the bugs the field shipped)::

    compute stream:  ...write KV of pages P...  [fence]      ...wait_layer(i)... read layer i
    backup stream:                               wait fence -> read P -> host
    load stream:     wait work queued so far -> host -> device, event per layer ---^

* a backup reads device pages only after its fence (``after=engine.compute_fence()``,
  default: the work already queued on the current stream) has passed;
* a load writes device pages only after the work already queued on the current
  stream (which may still read the pages' previous contents) has finished;
* the model calls ``transfer.wait_layer(i)`` before reading layer ``i``; on CUDA this
  makes the current stream wait on the layer's event, the host does not block.

Executors: ``"cuda"`` (two side streams, events; :mod:`hicache.transfer.cuda`),
``"thread"`` (one worker thread per direction, for CPU-only machines), ``"sync"``
(the submitting thread copies at submission: for callers whose cores all compute
while a copy thread could run), ``"manual"`` (tests: nothing moves until the test
completes a layer; the copy happens at that moment), ``"immediate"`` (bookkeeping
only: completes at submission, copies nothing, pools may be None); the last four in
:mod:`hicache.transfer.executors`.

A failed transfer reports ``error``; its destination pages hold garbage (layers
completed before the failure were written, later ones were not) and the caller
frees them. Sources are only ever read. This package knows pools and page ids; it
does not know the tree, the allocators or which pages are in use.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

import torch

from hicache.checks import check_page_ids, check_page_tensor
from hicache.memory.copier import PageCopier
from hicache.memory.pools import DevicePages, DevicePool, HostPool
from hicache.transfer.base import CudaFence, Executor, Fence, LayerCopier, Transfer, TransferKind
from hicache.transfer.cuda import CudaExecutor
from hicache.transfer.executors import (
    ImmediateExecutor,
    ManualExecutor,
    SyncExecutor,
    ThreadExecutor,
)

_log = logging.getLogger(__name__)

_CPU_EXECUTORS = {"thread": ThreadExecutor, "sync": SyncExecutor, "manual": ManualExecutor}


class TransferEngine:
    """Submits loads and backups between one device pool and one host pool.

    ``executor``: ``"auto"`` (cuda if the device pool is on CUDA, else thread),
    ``"cuda"``, ``"thread"``, ``"sync"``, ``"manual"`` or ``"immediate"``. ``native`` chooses the
    CPU copy kernel (see :mod:`hicache.memory.copier`): None tries the native one and falls
    back to torch gather/scatter. ``copier`` replaces the CPU executors' page copier
    (anything with :class:`~hicache.memory.PageCopier`'s ``load``/``backup``): the vLLM
    connector copies between vLLM's own KV tensors and a host pool this way.
    ``copy_cpus`` (thread executor only): the CPUs its copy threads are pinned to.
    """

    def __init__(
        self,
        device_pool: DevicePages | None,
        host_pool: HostPool | None,
        executor: str = "auto",
        *,
        native: bool | None = None,
        copier: LayerCopier | None = None,
        copy_cpus: Collection[int] | None = None,
    ) -> None:
        if executor == "auto":
            on_cuda = device_pool is not None and device_pool.device.type == "cuda"
            executor = "cuda" if on_cuda else "thread"
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.executor_name = executor
        if executor == "immediate":
            self.executor: Executor = ImmediateExecutor()
        else:
            if device_pool is None or host_pool is None:
                raise ValueError(f"executor {executor!r}: expected both pools, got None")
            if device_pool.kv != host_pool.kv:
                raise ValueError(
                    f"pools: expected the same KVConfig, got {device_pool.kv} and {host_pool.kv}"
                )
            if executor == "cuda":
                self.executor = CudaExecutor(device_pool, host_pool)
            elif executor in _CPU_EXECUTORS:
                if copier is None:
                    if not isinstance(device_pool, DevicePool):
                        raise TypeError(
                            "copier: expected one for a device pool other than a DevicePool, "
                            f"got none for a {type(device_pool).__name__}"
                        )
                    copier = PageCopier(device_pool, host_pool, native=native)
                if copy_cpus is not None and executor != "thread":
                    raise ValueError(
                        f"copy_cpus: pins the thread executor's threads, got executor {executor!r}"
                    )
                extra = {} if copy_cpus is None else {"cpus": copy_cpus}
                self.executor = _CPU_EXECUTORS[executor](copier, **extra)
            else:
                raise ValueError(
                    "executor: expected 'auto', 'cuda', 'thread', 'sync', 'manual' or "
                    f"'immediate', got {executor!r}"
                )
        pool = device_pool or host_pool
        kv = pool.kv if pool is not None else None
        self._num_layers = kv.num_layers if kv else 1
        self._page_nbytes = kv.page_nbytes if kv else 0
        self._drive = self.executor.driver()
        self._count_lock = threading.Lock()  # submissions may come from several threads
        self._num_unreported = 0
        # Called with each transfer poll() reports, on the polling thread (hicache.metrics).
        self.on_complete: list[Callable[[Transfer], None]] = []

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted whose completion :meth:`poll` has not reported yet."""
        return self._num_unreported

    def compute_fence(self) -> Fence | CudaFence:
        """A fence that passes once the compute submitted so far has finished."""
        return self.executor.compute_fence()

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> Transfer:
        """Copy ``host_pages[j]`` to ``device_pages[j]`` for every j, layer by layer."""
        return self._submit(TransferKind.LOAD, host_pages, device_pages, None)

    def backup(
        self,
        device_pages: torch.Tensor,
        host_pages: torch.Tensor,
        after: Fence | CudaFence | None = None,
    ) -> Transfer:
        """Copy ``device_pages[j]`` to ``host_pages[j]`` for every j, all layers.

        Nothing is read before ``after`` has passed (default: on CUDA the work queued
        on the current stream so far; elsewhere, nothing to wait for).
        """
        if after is not None and not isinstance(after, Fence | CudaFence):
            raise TypeError(f"after: expected a fence from compute_fence(), got {after!r}")
        return self._submit(TransferKind.BACKUP, host_pages, device_pages, after)

    def poll(self) -> list[Transfer]:
        """Transfers finished (or failed) since the last poll, in completion order, each once."""
        done = self.executor.poll()
        with self._count_lock:
            self._num_unreported -= len(done)
        for transfer in done:
            if transfer.error is not None:
                _log.warning("%s of %d pages failed: %r", transfer.kind.value,
                             transfer.host_pages.numel(), transfer.error)
            for observe in self.on_complete:
                observe(transfer)
        return done

    def close(self) -> None:
        """Finish submitted work and stop the workers."""
        self.executor.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(
        self, kind: TransferKind, host_pages: torch.Tensor, device_pages: torch.Tensor,
        fence: Fence | CudaFence | None,
    ) -> Transfer:
        self._check_ids(host_pages, device_pages)
        transfer = Transfer(
            kind, host_pages, device_pages, self._num_layers,
            host_pages.numel() * self._page_nbytes, self._drive, fence,
        )
        with self._count_lock:
            self._num_unreported += 1
        self.executor.submit(transfer)
        return transfer

    def _check_ids(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        if self.host_pool is None or self.device_pool is None:
            # No pools, no range to check (immediate bookkeeping): the form only.
            check_page_tensor("host_pages", host_pages)
            check_page_tensor("device_pages", device_pages)
        else:
            check_page_ids("host_pages", host_pages, self.host_pool.num_pages)
            check_page_ids("device_pages", device_pages, self.device_pool.num_pages)
        if host_pages.numel() != device_pages.numel():
            raise ValueError(
                "page ids: expected equal lengths, got "
                f"{host_pages.numel()} host and {device_pages.numel()} device pages"
            )
