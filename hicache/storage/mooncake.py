"""Mooncake Store backend (distributed memory pool).

Uses the optional extra ``mooncake-transfer-engine-non-cuda`` (CPU build, TCP
transport). A Mooncake cluster is one ``mooncake_master`` (object metadata, with
its HTTP metadata server for the transfer engine) plus clients that each lend a
*segment* of their memory to the pool. A value lives in some client's segment
and disappears when that client leaves, so
:func:`hicache.testing.mooncake_master.start_mooncake_master` (a loopback cluster
for tests, benchmarks and one-machine setups) can also start a segment holder
(the bundled ``mooncake_client``) whose memory outlives the processes that write
and read pages.

Values are moved with the scatter/gather batch calls: the 32-byte header goes to
a small staging array and the payload straight to or from the caller's page
memory, so no page-sized copy is made here.

Failures: the client library reports errors as negative codes (and, with the
master gone, each call takes a few seconds of internal retries). A
connection-class code raises :class:`StorageError` and opens a short breaker:
for ``retry_after_s`` every op raises at once instead of waiting again.

The tier's epoch is the object ``hicache-epoch`` (a decimal number; absent: 0;
not a hex page key, so no page can take its place). The store has no
compare-and-swap: two processes bumping at the same instant may both get the same
new epoch. ``clear`` keeps it.

This module knows nothing about keys' meaning, the KV layout or the cache.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from hicache.storage.base import (
    INTACT,
    UNAUTHENTIC,
    VALUE_HEADER_NBYTES,
    StorageBackend,
    StorageError,
    byte_view,
    verify_value,
)

MiB = 1 << 20
_CODE_NOT_FOUND = -704  # OBJECT_NOT_FOUND
_SIZE_CODES = (-600, -800)  # buffer too small / transfer failed: a size mismatch looks so
_CONNECTION_CODE_MAX = -900  # RPC_FAIL (-900) and below: the master cannot be reached
EPOCH_KEY = "hicache-epoch"
INSTALL_HINT = (
    "the Mooncake backend needs the 'mooncake' extra "
    "(pip install 'hicache[mooncake]', plus libibverbs1 librdmacm1 libnuma1 on Debian)"
)


def port_open(host: str, port: int, timeout_s: float) -> bool:
    """True when ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class MooncakeStorage(StorageBackend):
    """Pages in a Mooncake Store, reached through one ``MooncakeDistributedStore`` client."""

    def __init__(
        self,
        master_address: str,
        metadata_url: str,
        *,
        page_nbytes: int,
        local_hostname: str = "127.0.0.1",
        segment_nbytes: int = 64 * MiB,
        local_buffer_nbytes: int = 16 * MiB,
        protocol: str = "tcp",
        device_name: str = "",
        connect_timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(page_nbytes, secret=secret)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(f"{INSTALL_HINT}: {e}") from e
        host, port = _split_host_port(master_address)
        meta = urlsplit(metadata_url)
        if meta.scheme != "http" or not meta.hostname:
            raise ValueError(f"metadata_url: expected http://HOST:PORT/PATH, got {metadata_url!r}")
        self.master_address = master_address
        self.metadata_url = metadata_url
        self.value_nbytes = VALUE_HEADER_NBYTES + page_nbytes
        self.retry_after_s = retry_after_s
        self._state_lock = threading.Lock()
        self._down_until = 0.0
        self._last_failure = ""
        for what, (h, p) in (("master", (host, port)), ("metadata", (meta.hostname, meta.port))):
            if not port_open(h, p or 80, connect_timeout_s):
                raise StorageError(f"mooncake: {what} at {h}:{p or 80} is unreachable")
        if _is_ip(local_hostname):
            # The transfer engine advertises its first NIC unless told; keep it on our host.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        self._client = MooncakeDistributedStore()
        rc = self._client.setup(
            local_hostname,
            metadata_url,
            segment_nbytes,
            local_buffer_nbytes,
            protocol,
            device_name,
            master_address,
        )
        if rc != 0:
            raise StorageError(f"mooncake: setup against {master_address} failed (code {rc})")

    def __repr__(self) -> str:
        return f"MooncakeStorage({self.master_address!r}, {self.metadata_url!r})"

    def register_memory(self, buffer: Any) -> None:
        view = byte_view(buffer, None, writable=False)
        rc = self._client.register_buffer(_address(view), view.nbytes)
        if rc != 0:
            raise StorageError(f"mooncake: register_buffer of {view.nbytes} bytes: code {rc}")

    # ---- primitives -------------------------------------------------------------

    def _exists(self, keys: list[str]) -> int:
        codes = self._call("batch_is_exist", keys)
        for i, code in enumerate(codes):
            if code == 1:
                continue
            if code == 0:
                return i
            self._fail(f"batch_is_exist: code {code}")
        return len(keys)

    def _get_into(self, keys: list[str], views: list[memoryview]) -> int:
        headers = np.empty((len(keys), VALUE_HEADER_NBYTES), dtype=np.uint8)  # (n, 32)
        base = headers.ctypes.data
        ptrs = [[base + i * VALUE_HEADER_NBYTES, _address(v)] for i, v in enumerate(views)]
        sizes = [[VALUE_HEADER_NBYTES, self.page_nbytes]] * len(keys)
        codes = self._call("batch_get_into_multi_buffers", keys, ptrs, sizes)
        for i, (key, view, code) in enumerate(zip(keys, views, codes, strict=True)):
            if code == self.value_nbytes:
                verdict = self._verify(key, memoryview(headers[i]), view)  # counts a failure
                if verdict == INTACT:
                    continue
                self._drop_bad(key)
                if verdict == UNAUTHENTIC:
                    self._drop_unauthentic(keys[i + 1:], headers[i + 1:], views[i + 1:],
                                           codes[i + 1:])
                return i
            if code == _CODE_NOT_FOUND:
                return i
            if code <= _CONNECTION_CODE_MAX:
                self._fail(f"batch_get_into: code {code} for {key}")
            if code in _SIZE_CODES or code >= 0:
                size = self._call("get_size", key)
                if size >= 0 and size != self.value_nbytes:
                    self._count(num_corrupt_values=1)
                    self._drop_bad(key)
                    return i
                if size == _CODE_NOT_FOUND:
                    return i
            self._count(num_errors=1)  # a transfer failed: a miss, not a reason to stop serving
            return i
        return len(keys)

    def _set(self, keys: list[str], views: list[memoryview]) -> int:
        headers = np.frombuffer(
            b"".join(self._header(k, v) for k, v in zip(keys, views, strict=True)),
            dtype=np.uint8,
        )
        base = headers.ctypes.data
        ptrs = [[base + i * VALUE_HEADER_NBYTES, _address(v)] for i, v in enumerate(views)]
        sizes = [[VALUE_HEADER_NBYTES, self.page_nbytes]] * len(keys)
        codes = self._call("batch_put_from_multi_buffers", keys, ptrs, sizes)
        num_stored = len(keys)
        for i, code in enumerate(codes):
            if code == 0:
                continue
            if code <= _CONNECTION_CODE_MAX:
                self._fail(f"batch_put_from: code {code} for {keys[i]}")
            self._count(num_errors=1)  # no space left, or the object is being replaced
            num_stored = i
            break
        self._count(written_nbytes=num_stored * self.page_nbytes)
        return num_stored

    def _delete(self, keys: list[str]) -> int:
        codes = self._call("batch_remove", keys, True)  # force: ignore read leases
        for code in codes:
            if code <= _CONNECTION_CODE_MAX:
                self._fail(f"batch_remove: code {code}")
        return sum(1 for code in codes if code == 0)

    def _clear(self) -> int:
        # The store's remove_all: the number of objects removed, or a negative error code.
        # It takes the epoch record too: put it back (an epoch must never go back).
        # force: without it objects under a lease (read or written in the last few
        # seconds) stay, and a clear right after a run removed nothing.
        epoch = self._read_epoch()
        code: int = self._call("remove_all", True)
        if code < 0:
            self._fail(f"remove_all: code {code}")
        if epoch:
            self._write_epoch(epoch)
            code -= 1
        return max(code, 0)

    def _read_epoch(self) -> int:
        if self._call("is_exist", EPOCH_KEY) != 1:
            return 0
        text = bytes(self._call("get", EPOCH_KEY)).decode("ascii", "replace")
        if not text.strip().isdigit():
            raise StorageError(f"mooncake: {EPOCH_KEY} holds {text[:40]!r}, expected a "
                               "decimal epoch")
        return int(text)

    def _bump_epoch(self) -> int:
        epoch = self._read_epoch() + 1
        self._write_epoch(epoch)
        return epoch

    def _write_epoch(self, epoch: int) -> None:
        code = self._call("upsert", EPOCH_KEY, f"{epoch}\n".encode())
        if code != 0:
            self._fail(f"upsert {EPOCH_KEY}: code {code}")

    def _close(self) -> None:
        # With the master gone this takes seconds (measured 1-13 s): the library
        # retries the unmount while holding the GIL. Skipping it does not help: a
        # client left alive makes interpreter exit wait on its threads instead.
        self._client.close()

    # ---- internals --------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        with self._state_lock:
            if time.monotonic() < self._down_until:
                raise StorageError(
                    f"mooncake: {self.master_address} unavailable ({self._last_failure}); "
                    f"retrying after {self.retry_after_s} s"
                )
        try:
            return getattr(self._client, method)(*args)
        except (RuntimeError, OSError) as e:
            self._fail(f"{method}: {e}")

    def _fail(self, what: str) -> None:
        with self._state_lock:
            self._down_until = time.monotonic() + self.retry_after_s
            self._last_failure = what
        raise StorageError(f"mooncake: {self.master_address}: {what}")

    def _drop_unauthentic(self, keys: list[str], headers: np.ndarray, views: list[memoryview],
                          codes: list[int]) -> None:
        """Remove the planted values among the rest of a batch already fetched (past a miss
        they are not served anyway): a put does not replace an existing object, so each
        would otherwise keep our own page out for one more round of misses."""
        for key, header, view, code in zip(keys, headers, views, codes, strict=True):
            if code == self.value_nbytes and verify_value(
                key, memoryview(header), view, self._auth
            ) == UNAUTHENTIC:
                self._count(num_unauthentic_values=1)
                self._drop_bad(key)

    def _drop_bad(self, key: str) -> None:
        """Remove a value that failed verification (the caller counted it)."""
        code = self._call("remove", key, True)
        if code <= _CONNECTION_CODE_MAX:
            self._fail(f"remove corrupt {key}: code {code}")


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master address: expected HOST:PORT, got {address!r}")
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
