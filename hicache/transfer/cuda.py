"""The CUDA executor: side streams, events, and loads that land layer by layer.

A backup gathers device pages on the device into a page-first staging tensor, then
copies each run of consecutive host pages with one device-to-host copy. A load copies
each layer of every host run with one ``cudaMemcpy2DAsync`` into a layer-first staging
tensor, scatters the layer into the device pool and records the layer's event, so the
model can start on layer 0 while later layers still move (see :func:`layer_load_plan`).
Host runs split where the host pool's pinned chunks end (:func:`host_runs`): one copy
must not span two registrations. Nothing here knows prefixes or which pages are in use.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import time
from typing import NamedTuple

import numpy as np
import torch

from hicache.memory.pools import DevicePages, HostPool, as_rows
from hicache.transfer.base import CudaFence, Executor, Transfer, TransferKind

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


class _CudaState:
    """Events of one CUDA transfer and the device tensors its kernels still use."""

    __slots__ = ("device", "layer_events", "start", "end", "keep_alive")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.layer_events: list[torch.cuda.Event] = []
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.keep_alive: tuple[torch.Tensor, ...] = ()

    def check(self, transfer: Transfer) -> bool:
        while transfer.layers_done < len(self.layer_events) and self.layer_events[
            transfer.layers_done
        ].query():
            transfer.layers_done += 1
        if self.end.query():
            self.finish(transfer)
        return transfer._finished

    def finish(self, transfer: Transfer) -> None:
        if transfer._finished:
            return
        try:
            self.end.synchronize()  # already passed; surfaces an asynchronous CUDA error
            transfer.seconds = self.start.elapsed_time(self.end) / 1e3
        except RuntimeError as exc:
            transfer.error = exc
        transfer.layers_done = transfer.num_layers
        transfer._finished = True
        self.keep_alive = ()

    def wait(self, transfer: Transfer, timeout: float | None) -> bool:
        if transfer._finished:
            return True
        if timeout is None:
            self.finish(transfer)
            return True
        deadline = time.perf_counter() + timeout
        while not self.check(transfer) and time.perf_counter() < deadline:
            time.sleep(5e-5)
        return transfer._finished

    def wait_layer(self, transfer: Transfer, i: int) -> bool:
        if transfer.error is not None:
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

    def __init__(self, device_pool: DevicePages, host_pool: HostPool) -> None:
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
        k_buffers, v_buffers = device_pool.k_buffers, device_pool.v_buffers
        if k_buffers is None or v_buffers is None:
            raise ValueError("device pool: the CUDA executor copies split K and V buffers, "
                             "got a pool without them")
        self._dev = [
            (as_rows(k, device_pool.num_pages), as_rows(v, device_pool.num_pages))
            for k, v in zip(k_buffers, v_buffers, strict=True)
        ]
        # (num_host_pages, num_layers, 2, row_words)
        self._host = as_rows(host_pool.buffer, host_pool.num_pages * kv.num_layers * 2).view(
            host_pool.num_pages, kv.num_layers, 2, -1
        )
        self._in_flight: dict[TransferKind, collections.deque[Transfer]] = {
            kind: collections.deque() for kind in TransferKind
        }

    def compute_fence(self) -> CudaFence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CudaFence(event)

    def submit(self, transfer: Transfer) -> None:
        state = _CudaState(self.device)
        transfer._cuda = state
        compute = torch.cuda.current_stream(self.device)
        try:
            if transfer.kind is TransferKind.LOAD:
                self._submit_load(transfer, state, compute)
            else:
                self._submit_backup(transfer, state, compute)
        except Exception as exc:  # noqa: BLE001 - reported through the transfer
            transfer.error = exc
            transfer._finished = True
            self._completed.append(transfer)
            return
        self._in_flight[transfer.kind].append(transfer)

    def _runs(self, host_ids: torch.Tensor) -> list[tuple[int, int, int]]:
        return host_runs(host_ids, self._chunk_pages)

    def _submit_load(
        self, transfer: Transfer, state: _CudaState, compute: torch.cuda.Stream
    ) -> None:
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
            n = transfer.num_pages
            runs = self._runs(transfer.host_pages)
            dev_ids = transfer.device_pages.to(self.device, non_blocking=True)
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
                    assert cudart is not None, "a copy plan is made only with the CUDA runtime"
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

    def _submit_backup(
        self, transfer: Transfer, state: _CudaState, compute: torch.cuda.Stream
    ) -> None:
        stream = self._backup_stream
        fence = transfer.fence
        with torch.cuda.stream(stream):
            if isinstance(fence, CudaFence):
                stream.wait_event(fence.event)
            elif fence is None:
                stream.wait_stream(compute)
            elif not fence.is_set():
                raise ValueError("after: a host Fence on the CUDA executor must already be set")
            state.start.record(stream)
            n = transfer.num_pages
            stage = torch.empty((n, *self._host.shape[1:]), dtype=self._host.dtype,
                                device=self.device)
            dev_ids = transfer.device_pages.to(self.device, non_blocking=True)
            for layer, (k, v) in enumerate(self._dev):
                # Device bandwidth dwarfs the link's: a temporary per layer costs little.
                stage[:, layer, 0].copy_(k.index_select(0, dev_ids))
                stage[:, layer, 1].copy_(v.index_select(0, dev_ids))
            for first, count, offset in self._runs(transfer.host_pages):
                self._host[first : first + count].copy_(
                    stage[offset : offset + count], non_blocking=True
                )
            state.end.record(stream)
            state.keep_alive = (stage, dev_ids)

    def poll(self) -> list[Transfer]:
        out = super().poll()
        for queue in self._in_flight.values():
            # Each stream runs its transfers in order: stop at the first unfinished one.
            while queue:
                events = queue[0]._cuda
                assert events is not None, "a transfer on the CUDA executor has its events"
                if not events.check(queue[0]):
                    break
                out.append(queue.popleft())
        return out

    def close(self) -> None:
        self._load_stream.synchronize()
        self._backup_stream.synchronize()

