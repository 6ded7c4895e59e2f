"""What every part of the transfer engine shares: a submitted copy, fences, the executor API.

A :class:`Transfer` is one load (host to device, layer by layer) or backup (device to
host, all layers) that :class:`hicache.transfer.engine.TransferEngine` returned at
submission. Its state is read by the caller and changed only by the executor that
moves its data (:mod:`hicache.transfer.executors` on the CPU,
:mod:`hicache.transfer.cuda` on CUDA); an :class:`Executor` reports finished transfers
only through :meth:`Executor.poll`, on the polling thread. A backup reads nothing before
its fence has passed: a host :class:`Fence`, or a :class:`CudaFence` recorded on the
compute stream. Nothing here knows pools' layouts, streams' order or prefixes.
"""

from __future__ import annotations

import collections
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import Protocol

import torch

from hicache.checks import check_int


class TransferKind(str, Enum):
    """Which way a transfer copies."""

    LOAD = "load"  # host -> device
    BACKUP = "backup"  # device -> host


class Fence:
    """Host-side fence: a backup waiting on it copies nothing until :meth:`set`.

    ``engine.compute_fence()`` returns one already set on CPU executors (compute
    there is synchronous); tests make an unset ``ManualFence`` and set it later.
    """

    def __init__(self, is_set: bool = False) -> None:
        self._event = threading.Event()
        if is_set:
            self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


ManualFence = Fence


class CudaFence:
    """An event recorded on the compute stream; the backup stream waits on it."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def is_set(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout: float | None = None) -> bool:
        self.event.synchronize()
        return True




class LayerCopier(Protocol):
    """What the CPU executors copy pages with: :class:`hicache.memory.PageCopier`, the
    vLLM connector's block copier, or a test's wrapper around one. Layers ``first ..
    last-1`` of each page; called from the executors' threads."""

    def load(
        self, host_ids: torch.Tensor, device_ids: torch.Tensor, first: int, last: int
    ) -> None: ...
    def backup(
        self, device_ids: torch.Tensor, host_ids: torch.Tensor, first: int, last: int
    ) -> None: ...


class DeviceEvents(Protocol):
    """What the CUDA executor (:mod:`hicache.transfer.cuda`) attaches to a transfer it
    runs: the transfer's progress, read from its stream events."""

    def check(self, transfer: Transfer) -> bool: ...
    def wait(self, transfer: Transfer, timeout: float | None) -> bool: ...
    def wait_layer(self, transfer: Transfer, i: int) -> bool: ...


class Transfer:
    """One submitted load or backup (a copy in flight, not a request's prefix: that is
    :class:`hicache.PrefixHandle`). Read its state; only the engine changes it.

    ``host_pages`` and ``device_pages`` are the int64 CPU id tensors given at
    submission, kept alive here until completion. ``layers_done`` counts layers
    whose data has reached the destination; ``seconds`` is the copy time, set at
    completion; ``error`` is set if the transfer failed.
    """

    __slots__ = (
        "kind", "host_pages", "device_pages", "num_layers", "nbytes", "error", "seconds",
        "layers_done", "fence", "_finished", "_drive", "_cuda", "_next_layer", "_busy",
        "_queued", "_wake_at", "_started", "__weakref__",
    )

    def __init__(
        self,
        kind: TransferKind,
        host_pages: torch.Tensor,
        device_pages: torch.Tensor,
        num_layers: int,
        nbytes: int,
        drive: DriveFn | None,
        fence: Fence | CudaFence | None = None,
    ) -> None:
        self.kind = kind
        self.host_pages = host_pages
        self.device_pages = device_pages
        self.num_layers = num_layers
        self.nbytes = nbytes
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.layers_done = 0
        self.fence = fence
        self._finished = False
        # The thread executor's ThreadExecutor.drive; None: no other thread changes the state.
        self._drive = drive
        self._cuda: DeviceEvents | None = None  # its events on the CUDA executor
        # Thread executor bookkeeping, guarded by its condition: the next layer nobody has
        # claimed, whether a thread is copying a layer now, the layers_done value at which
        # a blocked thread wants to be woken, and when the first layer was claimed.
        # _busy: a thread has claimed this transfer and copies its layers one by one;
        # _queued: it sits in its worker's queue.
        self._next_layer = 0
        self._busy = False
        self._queued = False
        self._wake_at = num_layers + 1
        self._started: float | None = None

    @property
    def num_pages(self) -> int:
        return self.host_pages.numel()

    def done(self) -> bool:
        """True once the transfer finished, successfully or not."""
        if self._cuda is not None and not self._finished:
            self._cuda.check(self)
        return self._finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until finished or ``timeout`` seconds passed; return :meth:`done`.

        Raises nothing: a failure is reported in ``error``. On the manual executor
        nothing progresses while the test waits, so this only reports the state. On the
        thread executor, without a timeout, the caller copies the layers that no worker
        has started itself (see :class:`hicache.transfer.executors.ThreadExecutor`).
        """
        if self._cuda is not None:
            return self._cuda.wait(self, timeout)
        if self._drive is not None and not self._finished:
            self._drive(self, self.num_layers, timeout)
        return self._finished

    def wait_layer(self, i: int) -> bool:
        """Make layer ``i`` of a load usable by the model; False if it never will be.

        On CUDA the current stream waits on the layer's event (the host does not
        block) and the result is True. On the thread executor the caller blocks
        until the layer arrived, copying layers up to ``i`` itself while no worker
        copies this transfer. On the manual executor it reports whether it has.
        False means the transfer failed before layer ``i``: treat the pages as garbage.
        For a backup, layer ``i`` is ready when the whole backup is.
        """
        if check_int("layer", i) >= self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {i}")
        if self._cuda is not None:
            return self._cuda.wait_layer(self, i)
        if self._drive is not None and not self._finished and self.layers_done <= i:
            self._drive(self, i + 1, None)
        return self.layers_done > i and (self.error is None or self.kind is TransferKind.LOAD)

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self._finished else "in flight"
        return (
            f"Transfer({self.kind.value}, {self.num_pages} pages, "
            f"{self.layers_done}/{self.num_layers} layers, {state})"
        )


# What a transfer's waits call on the thread executor: (transfer, layers needed, timeout).
DriveFn = Callable[["Transfer", int, "float | None"], None]


class Executor(ABC):
    """Moves the data of submitted transfers and reports which finished."""

    def __init__(self) -> None:
        self._completed: collections.deque[Transfer] = collections.deque()

    @abstractmethod
    def submit(self, transfer: Transfer) -> None:
        """Start moving ``transfer``'s pages; returns without waiting."""

    def driver(self) -> DriveFn | None:
        """What a transfer's waits call to make progress, or None if no thread changes them."""
        return None

    def compute_fence(self) -> Fence | CudaFence:
        return Fence(is_set=True)

    def poll(self) -> list[Transfer]:
        """Transfers finished since the last poll, in completion order, each once."""
        out = []
        while self._completed:
            out.append(self._completed.popleft())
        return out

    @abstractmethod
    def close(self) -> None:
        """Stop accepting work; finish what was submitted."""

