"""The embedded storage backend: one file per page in a local directory.

Layout: ``ROOT/<key[:2]>/<key>``, each file a 32-byte header plus the page
payload (see ``base.py``). File names come from validated hex keys only, so no
key can escape the directory. The tier's epoch is ``ROOT/EPOCH`` (a decimal
number; absent: 0), advanced under an ``flock`` of ``ROOT/.epoch.lock`` so that
concurrent bumps from several processes each get their own epoch; ``clear``
removes pages only, never the epoch (a process still salting with an old epoch
must not meet a reused one).

Safety across threads and processes that share a directory:

- writes go to a temp file in the same directory, named per process, thread and
  call, then ``os.replace`` it over the final name: readers see the old file, the
  new file, or none, never a torn one; two writers of one key both win whole;
- reads use ``readv`` straight into the caller's buffer, verify, and remove a
  value that fails (only if the name still points at the file that was read);
- only regular files are values: anything else in a page's place (a FIFO, a
  directory) is a miss, and values are opened with ``O_NONBLOCK`` so a FIFO
  cannot block a reader;
- recency lives in the file's mtime: a hit stamps it, so every process sees one
  LRU order. Stamps and removals are best effort, so a read-only store still
  serves every intact page. With ``capacity_nbytes`` set, a write that takes this process's view
  of the total past the cap scans the directory (the truth, including other
  processes' files) and removes oldest-first down to ``low_watermark * cap``.
  Between scans a process does not see other writers, so several writers can
  overshoot the cap by what the others wrote since this one last scanned.

This module knows nothing about keys' meaning, KV layout or the cache.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import stat
import threading
import time
from pathlib import Path

from hicache.checks import check_int
from hicache.storage.base import (
    VALUE_HEADER_NBYTES,
    StorageBackend,
    StorageError,
    StorageUsage,
    check_value,
    encode_header,
)

_STALE_TEMP_AGE_S = 600.0  # temp files this old belong to a writer that died mid-write
EPOCH_FILE = "EPOCH"  # the tier's epoch, in ROOT (values live in two-hex-digit folders)


class FileStorage(StorageBackend):
    """Pages as files under ``root``; optional size cap with LRU clean-up."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        page_nbytes: int,
        capacity_nbytes: int | None = None,
        fsync: bool = False,
        low_watermark: float = 0.9,
    ) -> None:
        super().__init__(page_nbytes)
        if capacity_nbytes is not None:
            capacity_nbytes = check_int("capacity_nbytes", capacity_nbytes, minimum=1)
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"low_watermark: expected in (0, 1], got {low_watermark}")
        self.root = Path(root)
        self.capacity_nbytes = capacity_nbytes
        self.fsync = fsync
        self.low_watermark = low_watermark
        self.value_nbytes = VALUE_HEADER_NBYTES + page_nbytes
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"file storage: cannot create {self.root}: {e}") from e
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._last_stamp_ns = 0
        self._temp_ids = itertools.count()
        self._tracked_nbytes = sum(nbytes for _, nbytes, _ in self._scan(remove_stale=True))

    def __repr__(self) -> str:
        return f"FileStorage({str(self.root)!r}, capacity_nbytes={self.capacity_nbytes})"

    @property
    def tracked_nbytes(self) -> int:
        """Bytes on disk as this process last saw them (exact after a clean-up)."""
        return self._tracked_nbytes

    # ---- primitives -------------------------------------------------------------

    def _exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            try:
                st = os.stat(self._path(key))
            except (FileNotFoundError, NotADirectoryError):
                return i
            except OSError as e:
                raise StorageError(f"file storage: stat {key}: {e}") from e
            if not stat.S_ISREG(st.st_mode):
                return i  # a FIFO, directory ... in a page's place holds no page
        return len(keys)

    def _get_into(self, keys: list[str], views: list[memoryview]) -> int:
        header = bytearray(VALUE_HEADER_NBYTES)
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            path = self._path(key)
            try:
                # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
                # writer forever. It changes nothing for a regular file.
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except (FileNotFoundError, NotADirectoryError):
                return i
            except OSError as e:
                raise StorageError(f"file storage: open {path}: {e}") from e
            try:
                st = os.fstat(fd)
                intact = (
                    stat.S_ISREG(st.st_mode)
                    and st.st_size == self.value_nbytes
                    and os.readv(fd, [header, view]) == self.value_nbytes
                    and check_value(key, header, view)
                )
            except OSError as e:
                raise StorageError(f"file storage: read {path}: {e}") from e
            finally:
                os.close(fd)
            if not intact:
                self._drop_corrupt(path, st)
                return i
            self._stamp(path)
        return len(keys)

    def _set(self, keys: list[str], views: list[memoryview]) -> int:
        num_written = 0
        num_stored = len(keys)
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            path = self._path(key)
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            except OSError as e:
                raise StorageError(f"file storage: stat {path}: {e}") from e
            if st is not None and stat.S_ISREG(st.st_mode):
                self._stamp(path)  # a re-offered page is a recent page
                continue
            if st is not None and stat.S_ISDIR(st.st_mode):
                # Not ours to remove, and os.replace cannot go over it: the pages
                # from here on cannot be stored (a FIFO or socket is replaced below).
                num_stored = i
                break
            self._write(path, key, view)
            num_written += 1
        if num_written:
            self._count(written_nbytes=num_written * self.page_nbytes)
            with self._lock:
                self._tracked_nbytes += num_written * self.value_nbytes
            if self.capacity_nbytes is not None and self._tracked_nbytes > self.capacity_nbytes:
                self._evict()
        return num_stored

    def _delete(self, keys: list[str]) -> int:
        num_deleted = 0
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StorageError(f"file storage: unlink {key}: {e}") from e
            num_deleted += 1
        with self._lock:
            self._tracked_nbytes = max(0, self._tracked_nbytes - num_deleted * self.value_nbytes)
        return num_deleted

    def _clear(self) -> int:
        num_deleted = 0
        for _, _, path in self._scan():
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StorageError(f"file storage: unlink {path}: {e}") from e
            num_deleted += 1
        with self._lock:
            self._tracked_nbytes = 0
        return num_deleted

    def _close(self) -> None:
        """Nothing is held open between calls."""

    def _read_epoch(self) -> int:
        path = self.root / EPOCH_FILE
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as e:
            raise StorageError(f"file storage: read {path}: {e}") from e
        if not text.strip().isdigit():
            raise StorageError(
                f"file storage: {path} holds {text[:40]!r}, expected a decimal epoch"
            )
        return int(text)

    def _bump_epoch(self) -> int:
        path = self.root / EPOCH_FILE
        try:
            lock_fd = os.open(self.root / ".epoch.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(f"file storage: bump the epoch in {self.root}: {e}") from e
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # read-advance-write, one process at a time
            epoch = self._read_epoch() + 1
            temp = path.with_name(f".{EPOCH_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                with open(temp, "w", encoding="ascii") as f:
                    f.write(f"{epoch}\n")
                    f.flush()
                    os.fsync(f.fileno())  # an epoch that went back would serve stale pages
                os.replace(temp, path)
            except OSError as e:
                _unlink_quietly_any(temp)
                raise StorageError(f"file storage: write {path}: {e}") from e
            return epoch
        finally:
            os.close(lock_fd)  # releases the flock

    def _usage(self) -> StorageUsage:
        entries = self._scan()
        return StorageUsage(len(entries), sum(nbytes for _, nbytes, _ in entries))

    # ---- internals --------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def _write(self, path: Path, key: str, view: memoryview) -> None:
        temp = path.with_name(
            f".{key}.{os.getpid()}.{threading.get_ident()}.{next(self._temp_ids)}.tmp"
        )
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                parts = [memoryview(encode_header(key, view)), view]
                while parts:
                    written = os.writev(fd, parts)
                    parts = _advance(parts, written)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            stamp = self._next_stamp()
            os.utime(temp, ns=(stamp, stamp))
            os.replace(temp, path)
        except OSError as e:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise StorageError(f"file storage: write {path}: {e}") from e

    def _drop_corrupt(self, path: Path, read_stat: os.stat_result) -> None:
        """Count a value that failed verification and remove it when it is a file.

        Best effort: a store that cannot be written (read-only mount) still serves
        its intact pages, so a failed removal is counted, not raised. A directory in
        a page's place is left alone (removing a tree is not a cache's business).
        """
        self._count(num_corrupt_values=1)
        if stat.S_ISDIR(read_stat.st_mode):
            return
        try:
            # Another process may have replaced the bad file with a good one meanwhile.
            if os.stat(path).st_ino == read_stat.st_ino:
                os.unlink(path)
        except FileNotFoundError:
            return
        except OSError:
            self._count(num_errors=1)
            return
        if stat.S_ISREG(read_stat.st_mode):
            with self._lock:
                self._tracked_nbytes = max(0, self._tracked_nbytes - read_stat.st_size)

    def _next_stamp(self) -> int:
        # Strictly increasing within the process, so LRU order is exact even when
        # two accesses fall in one clock tick; wall-clock based so processes agree.
        with self._lock:
            self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    def _stamp(self, path: Path) -> None:
        """Mark ``path`` recently used. Best effort: recency is a hint for clean-up, and
        a read-only store (mount, permissions) must still serve reads."""
        stamp = self._next_stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # evicted by someone else since, or the store is read-only

    def _scan(self, *, remove_stale: bool = False) -> list[tuple[int, int, str]]:
        """(mtime_ns, nbytes, path) of every value file; optionally drop dead temp files."""
        entries = []
        now = time.time()
        try:
            subdirs = [d for d in os.scandir(self.root) if d.is_dir() and len(d.name) == 2]
            for sub in subdirs:
                for entry in os.scandir(sub.path):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue  # not a value (nor ours to remove)
                    if entry.name.startswith("."):
                        if remove_stale and now - st.st_mtime > _STALE_TEMP_AGE_S:
                            try:
                                _unlink_quietly(entry.path)
                            except OSError:
                                pass  # read-only store: stale temp files stay harmless
                        continue
                    entries.append((st.st_mtime_ns, st.st_size, entry.path))
        except OSError as e:
            raise StorageError(f"file storage: scan {self.root}: {e}") from e
        return entries

    def _evict(self) -> None:
        assert self.capacity_nbytes is not None, "eviction needs a capacity"
        with self._evict_lock:
            entries = sorted(self._scan())
            total = sum(nbytes for _, nbytes, _ in entries)
            target = int(self.capacity_nbytes * self.low_watermark)
            num_evicted = 0
            for _, nbytes, path in entries:
                if total <= target:
                    break
                try:
                    if _unlink_quietly(path):
                        num_evicted += 1
                except OSError:  # cannot remove it (permissions): it still takes room
                    self._count(num_errors=1)
                    continue
                total -= nbytes
            with self._lock:
                self._tracked_nbytes = total
        self._count(num_evicted_pages=num_evicted)


def _advance(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The parts still to write after a short ``writev`` of ``nbytes``."""
    while parts and nbytes >= len(parts[0]):
        nbytes -= len(parts[0])
        parts = parts[1:]
    if parts and nbytes:
        parts = [parts[0][nbytes:], *parts[1:]]
    return parts


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _unlink_quietly_any(path: os.PathLike[str] | str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
