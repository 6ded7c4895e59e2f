"""The storage tier's interface: batch page ops by key, verified values, counters.

A stored value is one page's all-layer KV (the host pool's page-first block,
``page_nbytes`` bytes) behind a 64-byte header::

    | magic "HKV1" | version u16 (2) | flags u16 | payload_nbytes u64 | crc32 u32 | 12 x 0 |
    | tag: 32 bytes (HMAC-SHA256, see auth.py; zeros when flags has no TAGGED bit) | payload |

The crc32 covers the key, the payload length and the payload, so a value that is
corrupt, truncated, or filed under another key fails verification. Every get
verifies; a value that fails is a miss, is removed, and is counted
(``num_corrupt_values``): garbage never reaches the KV pool.

With a storage secret (``secret=`` or ``$HICACHE_STORAGE_SECRET``) every value
written is tagged, and a get serves only values whose tag verifies under the
secret: an intact value without a valid tag (planted by someone without the
secret, or written under another secret) is a miss, is removed like a corrupt
one, and is counted in ``num_unauthentic_values``. Without a secret the tag is
not checked: the store is trusted (docs/storage.md, "Security").

Ops take sequences of keys whose order is a page chain (see ``keys.py``), so
``exists``, ``get_into`` and ``set`` answer how many LEADING pages they covered:
a page past a miss is useless to a prefix cache.

A tier also keeps its *epoch* (:meth:`StorageBackend.epoch`): a generation number
stored in the tier itself and salted into every page key (``keys.root_key``), so
:meth:`StorageBackend.bump_epoch` invalidates every page stored before, for this
process and for every process that opens the tier afterwards (docs/storage.md);
:meth:`StorageBackend.advance_epoch` raises it to a given epoch, so that processes
that each retire their old pages after the same weight update agree on the new one.

Buffers are anything with the buffer protocol (bytes, bytearray, memoryview,
numpy arrays) or CPU torch tensors, contiguous, of exactly ``page_nbytes`` bytes;
backends read into and write from them directly, so the cache can hand over
host-pool page views without a staging copy.

This module knows no backend, no cache, and no tensor layout beyond bytes.
"""

from __future__ import annotations

import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from hicache.checks import check_int
from hicache.errors import StorageError  # defined with the others; raised from here
from hicache.storage.auth import TAG_NBYTES, PageAuthenticator, authenticator_for
from hicache.storage.keys import check_key

_T = TypeVar("_T")  # what a storage primitive returns

VALUE_HEADER_NBYTES = 64
_MAGIC = b"HKV1"
_VERSION = 2  # 2: the header carries an authentication tag (1: 32 bytes, no tag)
_FLAG_TAGGED = 1  # the tag field holds a tag (written with a storage secret)
_HEADER = struct.Struct(f"<4sHHQI12x{TAG_NBYTES}s")
_NO_TAG = bytes(TAG_NBYTES)
assert _HEADER.size == VALUE_HEADER_NBYTES, "header layout must stay 64 bytes"

# What verification says of a value read back.
INTACT = "intact"
CORRUPT = "corrupt"  # damaged, truncated, another key's value, or not a value at all
UNAUTHENTIC = "unauthentic"  # intact, but its tag does not verify under our secret


class StorageUsage(NamedTuple):
    """What a tier holds now, over every process that writes it."""

    num_pages: int  # stored values
    nbytes: int  # their size on the store, headers included


class StorageCounters(NamedTuple):
    """Totals since the backend was opened (this process only)."""

    num_get_pages: int  # pages asked for by get_into
    num_hit_pages: int  # pages returned verified
    num_set_pages: int  # pages offered to set
    num_stored_pages: int  # pages present after set (written or already there)
    num_deleted_pages: int  # pages removed by delete
    num_evicted_pages: int  # pages removed by the backend's own clean-up
    num_corrupt_values: int  # values that failed verification (each removed)
    num_unauthentic_values: int  # intact values whose tag did not verify (each removed)
    num_errors: int  # StorageError raised, plus per-page backend failures
    read_nbytes: int  # payload bytes returned by get_into
    written_nbytes: int  # payload bytes written by set


def value_crc(key: str, payload: memoryview) -> int:
    seed = zlib.crc32(key.encode() + len(payload).to_bytes(8, "little"))
    return zlib.crc32(payload, seed)


def encode_header(key: str, payload: memoryview, auth: PageAuthenticator | None = None) -> bytes:
    """The header that goes in front of ``payload`` when stored under ``key`` (tagged
    when ``auth`` is given)."""
    if auth is None:
        return _HEADER.pack(_MAGIC, _VERSION, 0, len(payload), value_crc(key, payload), _NO_TAG)
    return _HEADER.pack(
        _MAGIC, _VERSION, _FLAG_TAGGED, len(payload), value_crc(key, payload),
        auth.tag(key, payload),
    )


def verify_value(
    key: str,
    header: bytes | bytearray | memoryview,
    payload: memoryview,
    auth: PageAuthenticator | None = None,
) -> str:
    """:data:`INTACT`, :data:`CORRUPT` or :data:`UNAUTHENTIC`: what ``header`` + ``payload``
    read back under ``key`` is. With ``auth``, only a value whose tag verifies is intact."""
    if len(header) != VALUE_HEADER_NBYTES:
        return CORRUPT
    magic, version, flags, payload_nbytes, crc, tag = _HEADER.unpack(header)
    if magic != _MAGIC or version != _VERSION or payload_nbytes != len(payload):
        return CORRUPT
    if flags & ~_FLAG_TAGGED or (not flags & _FLAG_TAGGED and tag != _NO_TAG):
        return CORRUPT  # unknown flags, or bytes in the tag field of an untagged value
    if auth is not None and flags & _FLAG_TAGGED and auth.verify(key, payload, tag):
        return INTACT  # the tag covers the bytes: the crc adds nothing
    if crc != value_crc(key, payload):
        return CORRUPT
    return INTACT if auth is None else UNAUTHENTIC


def check_value(key: str, header: bytes | bytearray | memoryview, payload: memoryview) -> bool:
    """True when ``header`` + ``payload`` is an intact value stored under ``key`` (no secret)."""
    return verify_value(key, header, payload) == INTACT


def byte_view(buf: Any, nbytes: int | None, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of ``buf``'s memory (no copy), of exactly ``nbytes``
    (any size when ``nbytes`` is None)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"buffer: expected a CPU tensor, got device {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("buffer: expected a contiguous tensor, got a strided view")
        view = buf.detach().reshape(-1).view(torch.uint8).numpy().data
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer: expected a C-contiguous array, got a strided view")
        view = buf.reshape(-1).view(np.uint8).data
    else:
        try:
            view = memoryview(buf)
        except TypeError:
            raise TypeError(
                f"buffer: expected bytes-like, numpy array or CPU tensor, got {type(buf).__name__}"
            ) from None
        if not view.c_contiguous:
            raise ValueError("buffer: expected a contiguous buffer, got a strided view")
        view = view.cast("B")
    if nbytes is not None and view.nbytes != nbytes:
        raise ValueError(f"buffer: expected {nbytes} bytes (one page), got {view.nbytes}")
    if writable and view.readonly:
        raise ValueError("buffer: expected a writable buffer, got a read-only one")
    return view


class StorageBackend(ABC):
    """Batch page store by key; thread-safe; every public op validates its arguments.

    Subclasses implement the ``_exists`` / ``_get_into`` / ``_set`` / ``_delete`` /
    ``_close`` primitives on validated keys and byte views; this class counts,
    turns failures into :class:`StorageError`, and refuses use after ``close()``.

    ``secret`` (str or bytes; None: ``$HICACHE_STORAGE_SECRET``, if set) turns on
    the authenticator: values are tagged on write and served only if their tag
    verifies (see the module docstring). It is never stored, shown or logged.
    """

    def __init__(self, page_nbytes: int, *, secret: str | bytes | None = None) -> None:
        self.page_nbytes = check_int("page_nbytes", page_nbytes, minimum=1)
        self._auth = authenticator_for(secret)
        self._counter_lock = threading.Lock()
        self._counts = dict.fromkeys(StorageCounters._fields, 0)
        self._local = threading.local()  # per calling thread: unauthentic values found
        self._closed = False

    # ---- public API -------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are present (present-but-corrupt counts; get finds out)."""
        keys = self._checked_keys(keys)
        return self._run(self._exists, keys) if keys else 0

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> int:
        """Read the values of ``keys`` into ``buffers``; return how many LEADING pages
        arrived verified. Buffers past that count hold unspecified bytes."""
        keys = self._checked_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"buffers: expected {len(keys)} (one per key), got {len(buffers)}")
        views = [byte_view(b, self.page_nbytes, writable=True) for b in buffers]
        self._count(num_get_pages=len(keys))
        num_hit = self._run(self._get_into, keys, views) if keys else 0
        assert 0 <= num_hit <= len(keys), f"backend returned {num_hit} hits for {len(keys)} keys"
        self._count(num_hit_pages=num_hit, read_nbytes=num_hit * self.page_nbytes)
        return num_hit

    def get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of the leading present keys, as new bytes objects (allocates)."""
        buffers = [bytearray(self.page_nbytes) for _ in keys]
        num_hit = self.get_into(keys, buffers)
        return [bytes(b) for b in buffers[:num_hit]]

    def set(self, keys: Sequence[str], values: Sequence[Any]) -> int:
        """Store one page per key; return how many LEADING keys are stored after the call
        (already-present keys count and are not rewritten: equal key, equal KV)."""
        keys = self._checked_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"values: expected {len(keys)} (one per key), got {len(values)}")
        views = [byte_view(v, self.page_nbytes, writable=False) for v in values]
        self._count(num_set_pages=len(keys))
        num_stored = self._run(self._set, keys, views) if keys else 0
        assert 0 <= num_stored <= len(keys), f"backend stored {num_stored} of {len(keys)} keys"
        self._count(num_stored_pages=num_stored)
        return num_stored

    def delete(self, keys: Sequence[str]) -> int:
        """Remove the given keys; return how many were present and removed."""
        keys = self._checked_keys(keys)
        num_deleted = self._run(self._delete, keys) if keys else 0
        self._count(num_deleted_pages=num_deleted)
        return num_deleted

    def clear(self) -> int:
        """Remove every page this backend holds; return how many were removed."""
        num_deleted = self._run(self._clear)
        self._count(num_deleted_pages=num_deleted)
        return num_deleted

    def epoch(self) -> int:
        """The tier's epoch, read from the tier (0 when never bumped): part of every page
        key (``keys.root_key(..., epoch=...)``)."""
        epoch = self._run(self._read_epoch)
        assert isinstance(epoch, int) and epoch >= 0, f"backend returned epoch {epoch!r}"
        return epoch

    def bump_epoch(self) -> int:
        """Advance the tier's epoch by one and return the new one.

        Keys salted with the new epoch miss every page stored before, in this process
        and in every process that reads the epoch afterwards (a process keeps the
        epoch it read until it asks again: one still on old weights keeps its pages).
        The old pages stay until the tier evicts them or :meth:`clear` removes them.
        """
        epoch = self._run(self._bump_epoch)
        assert isinstance(epoch, int) and epoch >= 1, f"backend returned epoch {epoch!r}"
        return epoch

    def advance_epoch(self, epoch: int) -> int:
        """Raise the tier's epoch to at least ``epoch`` and return the tier's epoch after.

        Unlike :meth:`bump_epoch`, several processes that each advance to the same
        ``epoch`` (their own epoch + 1 after the same weight update) end on one epoch
        and share pages again; a record already past ``epoch`` is left as it is.
        """
        epoch = check_int("epoch", epoch, 0, 1 << 62)
        new = self._run(self._advance_epoch, epoch)
        assert isinstance(new, int) and new >= epoch, f"backend returned epoch {new!r}"
        return new

    def usage(self) -> StorageUsage | None:
        """Pages and bytes the tier holds now (all processes' writes); None when the
        backend cannot tell without reading every value."""
        return self._run(self._usage)

    def register_memory(self, buffer: Any) -> None:
        """Announce a long-lived region (the host pool) that get/set buffers live in.

        Backends with registered-memory transports use it to skip a bounce copy;
        the default does nothing. The region must outlive this backend.
        """
        byte_view(buffer, None, writable=False)  # same contract for every backend

    def counters(self) -> StorageCounters:
        with self._counter_lock:
            return StorageCounters(**self._counts)

    def thread_unauthentic_values(self) -> int:
        """The ``num_unauthentic_values`` found by this thread's calls: a reader's own
        count, apart from those another thread's writes find (and replace) meanwhile."""
        return getattr(self._local, "unauthentic", 0)

    def close(self) -> None:
        """Release the backend; idempotent. Later ops raise :class:`StorageError`."""
        if self._closed:
            return
        self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def authenticated(self) -> bool:
        """True when a storage secret is set: only values tagged under it are served."""
        return self._auth is not None

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- for subclasses ---------------------------------------------------------

    @abstractmethod
    def _exists(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _get_into(self, keys: list[str], views: list[memoryview]) -> int:
        """Fill views for the leading hits; remove and count corrupt values."""

    @abstractmethod
    def _set(self, keys: list[str], views: list[memoryview]) -> int: ...

    @abstractmethod
    def _delete(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _clear(self) -> int: ...

    @abstractmethod
    def _close(self) -> None: ...

    # The epoch record and usage. Backends whose tier outlives the process (files,
    # a shared store) override these; the defaults keep the epoch in this object,
    # so it is shared by nothing but this backend instance.
    def _read_epoch(self) -> int:
        return getattr(self, "_local_epoch", 0)

    def _bump_epoch(self) -> int:
        self._local_epoch = self._read_epoch() + 1
        return self._local_epoch

    def _advance_epoch(self, epoch: int) -> int:
        self._local_epoch = max(self._read_epoch(), epoch)
        return self._local_epoch

    def _usage(self) -> StorageUsage | None:
        return None

    def _header(self, key: str, payload: memoryview) -> bytes:
        """The header to store in front of ``payload`` (tagged with a secret)."""
        return encode_header(key, payload, self._auth)

    def _verify(self, key: str, header: bytes | bytearray | memoryview, payload: memoryview) -> str:
        """Verify a value read back; count it when it is not intact."""
        verdict = verify_value(key, header, payload, self._auth)
        if verdict == CORRUPT:
            self._count(num_corrupt_values=1)
        elif verdict == UNAUTHENTIC:
            self._count(num_unauthentic_values=1)
        return verdict

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta
        if deltas.get("num_unauthentic_values"):
            self._local.unauthentic = (self.thread_unauthentic_values()
                                       + deltas["num_unauthentic_values"])

    # ---- internals --------------------------------------------------------------

    def _checked_keys(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, str):
            raise TypeError("keys: expected a sequence of keys, got a single str")
        return [check_key(k) for k in keys]

    def _run(self, op: Callable[..., _T], *args: Any) -> _T:
        """Run a primitive; whatever it raises reaches the caller as a counted StorageError.

        Arguments were validated before, so an exception here is the backend's
        failure (an ``OSError`` a primitive did not expect, a client library's own
        error), never the caller's mistake: the cache catches one type and carries on.
        """
        if self._closed:
            raise StorageError(f"{type(self).__name__} is closed")
        try:
            return op(*args)
        except StorageError:
            self._count(num_errors=1)
            raise
        except Exception as e:
            self._count(num_errors=1)
            raise StorageError(f"{type(self).__name__}: {type(e).__name__}: {e}") from e
