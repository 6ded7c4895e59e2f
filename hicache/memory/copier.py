"""Copying pages between a device pool and a host pool that both live in host memory.

:class:`PageCopier` is what the CPU executors of :mod:`hicache.transfer` call; it moves
whole rows (one page's K or V of one layer) with the native row copier when one can be
found (:func:`load_copier`: compiled from ``copier.c`` next to this module at install,
or at run time as the fallback), else with torch gathers and scatters. :func:`copy_rows` is the one call into the native
copier, shared with the vLLM connector's block copier. Nothing here knows streams,
ordering or which pages are in use: callers hold the pages still while a copy runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.buildcache import (
    compile_copier,
    copier_cache_path,
    copier_digest,
    hold,
    prune_copier_cache,
)
from hicache.checks import check_int
from hicache.memory.pools import DevicePool, HostPool, as_rows

# The C source, shipped as package data beside this module.
SOURCE_PATH = Path(__file__).with_name("copier.c")
# The library setup.py compiles from it at install (an extension module by name only:
# it is loaded with ctypes).
INSTALLED_PATH = SOURCE_PATH.with_name("_copier" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))

# Rows per call below which the native copier runs on one thread (threads cost ~20 us).
_NATIVE_THREAD_MIN_NBYTES = 1 << 20
# Torch fallback: bytes gathered per chunk, small enough to stay in cache between passes.
_STAGING_NBYTES = 4 << 20
# Transfers from this size on are written with streaming stores (see ``copier.c``). Measured
# here (32 MiB L3, 2 cores): at 4 MiB cached stores were 10-15% faster (the destination
# still fits in the cache next to the source), at 8 MiB and above streaming ones were
# 1.4-2.5x faster.
STREAMING_MIN_NBYTES = 8 << 20

if TYPE_CHECKING:
    # One pointer per plane (a layer's K or V), the layout the C copier walks.
    PointerArray = ctypes.Array[ctypes.c_void_p]


def copy_rows(
    lib: ctypes.CDLL, dst_ptrs: PointerArray, src_ptrs: PointerArray, first_plane: int, num_planes: int,
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


class CopierLoad(NamedTuple):
    """What :func:`load_copier` found: the library, where it came from, or why none."""

    lib: ctypes.CDLL | None
    origin: str  # "installed", "jit-cache", "jit-build"; "" when lib is None
    reason: str  # why lib is None, or why the installed library was passed over ("" if not)


def _library_path(source: bytes) -> Path:
    """Where the JIT fallback caches the library built from ``source``."""
    return copier_cache_path(source)


def _load_installed(digest: str) -> tuple[ctypes.CDLL | None, str]:
    """The library compiled at install, if it was compiled from these source bytes."""
    if not INSTALLED_PATH.is_file():
        return None, "no copier compiled at install"
    try:
        lib = ctypes.CDLL(str(INSTALLED_PATH))
        lib.hc_source_digest.restype = ctypes.c_char_p
        built = lib.hc_source_digest().decode()
    except (OSError, AttributeError) as exc:
        return None, f"the copier compiled at install does not load: {exc}"
    if built != digest:
        return None, f"the copier compiled at install is stale (built from {built!r}, now {digest!r})"
    return lib, ""


def _load_jit(source: bytes) -> tuple[ctypes.CDLL | None, str, str]:
    """The JIT fallback: the cached library of these bytes, compiled first if there is
    none; returns (library, origin, reason). Compiling prunes stale libraries."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, "", f"no C compiler ({os.environ.get('CC', 'cc')!r} not found on PATH; set CC)"
    lib_path = _library_path(source)
    origin = "jit-cache"
    for _ in range(2):  # a second try if a pruner removed it between the build and the load
        try:
            if not lib_path.exists():
                origin = "jit-build"
                compile_copier(source, lib_path, compiler=compiler)
                prune_copier_cache(source)
            hold(lib_path)  # before loading: a pruner never removes it from now on
            return ctypes.CDLL(str(lib_path)), origin, ""
        except FileNotFoundError:
            continue
        except subprocess.CalledProcessError as exc:
            first = exc.stderr.decode(errors="replace").strip().splitlines()[:1]
            return None, "", f"the copier does not compile: {first[0] if first else exc}"
        except (OSError, subprocess.SubprocessError) as exc:
            return None, "", f"the copier does not build: {type(exc).__name__}: {exc}"
    return None, "", f"{lib_path} vanished twice while loading"


@functools.cache
def load_copier() -> CopierLoad:
    """Load the row copier: the library compiled at install (``setup.py``) while it was
    built from the ``copier.c`` beside this module, else the JIT fallback: compiled
    once per version of that file with the system C compiler (``$CC``, else ``cc``)
    into ``$HICACHE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/hicache`` or ``~/.cache/hicache``).
    Never raises for a missing or failing compiler: ``lib`` is None and ``reason`` says why.
    """
    # Read once: the digest names exactly the bytes compiled. A missing file is a broken
    # install, not a missing compiler, so it raises rather than falling back quietly.
    source = SOURCE_PATH.read_bytes()
    lib, installed_reason = _load_installed(copier_digest(source))
    origin = "installed"
    reason = ""
    if lib is None:
        lib, origin, reason = _load_jit(source)
        reason = f"{installed_reason}; {reason}" if reason else installed_reason
    if lib is None:
        return CopierLoad(None, "", reason)
    lib.hc_copy_rows.restype = ctypes.c_int
    lib.hc_copy_rows.argtypes = [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ]
    return CopierLoad(lib, origin, reason)


def load_native_copier() -> ctypes.CDLL | None:
    """The row copier's library (see :func:`load_copier`), or None when there is none."""
    return load_copier().lib


def copier_status() -> str:
    """One line for people: where the row copier came from, or why it is unavailable."""
    loaded = load_copier()
    if loaded.lib is None:
        return f"unavailable, torch copies in use ({loaded.reason})"
    return {"installed": "compiled at install", "jit-cache": "loaded from an earlier JIT build",
            "jit-build": "compiled now"}[loaded.origin]


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
            raise RuntimeError(f"native page copier unavailable: {load_copier().reason}")
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

    def load(
        self, host_ids: torch.Tensor, device_ids: torch.Tensor, first: int, last: int
    ) -> None:
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

    def backup(
        self, device_ids: torch.Tensor, host_ids: torch.Tensor, first: int, last: int
    ) -> None:
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

    def _copy_torch(self, planes: list[tuple[torch.Tensor, torch.Tensor]], dst_ids: torch.Tensor, src_ids: torch.Tensor,
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

    def _copy_native(self, dst_ptrs: PointerArray, src_ptrs: PointerArray, dst_stride: int, src_stride: int,
                     dst_ids: torch.Tensor, src_ids: torch.Tensor, first: int, last: int) -> None:
        assert 0 <= first <= last <= self.num_layers, (
            f"layer range [{first}, {last}) outside [0, {self.num_layers}): would copy "
            "outside the pools"
        )
        num_rows = dst_ids.numel()
        if num_rows == 0 or first == last:
            return
        assert self.lib is not None, "native copy without the native copier"
        dst_ids = dst_ids.contiguous()
        src_ids = src_ids.contiguous()
        copy_rows(
            self.lib, dst_ptrs, src_ptrs, 2 * first, 2 * (last - first), dst_stride, src_stride,
            self.row_nbytes, dst_ids, src_ids,
            streaming=num_rows * self.page_nbytes >= self.streaming_min_nbytes,
        )
