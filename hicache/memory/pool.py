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
use (that is the allocator's job), nor streams or ordering (the transfer engine's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import psutil
import torch

from hicache.checks import check_int, check_page_ids
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
        return psutil.virtual_memory().available
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
    pages = config.num_device_pages + config.num_host_pages
    host_need = pages * _ALLOCATOR_NBYTES_PER_PAGE
    if config.allocate_kv:
        check_device_pool_memory(config.kv, config.num_device_pages, config.device)
        host_need += config.num_host_pages * config.kv.page_nbytes
        if config.device == "cpu":  # both pools then come out of the same memory
            host_need += config.num_device_pages * config.kv.page_nbytes
    available = psutil.virtual_memory().available
    usable = available - (config.host_reserve_nbytes if config.num_host_pages else 0)
    if host_need > usable:
        options = "host_tokens / host_nbytes / host_ratio or host_reserve_nbytes"
        if config.device == "cpu" and config.allocate_kv:
            options = "device_tokens / device_nbytes, " + options
        raise ValueError(
            f"host memory: {host_need} bytes asked for (page allocators for {pages} pages"
            + (", the KV pools" if config.allocate_kv else "")
            + f") but only {max(0, usable)} bytes may be used ({available} available"
            + (f" minus host_reserve_nbytes={config.host_reserve_nbytes}"
               if config.num_host_pages else "")
            + f"); lower {options}"
        )


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
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"layer: expected int, got {type(i).__name__}")
        if not 0 <= i < self.kv.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.kv.num_layers}, got {i}")


def _unregister(cudart, ptrs: list[int], buffer: torch.Tensor) -> None:
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
    """

    def __init__(
        self,
        kv: KVConfig,
        num_pages: int,
        *,
        pin_memory: bool | None = None,
        reserve_nbytes: int = 2 * GiB,
    ) -> None:
        if not isinstance(kv, KVConfig):
            raise TypeError(f"kv: expected KVConfig, got {type(kv).__name__}")
        self.kv = kv
        self.num_pages = check_int("num_pages", num_pages, minimum=1)
        if isinstance(reserve_nbytes, bool) or not isinstance(reserve_nbytes, int):
            raise TypeError(f"reserve_nbytes: expected int, got {type(reserve_nbytes).__name__}")
        if reserve_nbytes < 0:
            raise ValueError(f"reserve_nbytes: expected >= 0, got {reserve_nbytes}")
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
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"page id: expected int, got {type(i).__name__}")
        if not 0 <= i < self.num_pages:
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


# Moves rows ``dst[p] + dst_ids[i] * dst_stride <- src[p] + src_ids[i] * src_stride`` for
# every plane p in one pass. torch has no single op that gathers and scatters at once:
# gather into staging then scatter reads and writes every byte twice and stays near half
# of a contiguous copy on small machines; this loop moves each byte once.
# ``streaming`` writes with non-temporal stores: a row of a few KiB is too short for
# memcpy to choose them itself, and without them every destination line is first read
# into the cache (read-for-ownership) and later written back, a third of the traffic of
# a transfer larger than the last-level cache. Only x86-64 has them here (SSE2 is part of
# its base ISA); elsewhere the flag is ignored.
_C_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef struct {
  int64_t num_planes;
  char *const *dst;
  const char *const *src;
  int64_t dst_stride, src_stride, row_nbytes;
  const int64_t *dst_ids, *src_ids;
  int64_t begin, end, streaming;
} hc_job;

static void hc_row(char *d, const char *s, int64_t n, int64_t streaming) {
#if defined(__x86_64__)
  if (streaming && ((uintptr_t)d & 15) == 0) {
    const int64_t bulk = n & ~(int64_t)63;
    for (int64_t o = 0; o < bulk; o += 64) {
      const __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
      const __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
      const __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
      const __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
      _mm_stream_si128((__m128i *)(d + o), a);
      _mm_stream_si128((__m128i *)(d + o + 16), b);
      _mm_stream_si128((__m128i *)(d + o + 32), c);
      _mm_stream_si128((__m128i *)(d + o + 48), e);
    }
    if (bulk < n) memcpy(d + bulk, s + bulk, (size_t)(n - bulk));
    return;
  }
#endif
  (void)streaming;
  memcpy(d, s, (size_t)n);
}

static void *hc_run(void *arg) {
  const hc_job *j = (const hc_job *)arg;
  for (int64_t i = j->begin; i < j->end; ++i) {
    const int64_t d = j->dst_ids[i] * j->dst_stride, s = j->src_ids[i] * j->src_stride;
    for (int64_t p = 0; p < j->num_planes; ++p)
      hc_row(j->dst[p] + d, j->src[p] + s, j->row_nbytes, j->streaming);
  }
#if defined(__x86_64__)
  /* Streaming stores are weakly ordered: make them visible before reporting done. */
  if (j->streaming) _mm_sfence();
#endif
  return 0;
}

int hc_copy_rows(int64_t num_planes, char *const *dst, const char *const *src,
                 int64_t dst_stride, int64_t src_stride, int64_t row_nbytes,
                 const int64_t *dst_ids, const int64_t *src_ids, int64_t num_rows,
                 int64_t num_threads, int64_t streaming) {
  enum { MAX_THREADS = 64 };
  hc_job jobs[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS];
  if (num_threads > num_rows) num_threads = num_rows;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads < 1) num_threads = 1;
  const int64_t per = (num_rows + num_threads - 1) / num_threads;
  for (int64_t t = 0; t < num_threads; ++t) {
    const int64_t b = t * per, e = b + per < num_rows ? b + per : num_rows;
    hc_job job = {num_planes, dst, src, dst_stride, src_stride, row_nbytes,
                  dst_ids, src_ids, b < e ? b : e, e, streaming};
    jobs[t] = job;
  }
  for (int64_t t = 1; t < num_threads; ++t)
    started[t] = pthread_create(&tids[t], 0, hc_run, &jobs[t]) == 0;
  hc_run(&jobs[0]);
  for (int64_t t = 1; t < num_threads; ++t) {
    if (started[t]) pthread_join(tids[t], 0);
    else hc_run(&jobs[t]);
  }
  return 0;
}
"""

# Rows per call below which the native copier runs on one thread (threads cost ~20 us).
_NATIVE_THREAD_MIN_NBYTES = 1 << 20
# Torch fallback: bytes gathered per chunk, small enough to stay in cache between passes.
_STAGING_NBYTES = 4 << 20
# Transfers from this size on are written with streaming stores (see ``_C_SOURCE``). Measured
# here (32 MiB L3, 2 cores): at 4 MiB cached stores were 10-15% faster (the destination
# still fits in the cache next to the source), at 8 MiB and above streaming ones were
# 1.4-2.5x faster.
STREAMING_MIN_NBYTES = 8 << 20


def copy_rows(
    lib: ctypes.CDLL, dst_ptrs, src_ptrs, first_plane: int, num_planes: int,
    dst_stride: int, src_stride: int, row_nbytes: int,
    dst_ids: torch.Tensor, src_ids: torch.Tensor, *,
    max_threads: int | None = None, streaming: bool = False,
) -> None:
    """One native copy: row ``dst_ids[i]`` of planes ``first_plane ..`` (``num_planes`` of
    them, pointer arrays ``dst_ptrs`` / ``src_ptrs``) from row ``src_ids[i]``.

    ``dst_ids``/``src_ids`` are contiguous int64 CPU tensors of equal length. Copies
    under ``_NATIVE_THREAD_MIN_NBYTES`` stay on one thread (thread wake-ups cost more
    than they save); larger ones fan out to torch's intra-op threads, at most
    ``max_threads``.
    """
    num_rows = dst_ids.numel()
    total = num_rows * num_planes * row_nbytes
    num_threads = torch.get_num_threads() if total >= _NATIVE_THREAD_MIN_NBYTES else 1
    if max_threads is not None:
        num_threads = min(num_threads, max_threads)
    offset = first_plane * ctypes.sizeof(ctypes.c_void_p)
    lib.hc_copy_rows(
        num_planes, ctypes.addressof(dst_ptrs) + offset, ctypes.addressof(src_ptrs) + offset,
        dst_stride, src_stride, row_nbytes, dst_ids.data_ptr(), src_ids.data_ptr(),
        num_rows, num_threads, int(streaming),
    )


@functools.cache
def load_native_copier() -> ctypes.CDLL | None:
    """Compile (once per machine, cached on disk) and load the row copier; None if no C compiler.

    The cache directory is ``$HICACHE_CACHE_DIR``, else ``~/.cache/hicache``.
    """
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    digest = hashlib.sha256(_C_SOURCE.encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("HICACHE_CACHE_DIR", Path.home() / ".cache" / "hicache"))
    lib_path = cache_dir / f"pagecopy-{digest}.so"
    try:
        if not lib_path.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")
            os.close(fd)
            cmd = [compiler, "-O2", "-shared", "-fPIC", "-pthread", "-x", "c", "-", "-o", tmp]
            proc = subprocess.run(cmd, input=_C_SOURCE.encode(), capture_output=True, timeout=120)
            if proc.returncode != 0:
                os.unlink(tmp)
                return None
            os.replace(tmp, lib_path)  # atomic: concurrent builders never see half a file
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.SubprocessError):
        return None
    lib.hc_copy_rows.restype = ctypes.c_int
    lib.hc_copy_rows.argtypes = [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ]
    return lib


class PageCopier:
    """Copies pages between a device pool and a host pool that both live in host memory.

    Used by the CPU executors. Every page move is a set of rows of
    ``page_nbytes_per_layer`` bytes: per layer, K and V (each a row of a device buffer
    and one slot of a host page). With ``native`` (None: when a C compiler is found)
    rows move once through :func:`load_native_copier`, with the row pointers of every
    layer computed once here, so one call costs one ctypes call; otherwise through torch
    ``index_select(out=staging)`` / ``index_copy_`` in cache-sized chunks, on 4-byte
    views where the row size allows.

    ``streaming_min_nbytes``: transfers of at least this many bytes (all layers of
    all their pages, whatever layer range one call moves) are written with streaming
    stores that bypass the cache (native copier on x86-64 only). Smaller transfers are
    written through the cache, where whoever reads them next finds them. Thread-safe
    for copies of different pages: the native path keeps no state between calls and
    the torch path's staging buffers are per thread.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        native: bool | None = None,
        *,
        streaming_min_nbytes: int = STREAMING_MIN_NBYTES,
    ):
        if device_pool.device.type != "cpu":
            raise ValueError(f"device pool: expected device 'cpu', got {device_pool.device}")
        if isinstance(streaming_min_nbytes, bool) or not isinstance(streaming_min_nbytes, int):
            raise TypeError(
                f"streaming_min_nbytes: expected int, got {type(streaming_min_nbytes).__name__}"
            )
        kv = device_pool.kv
        self.num_layers = kv.num_layers
        self.row_nbytes = device_pool.page_nbytes_per_layer
        self.page_nbytes = kv.page_nbytes
        self.streaming_min_nbytes = streaming_min_nbytes
        self.lib = load_native_copier() if native is not False else None
        if native and self.lib is None:
            raise RuntimeError("native page copier: no C compiler found or the build failed")
        # (num_device_pages, row_words) per layer
        self._dev = [
            (as_rows(k, device_pool.num_pages), as_rows(v, device_pool.num_pages))
            for k, v in zip(device_pool.k_buffers, device_pool.v_buffers, strict=True)
        ]
        # (num_host_pages, num_layers, 2, row_words)
        self._host = as_rows(host_pool.buffer, host_pool.num_pages * kv.num_layers * 2).view(
            host_pool.num_pages, kv.num_layers, 2, -1
        )
        # Plane 2 * layer + kv (K = 0, V = 1): its base pointer in each pool. A device
        # row is one buffer row; a host row sits at its plane's offset inside a page.
        ptrs = ctypes.c_void_p * (2 * kv.num_layers)
        host_base = host_pool.buffer.data_ptr()
        self._dev_ptrs = ptrs(*[t.data_ptr() for pair in self._dev for t in pair])
        self._host_ptrs = ptrs(
            *[host_base + plane * self.row_nbytes for plane in range(2 * kv.num_layers)]
        )
        # The pointer arrays point into these tensors: keep them alive with the copier.
        self._buffers = (device_pool.k_buffers, device_pool.v_buffers, host_pool.buffer)
        self._local = threading.local()  # .staging: {is_load: tensor} of this thread

    def load(self, host_ids: torch.Tensor, device_ids: torch.Tensor, first: int, last: int):
        """Copy layers ``first .. last-1`` of host pages to device pages."""
        if self.lib is not None:
            self._copy_native(self._dev_ptrs, self._host_ptrs, self.row_nbytes,
                              self.page_nbytes, device_ids, host_ids, first, last)
            return
        planes = [
            (dst, self._host[:, layer, kv])
            for layer in range(first, last)
            for kv, dst in enumerate(self._dev[layer])
        ]
        self._copy_torch(planes, device_ids, host_ids, True)

    def backup(self, device_ids: torch.Tensor, host_ids: torch.Tensor, first: int, last: int):
        """Copy layers ``first .. last-1`` of device pages to host pages."""
        if self.lib is not None:
            self._copy_native(self._host_ptrs, self._dev_ptrs, self.page_nbytes,
                              self.row_nbytes, host_ids, device_ids, first, last)
            return
        planes = [
            (self._host[:, layer, kv], src)
            for layer in range(first, last)
            for kv, src in enumerate(self._dev[layer])
        ]
        self._copy_torch(planes, host_ids, device_ids, False)

    def _copy_torch(self, planes, dst_ids: torch.Tensor, src_ids: torch.Tensor,
                    is_load: bool) -> None:
        num_rows = dst_ids.numel()
        if num_rows == 0 or not planes:
            return
        rows_per_chunk = max(1, _STAGING_NBYTES // self.row_nbytes)
        cached = self._local.__dict__.setdefault("staging", {})
        staging = cached.get(is_load)
        if staging is None:
            # (rows_per_chunk, row_words); allocated and touched once, reused for every copy
            staging = torch.zeros((rows_per_chunk, planes[0][1].shape[1]), dtype=planes[0][1].dtype)
            cached[is_load] = staging
        for start in range(0, num_rows, rows_per_chunk):
            d_ids = dst_ids[start : start + rows_per_chunk]
            s_ids = src_ids[start : start + rows_per_chunk]
            chunk = staging[: d_ids.numel()]
            for dst, src in planes:
                torch.index_select(src, 0, s_ids, out=chunk)
                dst.index_copy_(0, d_ids, chunk)

    def _copy_native(self, dst_ptrs, src_ptrs, dst_stride: int, src_stride: int,
                     dst_ids: torch.Tensor, src_ids: torch.Tensor, first: int, last: int) -> None:
        assert 0 <= first <= last <= self.num_layers, (
            f"layer range [{first}, {last}) outside [0, {self.num_layers}): would copy "
            "outside the pools"
        )
        num_rows = dst_ids.numel()
        if num_rows == 0 or first == last:
            return
        dst_ids = dst_ids.contiguous()
        src_ids = src_ids.contiguous()
        copy_rows(
            self.lib, dst_ptrs, src_ptrs, 2 * first, 2 * (last - first), dst_stride, src_stride,
            self.row_nbytes, dst_ids, src_ids,
            streaming=num_rows * self.page_nbytes >= self.streaming_min_nbytes,
        )
