"""KV pools: where the K and V tensors of cached pages live, one pool per tier.

``DevicePool`` holds what attention kernels read: per layer, one K and one V
tensor shaped ``(num_pages, page_size, num_kv_heads, head_dim)``. ``HostPool``
holds the backup copies in a page-first layout, one page's K and V for every
layer contiguous, so a run of host pages is one block of memory (one large copy,
and the unit a third tier stores)::

    device (per layer l):  k_buffers[l][page] -> (page_size, H, D)
                           v_buffers[l][page] -> (page_size, H, D)
    host:                  buffer[page]       -> (num_layers, 2, page_size, H, D)
                                                   K is [:, 0], V is [:, 1]

The pools know shapes, bytes and page ids; they do not know which pages are in
use (that is the allocator's job), nor streams or ordering (the transfer engine's),
nor how pages move between them (:mod:`hicache.memory.copier`).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import psutil
import torch

from hicache.checks import check_bool, check_int, check_page_ids
from hicache.config import CacheConfig, GiB, KVConfig, check_device

# Registering host memory with CUDA one chunk at a time: pinning hundreds of GiB in a
# single call is known to stall for minutes and gives no progress in between.
_PIN_CHUNK_NBYTES = 1 * GiB


def word_dtype(row_nbytes: int) -> torch.dtype:
    """Widest integer dtype whose size divides ``row_nbytes``.

    Gathers and scatters run 2-4x faster on 4-byte elements than on 2- or 1-byte
    ones of the same bytes, and integer views also work for dtypes (float8) whose
    index kernels are missing.
    """
    if row_nbytes % 4 == 0:
        return torch.int32
    if row_nbytes % 2 == 0:
        return torch.int16
    return torch.uint8


def as_rows(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """View a contiguous tensor as ``(num_rows, row_words)`` of :func:`word_dtype`."""
    assert t.is_contiguous(), "as_rows needs a contiguous tensor (would copy silently)"
    flat = t.reshape(num_rows, -1)
    row_nbytes = flat.shape[1] * t.element_size()
    return flat.view(torch.uint8).view(word_dtype(row_nbytes))


# What a page allocator keeps per page (allocator.py: an int64 free stack, a bool
# in-use flag, an int64 scratch slot), rounded up.
_ALLOCATOR_NBYTES_PER_PAGE = 24


def check_device_available(device: str) -> None:
    """``ValueError`` unless ``device`` exists here (``cuda`` needs a CUDA device)."""
    check_device(device)
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but CUDA is not available here "
                         "(use device='cpu')")
    index = int(device[5:]) if ":" in device else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} asked for, but there are "
                         f"{torch.cuda.device_count()} CUDA devices")


def available_nbytes(device: str) -> int:
    """Memory a new buffer on ``device`` can take now: CPU available memory, or free CUDA memory."""
    if device == "cpu":
        return int(psutil.virtual_memory().available)
    return torch.cuda.mem_get_info(torch.device(device))[0]


def check_device_pool_memory(kv: KVConfig, num_pages: int, device: str,
                             option: str = "device_tokens / device_nbytes") -> None:
    """Refuse a device pool that does not fit, before allocating it.

    The error names both numbers (asked, free) and the option to lower: a pool
    larger than memory would otherwise be an allocator error on a GPU, and on a
    CPU an out-of-memory kill with no message.
    """
    check_device_available(device)
    need = num_pages * kv.page_nbytes
    free = available_nbytes(device)
    if need > free:
        where = "available CPU memory" if device == "cpu" else f"free memory on {device}"
        raise ValueError(
            f"device pool: {num_pages} pages x {kv.page_nbytes} bytes = {need} bytes asked for, "
            f"but only {free} bytes of {where}; lower {option}"
        )


def check_cache_memory(config: CacheConfig) -> None:
    """Check every pool a :class:`hicache.HiCache` of ``config`` would allocate, first.

    Page allocators (bookkeeping, always) and, with ``allocate_kv``, the device pool
    (its device must exist here) and the host pool, against what this machine has
    now; nothing is allocated before all of them pass, so a refused configuration
    costs nothing. A bookkeeping-only cache never touches its device.
    """
    # What each tier takes from host memory: its page allocator always; with allocate_kv
    # the host pool, and the device pool too when the "device" is the CPU.
    device_need = config.num_device_pages * _ALLOCATOR_NBYTES_PER_PAGE
    host_need = config.num_host_pages * _ALLOCATOR_NBYTES_PER_PAGE
    if config.allocate_kv:
        check_device_pool_memory(config.kv, config.num_device_pages, config.device)
        host_need += config.num_host_pages * config.kv.page_nbytes
        if config.device == "cpu":  # both pools then come out of the same memory
            device_need += config.num_device_pages * config.kv.page_nbytes
    need = device_need + host_need
    available = psutil.virtual_memory().available
    usable = available - (config.host_reserve_nbytes if config.num_host_pages else 0)
    if need > usable:
        pools = " and KV pool" if config.allocate_kv else ""
        device_pools = pools if config.device == "cpu" else ""
        parts = [(device_need, f"device tier: {device_need} bytes (page allocator{device_pools} for "
                  f"{config.num_device_pages} pages)", "device_tokens / device_nbytes")]
        if config.num_host_pages:
            parts.append((host_need, f"host tier: {host_need} bytes (page allocator{pools} for "
                          f"{config.num_host_pages} pages)",
                          "host_tokens / host_nbytes / host_ratio / host_gb"))
        parts.sort(key=lambda p: -p[0])  # the tier that asks for most is named first
        options = " or ".join(p[2] for p in parts if p[0] > 0)
        if config.num_host_pages:
            options += " or host_reserve_nbytes"
        raise ValueError(
            f"host memory: {need} bytes asked for ({'; '.join(p[1] for p in parts)}) but only "
            f"{max(0, usable)} bytes may be used ({available} available"
            + (f" minus host_reserve_nbytes={config.host_reserve_nbytes}"
               if config.num_host_pages else "")
            + f"); lower {options}"
        )



class DevicePages(Protocol):
    """What the transfer engine reads of a device pool: a :class:`DevicePool`, or a view of
    KV tensors someone else owns (the vLLM connector's ``BlockPool``). ``k_buffers`` /
    ``v_buffers`` (per layer, ``(num_pages, ...)``) are None when the KV is not laid out
    as split K and V; such a pool is copied by a copier given to the engine."""

    @property
    def kv(self) -> KVConfig: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def k_buffers(self) -> list[torch.Tensor] | None: ...
    @property
    def v_buffers(self) -> list[torch.Tensor] | None: ...


class DevicePool:
    """Per-layer K and V pages on the compute device (``"cpu"`` for CPU-only runs)."""

    def __init__(self, kv: KVConfig, num_pages: int, device: str = "cpu") -> None:
        if not isinstance(kv, KVConfig):
            raise TypeError(f"kv: expected KVConfig, got {type(kv).__name__}")
        self.kv = kv
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        check_device_pool_memory(kv, num_pages, device, option="num_pages")
        self.device = torch.device(device)
        shape = (num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim)
        dtype = kv.torch_dtype
        # (num_pages, page_size, H, D) per layer
        self.k_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(kv.num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(kv.num_layers)
        ]

    @property
    def page_nbytes_per_layer(self) -> int:
        """Bytes of one page's K (or V) in one layer: one row of a buffer."""
        return self.kv.page_size * self.kv.num_kv_heads * self.kv.head_dim * self.kv.itemsize

    @property
    def nbytes(self) -> int:
        return 2 * self.kv.num_layers * self.num_pages * self.page_nbytes_per_layer

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V buffers of layer ``i``, each ``(num_pages, page_size, H, D)``."""
        self._check_layer(i)
        return self.k_buffers[i], self.v_buffers[i]

    def write_pages(
        self, layer: int, page_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write whole pages of one layer.

        ``k`` and ``v`` are token-major rows ``(len(page_ids) * page_size, H, D)``: row
        ``j * page_size + t`` is token ``t`` of page ``page_ids[j]``.
        """
        self._check_layer(layer)
        check_page_ids("page_ids", page_ids, self.num_pages)
        num = page_ids.numel()
        expected = (num * self.kv.page_size, self.kv.num_kv_heads, self.kv.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected}, got {tuple(t.shape)}")
            if t.dtype != self.kv.torch_dtype:
                raise TypeError(f"{name}: expected dtype {self.kv.torch_dtype}, got {t.dtype}")
        if num == 0:
            return
        ids = page_ids.to(self.device, non_blocking=True)
        for buf, src in ((self.k_buffers[layer], k), (self.v_buffers[layer], v)):
            src = src.to(self.device).contiguous()
            as_rows(buf, self.num_pages).index_copy_(0, ids, as_rows(src, num))

    def read_pages(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy whole pages of one layer out as ``(len(page_ids) * page_size, H, D)`` K and V."""
        self._check_layer(layer)
        check_page_ids("page_ids", page_ids, self.num_pages)
        ids = page_ids.to(self.device, non_blocking=True)
        shape = (-1, self.kv.num_kv_heads, self.kv.head_dim)
        k = self.k_buffers[layer].index_select(0, ids).reshape(shape)
        v = self.v_buffers[layer].index_select(0, ids).reshape(shape)
        return k, v

    def _check_layer(self, i: int) -> None:
        if check_int("layer", i) >= self.kv.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.kv.num_layers}, got {i}")


def _unregister(cudart: Any, ptrs: list[int], buffer: torch.Tensor) -> None:
    # `buffer` is an argument only to keep the memory alive until it is unregistered.
    for ptr in ptrs:
        cudart.cudaHostUnregister(ptr)


class HostPool:
    """Backup copies of pages in host memory, page-first.

    ``buffer`` is ``(num_pages, num_layers, 2, page_size, H, D)``; ``buffer[p]`` is one
    contiguous block of ``kv.page_nbytes`` bytes. Memory is not initialised: a page
    holds garbage until something is written to it.

    Pinning (``pin_memory=None``: when CUDA is available) registers the buffer with
    CUDA in chunks of ``1 GiB`` rather than allocating it pinned: one registration of
    hundreds of GiB stalls for minutes, and chunks keep the buffer a single tensor
    (one index space for gathers). A copy must not span two registrations, so
    ``pin_chunk_pages`` is exported and the transfer engine splits runs at its
    multiples.

    ``prefault=True`` zeroes the buffer now (pinning maps its pages in anyway): the
    operating system maps a page of a fresh allocation only when it is first written,
    and without it the first copy into each host page pays that fault (measured with
    vLLM's CPU worker: ~1 s per GiB, on the cores that compute).
    """

    def __init__(
        self,
        kv: KVConfig,
        num_pages: int,
        *,
        pin_memory: bool | None = None,
        reserve_nbytes: int = 2 * GiB,
        prefault: bool = False,
    ) -> None:
        if not isinstance(kv, KVConfig):
            raise TypeError(f"kv: expected KVConfig, got {type(kv).__name__}")
        self.kv = kv
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        reserve_nbytes = check_int("reserve_nbytes", reserve_nbytes)
        prefault = check_bool("prefault", prefault)
        request_nbytes = num_pages * kv.page_nbytes
        available = psutil.virtual_memory().available
        if request_nbytes > available - reserve_nbytes:
            raise ValueError(
                f"host pool: requested {request_nbytes} bytes ({num_pages} pages x "
                f"{kv.page_nbytes} bytes) but only {max(0, available - reserve_nbytes)} bytes "
                f"may be used ({available} available minus host_reserve_nbytes="
                f"{reserve_nbytes}); lower host_tokens / host_nbytes / host_ratio or "
                "host_reserve_nbytes"
            )
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        # (num_pages, num_layers, 2, page_size, H, D)
        self.buffer = torch.empty(
            (num_pages, kv.num_layers, 2, kv.page_size, kv.num_kv_heads, kv.head_dim),
            dtype=kv.torch_dtype,
        )
        self.pin_chunk_pages = max(1, _PIN_CHUNK_NBYTES // kv.page_nbytes)
        self.pinned = False
        if pin_memory:
            self._pin()
        elif prefault:
            self.buffer.view(-1).view(torch.uint8).zero_()

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        base = self.buffer.data_ptr()
        chunk_nbytes = self.pin_chunk_pages * self.kv.page_nbytes
        ptrs: list[int] = []
        for offset in range(0, self.nbytes, chunk_nbytes):
            size = min(chunk_nbytes, self.nbytes - offset)
            err = cudart.cudaHostRegister(base + offset, size, 0)
            if int(err) != 0:
                _unregister(cudart, ptrs, self.buffer)
                raise RuntimeError(f"cudaHostRegister failed with {err} at offset {offset}")
            ptrs.append(base + offset)
        weakref.finalize(self, _unregister, cudart, ptrs, self.buffer)
        self.pinned = True

    @property
    def page_nbytes(self) -> int:
        return self.kv.page_nbytes

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.kv.page_nbytes

    def page(self, i: int) -> torch.Tensor:
        """View of page ``i``: ``(num_layers, 2, page_size, H, D)``, contiguous."""
        if check_int("page id", i) >= self.num_pages:
            raise ValueError(f"page id: expected 0 <= id < {self.num_pages}, got {i}")
        return self.buffer[i]

    def pages(self, page_ids: torch.Tensor) -> torch.Tensor:
        """Copy of the given pages: ``(len(page_ids), num_layers, 2, page_size, H, D)``."""
        check_page_ids("page_ids", page_ids, self.num_pages)
        return self.buffer.index_select(0, page_ids)

    def read_page_bytes(self, page_id: int) -> torch.Tensor:
        """Copy of page ``page_id`` as ``kv.page_nbytes`` uint8 (what a third tier stores)."""
        return self.page(page_id).reshape(-1).view(torch.uint8).clone()

    def write_page_bytes(
        self, page_id: int, data: bytes | bytearray | memoryview | torch.Tensor
    ) -> None:
        """Overwrite page ``page_id`` with exactly ``kv.page_nbytes`` bytes."""
        dst = self.page(page_id).reshape(-1).view(torch.uint8)
        if isinstance(data, torch.Tensor):
            src = data.reshape(-1).view(torch.uint8) if data.is_contiguous() else None
            if src is None:
                raise ValueError("data: expected a contiguous tensor, got a strided one")
        elif isinstance(data, bytes | bytearray | memoryview):
            view = memoryview(data).cast("B")
            if view.nbytes != dst.numel():
                raise ValueError(f"data: expected {dst.numel()} bytes, got {view.nbytes}")
            # torch.frombuffer warns on read-only buffers; the copy below only reads them.
            src = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        else:
            raise TypeError(f"data: expected bytes or a uint8 tensor, got {type(data).__name__}")
        if src.numel() != dst.numel():
            raise ValueError(f"data: expected {dst.numel()} bytes, got {src.numel()}")
        dst.copy_(src)
