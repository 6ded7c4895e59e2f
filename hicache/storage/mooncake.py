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

The tier's epoch (docs/storage.md, "Where a Mooncake epoch lives") is recorded
twice under ``hicache-epoch`` (not a hex page key, so no page can take its place):
in the master's own HTTP metadata store, which no client's exit takes away, and
as an object, which lives in some client's segment. The epoch is the larger of the
two; every client that knows an epoch puts it back where it is missing or lower
(every ``epoch_refresh_s``, on a thread), so it outlives the exit of whoever wrote
it and comes back after a master restart (which empties both, and every page). A
client that finds neither waits ``epoch_wait_s`` for a live client to put it back
before it takes 0. The store has no compare-and-swap: two processes bumping at the
same instant may both get the same new epoch. ``clear`` keeps it.

This module knows nothing about keys' meaning, the KV layout or the cache.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, NoReturn
from urllib.parse import quote, urlsplit

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
        epoch_refresh_s: float = 0.5,
        epoch_wait_s: float = 1.5,
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
        self.connect_timeout_s = connect_timeout_s
        self.epoch_refresh_s = epoch_refresh_s
        self.epoch_wait_s = epoch_wait_s
        self._known_epoch: int | None = None  # the highest epoch this client read or wrote
        self._epoch_keeper: threading.Thread | None = None  # puts it back (see the docstring)
        self._stopping = threading.Event()
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
        # It takes the epoch object too: put it back (an epoch must never go back).
        # force: without it objects under a lease (read or written in the last few
        # seconds) stay, and a clear right after a run removed nothing.
        epoch = self._read_epoch()
        had_record = int(self._call("is_exist", EPOCH_KEY) == 1)
        code = int(self._call("remove_all", True))
        if code < 0:
            self._fail(f"remove_all: code {code}")
        self._write_epoch(epoch)
        return max(code - had_record, 0)

    # ---- the epoch (see the module docstring) -----------------------------------

    def _read_epoch(self) -> int:
        recorded = self._recorded_epoch()
        if recorded is None and self._known_epoch is None:
            # Lost with the master (a restart), or never written: live clients put it
            # back within epoch_refresh_s; wait for them before believing it is 0.
            deadline = time.monotonic() + self.epoch_wait_s
            while recorded is None and time.monotonic() < deadline:
                time.sleep(min(0.1, self.epoch_refresh_s))
                recorded = self._recorded_epoch()
        epoch = max(recorded or 0, self._known_epoch or 0)
        self._learn(epoch)
        return epoch

    def _bump_epoch(self) -> int:
        epoch = self._read_epoch() + 1
        self._write_epoch(epoch)
        return epoch

    def _advance_epoch(self, epoch: int) -> int:
        recorded = self._read_epoch()
        if epoch > recorded:
            self._write_epoch(epoch)
        return max(epoch, recorded)

    def _recorded_epoch(self) -> int | None:
        """The larger of the two records (None: neither exists)."""
        both = [e for e in (self._metadata_epoch(), self._object_epoch()) if e is not None]
        return max(both) if both else None

    def _object_epoch(self) -> int | None:
        if self._call("is_exist", EPOCH_KEY) != 1:
            return None
        return _parse_epoch(bytes(self._call("get", EPOCH_KEY)), "object")

    def _metadata_epoch(self) -> int | None:
        try:
            with urllib.request.urlopen(self._metadata_request("GET"),
                                        timeout=self.connect_timeout_s) as r:
                return _parse_epoch(r.read(), "metadata record")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            self._fail(f"GET {EPOCH_KEY} from the metadata server: HTTP {e.code}")
        except OSError as e:
            self._fail(f"GET {EPOCH_KEY} from the metadata server: {e}")

    def _write_epoch(self, epoch: int, *, metadata: bool = True, obj: bool = True) -> None:
        value = f"{epoch}\n".encode()
        if metadata:
            try:
                with urllib.request.urlopen(self._metadata_request("PUT", value),
                                            timeout=self.connect_timeout_s):
                    pass
            except OSError as e:  # HTTPError included
                self._fail(f"PUT {EPOCH_KEY} to the metadata server: {e}")
        if obj:
            code = self._call("upsert", EPOCH_KEY, value)
            if code <= _CONNECTION_CODE_MAX:
                self._fail(f"upsert {EPOCH_KEY}: code {code}")
            # Any other failure (no segment has room): the metadata record holds it.
        self._learn(epoch)

    def _metadata_request(self, method: str, data: bytes | None = None) -> urllib.request.Request:
        return urllib.request.Request(f"{self.metadata_url}?key={quote(EPOCH_KEY)}", data=data,
                                      method=method)

    def _learn(self, epoch: int) -> None:
        """This client knows ``epoch`` now: from here on it keeps the records at least
        as high (a thread, started the first time)."""
        with self._state_lock:
            self._known_epoch = max(epoch, self._known_epoch or 0)
            if self._epoch_keeper is not None:
                return
            self._epoch_keeper = threading.Thread(target=self._keep_epoch, daemon=True,
                                                  name="hicache-mooncake-epoch")
        self._epoch_keeper.start()

    def _keep_epoch(self) -> None:
        """Every ``epoch_refresh_s``: put the known epoch back into a record that lost it
        (its holder left, the master restarted) or holds less (max-merge)."""
        while not self._stopping.wait(self.epoch_refresh_s):
            known = self._known_epoch or 0
            try:
                meta, obj = self._metadata_epoch(), self._object_epoch()
                if meta is None or meta < known or obj is None or obj < known:
                    self._write_epoch(known, metadata=meta is None or meta < known,
                                      obj=obj is None or obj < known)
            except StorageError:
                continue  # the master is away: the breaker says so to the other ops
            except Exception:  # noqa: BLE001 (a client library error: try again next period)
                continue

    def _close(self) -> None:
        self._stopping.set()
        if self._epoch_keeper is not None:
            self._epoch_keeper.join(timeout=30)
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

    def _fail(self, what: str) -> NoReturn:
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


def _parse_epoch(value: bytes, where: str) -> int:
    text = value.decode("ascii", "replace")
    if not text.strip().isdigit():
        raise StorageError(f"mooncake: {EPOCH_KEY} ({where}) holds {text[:40]!r}, expected a "
                           "decimal epoch")
    return int(text)


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
