"""Copying pages between a device pool and a host pool that both live in host memory.

:class:`PageCopier` is what the CPU executors of :mod:`hicache.transfer` call; it moves
whole rows (one page's K or V of one layer) with the native row copier when one can be
built (:func:`load_native_copier`, the C source in ``copier.c`` next to this module),
else with torch gathers and scatters. :func:`copy_rows` is the one call into the native
copier, shared with the vLLM connector's block copier. Nothing here knows streams,
ordering or which pages are in use: callers hold the pages still while a copy runs.
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
from pathlib import Path

import torch

from hicache.checks import check_int
from hicache.memory.pools import DevicePool, HostPool, as_rows

# The C source, shipped as package data beside this module.
SOURCE_PATH = Path(__file__).with_name("copier.c")

# Rows per call below which the native copier runs on one thread (threads cost ~20 us).
_NATIVE_THREAD_MIN_NBYTES = 1 << 20
# Torch fallback: bytes gathered per chunk, small enough to stay in cache between passes.
_STAGING_NBYTES = 4 << 20
# Transfers from this size on are written with streaming stores (see ``copier.c``). Measured
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


def _library_path(source: bytes) -> Path:
    """Where the library built from ``source`` is cached.

    The name carries the source's digest, so an edited ``copier.c`` builds a new
    library instead of loading one compiled from an older source.
    """
    digest = hashlib.sha256(source).hexdigest()[:16]
    cache_dir = Path(os.environ.get("HICACHE_CACHE_DIR", Path.home() / ".cache" / "hicache"))
    return cache_dir / f"copier-{digest}.so"


@functools.cache
def load_native_copier() -> ctypes.CDLL | None:
    """Compile (once per machine, cached on disk) and load the row copier; None if no C compiler.

    The source is ``copier.c`` beside this module; the cache directory is
    ``$HICACHE_CACHE_DIR``, else ``~/.cache/hicache``.
    """
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    # Read once: the digest names exactly the bytes compiled. A missing file is a broken
    # install, not a missing compiler, so it raises rather than falling back quietly.
    source = SOURCE_PATH.read_bytes()
    lib_path = _library_path(source)
    cache_dir = lib_path.parent
    try:
        if not lib_path.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")
            os.close(fd)
            cmd = [compiler, "-O2", "-shared", "-fPIC", "-pthread", "-x", "c", "-", "-o", tmp]
            proc = subprocess.run(cmd, input=source, capture_output=True, timeout=120)
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
        streaming_min_nbytes = check_int("streaming_min_nbytes", streaming_min_nbytes)
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
