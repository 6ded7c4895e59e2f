"""Asynchronous page transfers between the device pool and the host pool.

``load`` copies host pages to device pages layer by layer; ``backup`` copies device
pages to host pages, all layers. Both return a :class:`TransferHandle` at once.
The cache learns about completions only by calling :meth:`TransferEngine.poll`
from its own thread: worker threads never call back into cache code, so the cache
needs no locks. Until ``poll`` has reported a handle, its source and destination
pages must stay allocated (the caller's IO locks), and the handle keeps its page
id tensors alive.

Ordering rules (the bugs the field shipped)::

    compute stream:  ...write KV of pages P...  [fence]      ...wait_layer(i)... read layer i
    backup stream:                               wait fence -> read P -> host
    load stream:     wait work queued so far -> host -> device, event per layer ---^

* a backup reads device pages only after its fence (``after=engine.compute_fence()``,
  default: the work already queued on the current stream) has passed;
* a load writes device pages only after the work already queued on the current
  stream (which may still read the pages' previous contents) has finished;
* the model calls ``handle.wait_layer(i)`` before reading layer ``i``; on CUDA this
  makes the current stream wait on the layer's event, the host does not block.

Executors: ``"cuda"`` (two side streams, events), ``"thread"`` (one worker thread
per direction, for CPU-only machines), ``"manual"`` (tests: nothing moves until the
test completes a layer; the copy happens at that moment), ``"immediate"``
(bookkeeping only: completes at submission, copies nothing, pools may be None).

A failed transfer reports ``error``; its destination pages hold garbage (layers
completed before the failure were written, later ones were not) and the caller
frees them. Sources are only ever read. This module knows pools and page ids; it
does not know the tree, the allocators or which pages are in use.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch

from hicache.checks import check_page_ids
from hicache.memory import DevicePool, HostPool, PageCopier, as_rows

_log = logging.getLogger(__name__)

_CUDA_MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyKind


class Copy2D(NamedTuple):
    """One strided copy (``cudaMemcpy2DAsync``): ``height`` rows of ``width`` bytes."""

    dst_offset: int  # bytes from the destination's base
    src_offset: int  # bytes from the source's base
    width: int  # bytes per row
    height: int  # rows
    dst_pitch: int  # bytes between rows in the destination
    src_pitch: int  # bytes between rows in the source


def layer_load_plan(
    runs: list[tuple[int, int, int]], num_layers: int, layer_nbytes: int, page_nbytes: int
) -> list[list[Copy2D]]:
    """Per layer, the copies that bring that layer of every page into a staging buffer.

    ``runs`` are ``(first host page, pages, offset in the transfer)``; the host pool is
    page-first, so layer ``l`` of a run is ``pages`` rows of ``layer_nbytes`` bytes
    (its K and V) at a pitch of ``page_nbytes``. The staging buffer is layer-first,
    ``(num_layers, n, layer_nbytes)``, so layer ``l`` lands in one contiguous region
    and can be scattered, and its event recorded, before layer ``l + 1`` is copied.
    """
    n = sum(count for _, count, _ in runs)
    plan = []
    for layer in range(num_layers):
        plan.append([
            Copy2D(
                dst_offset=(layer * n + offset) * layer_nbytes,
                src_offset=first * page_nbytes + layer * layer_nbytes,
                width=layer_nbytes, height=count, dst_pitch=layer_nbytes, src_pitch=page_nbytes,
            )
            for first, count, offset in runs
        ])
    return plan


def host_runs(host_ids: torch.Tensor, chunk_pages: int) -> list[tuple[int, int, int]]:
    """(first host page, number of pages, offset in the transfer) per run of consecutive
    host pages; runs also break where a pinned chunk of ``chunk_pages`` pages ends (one
    copy must not span two registrations)."""
    ids = host_ids.numpy()
    if ids.size == 0:
        return []
    breaks = np.ones(ids.size, dtype=bool)
    breaks[1:] = (np.diff(ids) != 1) | (ids[1:] % chunk_pages == 0)
    starts = np.flatnonzero(breaks)
    counts = np.diff(np.append(starts, ids.size))
    return [(int(ids[s]), int(c), int(s)) for s, c in zip(starts, counts, strict=True)]


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (for ``cudaMemcpy2DAsync``), or None."""
    version = torch.version.cuda or ""
    names = [f"libcudart.so.{version.split('.')[0]}"] if version else []
    for name in [*names, "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cudaMemcpy2DAsync
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return lib
    return None


class TransferKind(str, Enum):
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
        return self.event.query()

    def wait(self, timeout: float | None = None) -> bool:
        self.event.synchronize()
        return True


class TransferHandle:
    """One submitted load or backup. Read its state; only the engine changes it.

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
        drive: _Drive | None,
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
        self._cuda = None  # _CudaState on the CUDA executor
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
        has started itself (see :class:`ThreadExecutor`).
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
        if not 0 <= i < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {i}")
        if self._cuda is not None:
            return self._cuda.wait_layer(self, i)
        if self._drive is not None and not self._finished and self.layers_done <= i:
            self._drive(self, i + 1, None)
        return self.layers_done > i and (self.error is None or self.kind is TransferKind.LOAD)

    def __repr__(self) -> str:
        state = "failed" if self.error else "done" if self._finished else "in flight"
        return (
            f"TransferHandle({self.kind.value}, {self.num_pages} pages, "
            f"{self.layers_done}/{self.num_layers} layers, {state})"
        )


# What a handle's wait calls on the thread executor: (handle, layers needed, timeout).
_Drive = Callable[["TransferHandle", int, "float | None"], None]


def _copy_layers(copier: PageCopier, handle: TransferHandle, first: int, last: int) -> None:
    if handle.kind is TransferKind.LOAD:
        copier.load(handle.host_pages, handle.device_pages, first, last)
    else:
        copier.backup(handle.device_pages, handle.host_pages, first, last)


class Executor(ABC):
    """Moves the data of submitted handles and reports which finished."""

    def __init__(self) -> None:
        self._completed: collections.deque[TransferHandle] = collections.deque()

    @abstractmethod
    def submit(self, handle: TransferHandle) -> None:
        """Start moving ``handle``'s pages; returns without waiting."""

    def driver(self) -> _Drive | None:
        """What a handle's waits call to make progress, or None if no thread changes them."""
        return None

    def compute_fence(self) -> Fence | CudaFence:
        return Fence(is_set=True)

    def poll(self) -> list[TransferHandle]:
        """Handles finished since the last poll, in completion order, each once."""
        out = []
        while self._completed:
            out.append(self._completed.popleft())
        return out

    @abstractmethod
    def close(self) -> None:
        """Stop accepting work; finish what was submitted."""


class ImmediateExecutor(Executor):
    """Bookkeeping only: every transfer finishes at submission and copies nothing."""

    def submit(self, handle: TransferHandle) -> None:
        handle.layers_done = handle.num_layers
        handle.seconds = 0.0
        handle._finished = True
        self._completed.append(handle)

    def close(self) -> None:
        """Nothing runs in the background."""


class ManualExecutor(Executor):
    """For tests: a layer moves only when the test calls :meth:`complete_layer`.

    The copy of a layer happens at that call, so a test that reuses pages before
    completion sees the corruption a real race would cause.
    """

    def __init__(self, copier: PageCopier) -> None:
        super().__init__()
        self._copier = copier
        self._pending: list[TransferHandle] = []
        self._started: dict[int, float] = {}

    def submit(self, handle: TransferHandle) -> None:
        self._pending.append(handle)

    def pending(self) -> list[TransferHandle]:
        """Submitted handles that have not finished, in submission order."""
        return list(self._pending)

    def complete_layer(self, handle: TransferHandle) -> bool:
        """Copy the next layer of ``handle``; False if a backup's fence is not set yet."""
        self._check_pending(handle)
        if handle.fence is not None and not handle.fence.is_set():
            return False
        self._started.setdefault(id(handle), time.perf_counter())
        layer = handle.layers_done
        try:
            _copy_layers(self._copier, handle, layer, layer + 1)
        except Exception as exc:  # noqa: BLE001 - reported through the handle
            self.fail(handle, exc)
            return True
        handle.layers_done += 1
        if handle.layers_done == handle.num_layers:
            self._finish(handle)
        return True

    def complete(self, handle: TransferHandle) -> bool:
        """Copy all remaining layers; False if a backup's fence is not set yet."""
        while handle in self._pending:
            if not self.complete_layer(handle):
                return False
        return True

    def fail(self, handle: TransferHandle, exc: BaseException) -> None:
        """Finish ``handle`` with ``exc`` as its error; remaining layers are not copied."""
        self._check_pending(handle)
        handle.error = exc
        self._finish(handle)

    def _finish(self, handle: TransferHandle) -> None:
        handle.seconds = time.perf_counter() - self._started.pop(id(handle), time.perf_counter())
        handle._finished = True
        self._pending.remove(handle)
        self._completed.append(handle)

    def close(self) -> None:
        """Pending transfers stay pending: only the test moves them."""

    def _check_pending(self, handle: TransferHandle) -> None:
        if handle not in self._pending:
            raise ValueError(f"handle: expected a pending transfer of this engine, got {handle}")


class ThreadExecutor(Executor):
    """One worker thread per direction; copies run outside the GIL (torch or native).

    A transfer moves one layer at a time (loads, so that the model can start on layer
    0; backups, because one pass over all layers measured 10-25% slower than one pass
    per layer). Each layer is claimed under the condition by whoever copies it: the
    worker, or a thread blocked in ``wait``/``wait_layer`` on that transfer while
    nobody copies it (a blocked caller's core is idle anyway, and copying itself saves
    the two thread hand-offs, ~0.1-0.3 ms a transfer on 2 busy cores). At most one
    thread copies a given transfer at any moment, so its layers land in order and one
    transfer never uses more than one core. A caller that waits with a timeout, or on
    a backup whose fence has not passed, only waits.
    """

    def __init__(self, copier: PageCopier) -> None:
        super().__init__()
        self._copier = copier
        self._cond = threading.Condition()
        self._queues = {kind: collections.deque() for kind in TransferKind}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(kind,), name=f"hicache-{kind.value}",
                             daemon=True)
            for kind in TransferKind
        ]
        for t in self._threads:
            t.start()

    def driver(self) -> _Drive:
        return self.drive

    def submit(self, handle: TransferHandle) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            handle._queued = True
            self._queues[handle.kind].append(handle)
            self._cond.notify_all()

    def _work(self, kind: TransferKind) -> None:
        queue = self._queues[kind]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: queue or self._closed)
                if not queue:
                    return
                handle = queue.popleft()
                handle._queued = False
                if handle._busy or handle._finished:
                    continue  # a waiting caller copies it; it requeues what it leaves
            if handle.fence is not None:
                handle.fence.wait()
            self.drive(handle, handle.num_layers, None, steal=False)

    def drive(self, handle: TransferHandle, need: int, timeout: float | None,
              *, steal: bool = True) -> None:
        """Return once ``handle`` has ``need`` layers, has finished, or ``timeout`` passed.

        Copies layers below ``need`` here unless another thread copies ``handle`` now.
        The worker (``steal=False``) leaves a transfer that a caller copies: the caller
        puts it back at the front of the queue if it stops before the last layer. A
        waiting caller copies only without a timeout and once the fence has passed, and
        otherwise sleeps until the layers it needs land. The thread that claims a
        transfer keeps it until it has the layers it needs, so two threads never
        alternate on one (each switch is a GIL hand-off that stalls the copy), and
        nobody wakes the worker at the end of a transfer it did not start.
        """
        deadline = None if timeout is None else time.perf_counter() + timeout
        may_copy = not steal or (
            timeout is None and (handle.fence is None or handle.fence.is_set())
        )
        cond = self._cond
        owner = False
        with cond:
            try:
                while not handle._finished and handle.layers_done < need:
                    if may_copy and (owner or not handle._busy):
                        owner = handle._busy = True
                        self._copy_next_layer(handle)
                        continue
                    if not steal:
                        return
                    handle._wake_at = min(handle._wake_at, need)
                    remaining = None if deadline is None else deadline - time.perf_counter()
                    if remaining is not None and remaining <= 0:
                        return
                    cond.wait(remaining)
            finally:
                if owner:
                    self._release(handle)

    def _release(self, handle: TransferHandle) -> None:
        """Let go of ``handle`` (the caller holds the condition and owns it)."""
        if not handle._finished and self._closed:
            # The workers may have exited: finish here what close() promised to finish.
            while not handle._finished:
                self._copy_next_layer(handle)
        handle._busy = False
        if not handle._finished and not handle._queued:
            handle._queued = True
            self._queues[handle.kind].appendleft(handle)
            self._cond.notify_all()

    def _copy_next_layer(self, handle: TransferHandle) -> None:
        """Copy the next layer with the condition released; the caller holds it and owns
        ``handle``."""
        layer = handle._next_layer
        handle._next_layer += 1
        if handle._started is None:
            handle._started = time.perf_counter()
        error = None
        self._cond.release()
        try:
            _copy_layers(self._copier, handle, layer, layer + 1)
        except BaseException as exc:  # noqa: BLE001 - reported through the handle
            error = exc
        finally:
            self._cond.acquire()
        assert handle.layers_done == layer, (
            f"layer {layer} landed while {handle.layers_done} had: two threads copied "
            "one transfer at once"
        )
        if error is None:
            handle.layers_done = layer + 1
        else:
            handle.error = error
        if error is not None or handle.layers_done == handle.num_layers:
            handle.seconds = time.perf_counter() - handle._started
            handle._finished = True
            self._completed.append(handle)
        # Wake sleepers only when one of them asked for this point: every wake-up costs
        # a GIL hand-off that slows the copying thread down.
        if handle._finished or handle.layers_done >= handle._wake_at:
            handle._wake_at = handle.num_layers + 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


class _CudaState:
    """Events of one CUDA transfer and the device tensors its kernels still use."""

    __slots__ = ("device", "layer_events", "start", "end", "keep_alive")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.layer_events: list[torch.cuda.Event] = []
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.keep_alive: tuple = ()

    def check(self, handle: TransferHandle) -> bool:
        while handle.layers_done < len(self.layer_events) and self.layer_events[
            handle.layers_done
        ].query():
            handle.layers_done += 1
        if self.end.query():
            self.finish(handle)
        return handle._finished

    def finish(self, handle: TransferHandle) -> None:
        if handle._finished:
            return
        try:
            self.end.synchronize()  # already passed; surfaces an asynchronous CUDA error
            handle.seconds = self.start.elapsed_time(self.end) / 1e3
        except RuntimeError as exc:
            handle.error = exc
        handle.layers_done = handle.num_layers
        handle._finished = True
        self.keep_alive = ()

    def wait(self, handle: TransferHandle, timeout: float | None) -> bool:
        if handle._finished:
            return True
        if timeout is None:
            self.finish(handle)
            return True
        deadline = time.perf_counter() + timeout
        while not self.check(handle) and time.perf_counter() < deadline:
            time.sleep(5e-5)
        return handle._finished

    def wait_layer(self, handle: TransferHandle, i: int) -> bool:
        if handle.error is not None:
            return False
        event = self.layer_events[i] if self.layer_events else self.end
        torch.cuda.current_stream(self.device).wait_event(event)
        return True


class CudaExecutor(Executor):
    """A load stream and a backup stream; copies from and to pinned host memory.

    Backup: the device pages of every layer are gathered on the device into a
    page-first staging tensor ``(n, num_layers, 2, row)``, then each run of
    consecutive host pages is one device-to-host copy (runs split where the host
    pool's pinned chunks end, since one copy must not span two registrations).
    Load, layer by layer: for each layer, each host run's rows of that layer are one
    ``cudaMemcpy2DAsync`` into a layer-first staging tensor (torch's own strided copy
    would build a pageable contiguous temporary on the host, synchronously), then the
    layer's K and V rows are scattered into the device pool and its event recorded,
    so ``wait_layer(0)`` passes after 1/num_layers of the copy, not all of it.
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        super().__init__()
        if device_pool.device.type != "cuda":
            raise ValueError(f"device pool: expected a CUDA device, got {device_pool.device}")
        self.device = device_pool.device
        kv = device_pool.kv
        self._num_layers = kv.num_layers
        self._chunk_pages = host_pool.pin_chunk_pages
        self._load_stream = torch.cuda.Stream(self.device)
        self._backup_stream = torch.cuda.Stream(self.device)
        # (num_device_pages, row_words) per layer, K then V
        self._dev = [
            (as_rows(k, device_pool.num_pages), as_rows(v, device_pool.num_pages))
            for k, v in zip(device_pool.k_buffers, device_pool.v_buffers, strict=True)
        ]
        # (num_host_pages, num_layers, 2, row_words)
        self._host = as_rows(host_pool.buffer, host_pool.num_pages * kv.num_layers * 2).view(
            host_pool.num_pages, kv.num_layers, 2, -1
        )
        self._in_flight: dict[TransferKind, collections.deque[TransferHandle]] = {
            kind: collections.deque() for kind in TransferKind
        }

    def compute_fence(self) -> CudaFence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CudaFence(event)

    def submit(self, handle: TransferHandle) -> None:
        state = _CudaState(self.device)
        handle._cuda = state
        compute = torch.cuda.current_stream(self.device)
        try:
            if handle.kind is TransferKind.LOAD:
                self._submit_load(handle, state, compute)
            else:
                self._submit_backup(handle, state, compute)
        except Exception as exc:  # noqa: BLE001 - reported through the handle
            handle.error = exc
            handle._finished = True
            self._completed.append(handle)
            return
        self._in_flight[handle.kind].append(handle)

    def _runs(self, host_ids: torch.Tensor) -> list[tuple[int, int, int]]:
        return host_runs(host_ids, self._chunk_pages)

    def _submit_load(self, handle, state: _CudaState, compute) -> None:
        """Land the load layer by layer: copy layer ``l`` of every page, scatter it, record
        its event, then layer ``l + 1``; the model starts on layer 0 while the rest moves.

        Each layer of a host run is one ``cudaMemcpy2DAsync`` (rows of the layer's bytes at
        the page pitch, no host-side temporary). Without the runtime's entry point it falls
        back to whole-page runs copied first (every event then passes at once at the end).
        """
        stream = self._load_stream
        cudart = _cudart()
        with torch.cuda.stream(stream):
            # The device pages may have been freed by work still queued on compute.
            stream.wait_stream(compute)
            state.start.record(stream)
            n = handle.num_pages
            runs = self._runs(handle.host_pages)
            dev_ids = handle.device_pages.to(self.device, non_blocking=True)
            if cudart is None:
                stage = torch.empty((n, *self._host.shape[1:]), dtype=self._host.dtype,
                                    device=self.device)
                for first, count, offset in runs:
                    stage[offset : offset + count].copy_(
                        self._host[first : first + count], non_blocking=True
                    )
                layers = [stage[:, layer] for layer in range(self._num_layers)]
                plan = None
            else:
                # (num_layers, n, 2, row_words): one contiguous region per layer
                stage = torch.empty((self._num_layers, n, *self._host.shape[2:]),
                                    dtype=self._host.dtype, device=self.device)
                layers = list(stage)
                elem = self._host.element_size()
                layer_nbytes = self._host[0, 0].numel() * elem
                page_nbytes = self._host[0].numel() * elem
                plan = layer_load_plan(runs, self._num_layers, layer_nbytes, page_nbytes)
            host_base, stage_base = self._host.data_ptr(), stage.data_ptr()
            for layer, (k, v) in enumerate(self._dev):
                for c in plan[layer] if plan is not None else ():
                    err = cudart.cudaMemcpy2DAsync(
                        stage_base + c.dst_offset, c.dst_pitch, host_base + c.src_offset,
                        c.src_pitch, c.width, c.height, _CUDA_MEMCPY_HOST_TO_DEVICE,
                        stream.cuda_stream,
                    )
                    if err != 0:
                        raise RuntimeError(f"cudaMemcpy2DAsync failed with error {err}")
                k.index_copy_(0, dev_ids, layers[layer][:, 0])
                v.index_copy_(0, dev_ids, layers[layer][:, 1])
                event = torch.cuda.Event()
                event.record(stream)
                state.layer_events.append(event)
            state.end.record(stream)
            state.keep_alive = (stage, dev_ids)

    def _submit_backup(self, handle, state: _CudaState, compute) -> None:
        stream = self._backup_stream
        fence = handle.fence
        with torch.cuda.stream(stream):
            if isinstance(fence, CudaFence):
                stream.wait_event(fence.event)
            elif fence is None:
                stream.wait_stream(compute)
            elif not fence.is_set():
                raise ValueError("after: a host Fence on the CUDA executor must already be set")
            state.start.record(stream)
            n = handle.num_pages
            stage = torch.empty((n, *self._host.shape[1:]), dtype=self._host.dtype,
                                device=self.device)
            dev_ids = handle.device_pages.to(self.device, non_blocking=True)
            for layer, (k, v) in enumerate(self._dev):
                # Device bandwidth dwarfs the link's: a temporary per layer costs little.
                stage[:, layer, 0].copy_(k.index_select(0, dev_ids))
                stage[:, layer, 1].copy_(v.index_select(0, dev_ids))
            for first, count, offset in self._runs(handle.host_pages):
                self._host[first : first + count].copy_(
                    stage[offset : offset + count], non_blocking=True
                )
            state.end.record(stream)
            state.keep_alive = (stage, dev_ids)

    def poll(self) -> list[TransferHandle]:
        out = super().poll()
        for queue in self._in_flight.values():
            # Each stream runs its transfers in order: stop at the first unfinished one.
            while queue and queue[0]._cuda.check(queue[0]):
                out.append(queue.popleft())
        return out

    def close(self) -> None:
        self._load_stream.synchronize()
        self._backup_stream.synchronize()


class TransferEngine:
    """Submits loads and backups between one device pool and one host pool.

    ``executor``: ``"auto"`` (cuda if the device pool is on CUDA, else thread),
    ``"cuda"``, ``"thread"``, ``"manual"`` or ``"immediate"``. ``native`` chooses the
    CPU copy kernel (see :mod:`hicache.pagecopy`): None tries the native one and falls
    back to torch gather/scatter. ``copier`` replaces the CPU executors' page copier
    (anything with :class:`~hicache.memory.PageCopier`'s ``load``/``backup``): the vLLM
    connector copies between vLLM's own KV tensors and a host pool this way.
    """

    def __init__(
        self,
        device_pool: DevicePool | None,
        host_pool: HostPool | None,
        executor: str = "auto",
        *,
        native: bool | None = None,
        copier: PageCopier | None = None,
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
            elif executor in ("thread", "manual"):
                if copier is None:
                    copier = PageCopier(device_pool, host_pool, native=native)
                cls = ThreadExecutor if executor == "thread" else ManualExecutor
                self.executor = cls(copier)
            else:
                raise ValueError(
                    "executor: expected 'auto', 'cuda', 'thread', 'manual' or 'immediate', "
                    f"got {executor!r}"
                )
        kv = (device_pool or host_pool).kv if (device_pool or host_pool) else None
        self._num_layers = kv.num_layers if kv else 1
        self._page_nbytes = kv.page_nbytes if kv else 0
        self._drive = self.executor.driver()
        self._count_lock = threading.Lock()  # submissions may come from several threads
        self._num_unreported = 0
        # Called with each handle poll() reports, on the polling thread (hicache.metrics).
        self.on_complete: list[Callable[[TransferHandle], None]] = []

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted whose completion :meth:`poll` has not reported yet."""
        return self._num_unreported

    def compute_fence(self) -> Fence | CudaFence:
        """A fence that passes once the compute submitted so far has finished."""
        return self.executor.compute_fence()

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> TransferHandle:
        """Copy ``host_pages[j]`` to ``device_pages[j]`` for every j, layer by layer."""
        return self._submit(TransferKind.LOAD, host_pages, device_pages, None)

    def backup(
        self,
        device_pages: torch.Tensor,
        host_pages: torch.Tensor,
        after: Fence | CudaFence | None = None,
    ) -> TransferHandle:
        """Copy ``device_pages[j]`` to ``host_pages[j]`` for every j, all layers.

        Nothing is read before ``after`` has passed (default: on CUDA the work queued
        on the current stream so far; elsewhere, nothing to wait for).
        """
        if after is not None and not isinstance(after, Fence | CudaFence):
            raise TypeError(f"after: expected a fence from compute_fence(), got {after!r}")
        return self._submit(TransferKind.BACKUP, host_pages, device_pages, after)

    def poll(self) -> list[TransferHandle]:
        """Handles finished (or failed) since the last poll, in completion order, each once."""
        done = self.executor.poll()
        with self._count_lock:
            self._num_unreported -= len(done)
        for handle in done:
            if handle.error is not None:
                _log.warning("%s of %d pages failed: %r", handle.kind.value,
                             handle.host_pages.numel(), handle.error)
            for observe in self.on_complete:
                observe(handle)
        return done

    def close(self) -> None:
        """Finish submitted work and stop the workers."""
        self.executor.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, kind, host_pages, device_pages, fence) -> TransferHandle:
        self._check_ids(host_pages, device_pages)
        handle = TransferHandle(
            kind, host_pages, device_pages, self._num_layers,
            host_pages.numel() * self._page_nbytes, self._drive, fence,
        )
        with self._count_lock:
            self._num_unreported += 1
        self.executor.submit(handle)
        return handle

    def _check_ids(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> None:
        if self.host_pool is None or self.device_pool is None:
            # Immediate bookkeeping runs thousands of times a second: shapes only.
            for name, t in (("host_pages", host_pages), ("device_pages", device_pages)):
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    raise TypeError(f"{name}: expected a 1-D int64 tensor, got {t!r}")
        else:
            check_page_ids("host_pages", host_pages, self.host_pool.num_pages)
            check_page_ids("device_pages", device_pages, self.device_pool.num_pages)
        if host_pages.numel() != device_pages.numel():
            raise ValueError(
                "page ids: expected equal lengths, got "
                f"{host_pages.numel()} host and {device_pages.numel()} device pages"
            )
