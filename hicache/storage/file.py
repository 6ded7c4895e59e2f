"""The embedded storage backend: one file per page in a local directory.

Layout: ``ROOT/<key[:2]>/<key>``, each file a header plus the page payload (see
``base.py``); the exact names it creates are in ``filelayout.py``. It touches only
entries of those names, and never through a symlink: the root is resolved once
and held open, and every other path is opened one component at a time relative
to it with ``O_NOFOLLOW`` (a symlink ``ROOT/<xx>`` is not one of its directories;
a page under it is neither read nor written). A root that holds entries it did not
create, and no marker, is refused unless ``adopt=True``.

On disk it is private by default: directories it creates are ``0700``, files
``0600``, and an existing root (or hex subdirectory) that other users can write,
or that another user owns, is refused at start-up; ``shared=True`` allows it (and
leaves modes to the umask) for a deliberately shared cache, which should then set
a storage secret (a warning says so when none is set).

The tier's epoch is ``ROOT/EPOCH``, read and advanced by ``fileepoch.py``; ``clear``
removes pages only, never the epoch.

Safety across threads and processes that share a directory:

- writes go to a temp file in the same directory, named per process, thread and
  call, then ``os.replace`` it over the final name: readers see the old file, the
  new file, or none, never a torn one; two writers of one key both win whole;
- reads use ``readv`` straight into the caller's buffer, verify, and remove a
  value that fails (only if the name still points at the file that was read);
- only regular files are values: anything else in a page's place (a FIFO, a
  directory, a symlink) is a miss, and values are opened with ``O_NONBLOCK`` so a
  FIFO cannot block a reader;
- recency lives in the file's mtime: a hit stamps it, so every process sees one
  LRU order. Stamps and removals are best effort, so a read-only store still
  serves every intact page. With ``capacity_nbytes`` set, a write that takes this
  process's view of the total past the cap removes values oldest-first down to
  ``low_watermark * cap`` (``filelru.py`` says how, and by how much several
  writers can overshoot the cap);
- temp files whose writer is gone are removed by the scans at open, clean-up and
  ``clear()`` (``filelayout.temp_is_stale``); until then they count toward the cap.

This module knows nothing about keys' meaning, KV layout or the cache.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
from pathlib import Path

from hicache.checks import check_bool, check_int
from hicache.storage import filelayout as layout
from hicache.storage.base import (
    INTACT,
    VALUE_HEADER_NBYTES,
    StorageBackend,
    StorageError,
    StorageUsage,
    verify_value,
)
from hicache.storage.fileepoch import advance_epoch, bump_epoch, read_epoch
from hicache.storage.filelru import Stamps, evict_oldest

_log = logging.getLogger(__name__)


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
        shared: bool = False,
        adopt: bool = False,
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(page_nbytes, secret=secret)
        if capacity_nbytes is not None:
            capacity_nbytes = check_int("capacity_nbytes", capacity_nbytes, minimum=1)
        if not 0.0 < low_watermark <= 1.0:
            raise ValueError(f"low_watermark: expected in (0, 1], got {low_watermark}")
        self.shared = check_bool("shared", shared)
        check_bool("adopt", adopt)
        self.capacity_nbytes = capacity_nbytes
        self.fsync = fsync
        self.low_watermark = low_watermark
        self.value_nbytes = VALUE_HEADER_NBYTES + page_nbytes
        # Private unless shared: a shared cache's modes follow the umask (e.g. 002).
        self._dir_mode, self._file_mode = (0o777, 0o666) if shared else (0o700, 0o600)
        try:
            Path(root).mkdir(mode=self._dir_mode, parents=True, exist_ok=True)
            self.root = Path(os.path.realpath(root))
            self._root_fd = os.open(self.root, layout.DIR_FLAGS)
        except OSError as e:
            raise StorageError(f"file storage: cannot open {root}: {e}") from e
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._stamps = Stamps()
        self._temp_ids = itertools.count()
        try:
            try:
                layout.check_root(self._root_fd, str(self.root), shared=shared, adopt=adopt,
                                  file_mode=self._file_mode)
            except OSError as e:
                raise StorageError(f"file storage: cannot read {self.root}: {e}") from e
            values, temp_nbytes, unsafe = self._scan(sweep=True)
            if unsafe is not None and not shared:
                raise ValueError(layout.unsafe_message(f"{self.root}/{unsafe[0]}", unsafe[1]))
        except BaseException:
            self._closed = True  # so that __del__ does not close the fd number again
            os.close(self._root_fd)
            raise
        self._tracked_nbytes = sum(nbytes for _, nbytes, _, _ in values) + temp_nbytes
        if shared and self._auth is None:
            _log.warning(
                "file storage %s is shared (shared=True) without a storage secret: any "
                "process that can write there can plant KV this cache will serve; set "
                "HICACHE_STORAGE_SECRET (or storage_secret) in every cache that shares it",
                self.root,
            )

    def __del__(self) -> None:
        # A backend dropped without close() must not leak its root fd.
        fd = getattr(self, "_root_fd", None)
        if fd is not None and not self._closed:
            self._closed = True
            os.close(fd)

    def __repr__(self) -> str:
        return f"FileStorage({str(self.root)!r}, capacity_nbytes={self.capacity_nbytes})"

    @property
    def tracked_nbytes(self) -> int:
        """Bytes on disk (values and temp files) as this process last saw them."""
        return self._tracked_nbytes

    # ---- primitives -------------------------------------------------------------

    def _exists(self, keys: list[str]) -> int:
        dirs = self._subdirs(create=False)
        try:
            for i, key in enumerate(keys):
                sub = dirs.fd(key)
                if sub is None:
                    return i
                try:
                    st = os.stat(key, dir_fd=sub, follow_symlinks=False)
                except FileNotFoundError:
                    return i
                except OSError as e:
                    raise StorageError(f"file storage: stat {key}: {e}") from e
                if not stat.S_ISREG(st.st_mode):
                    return i  # a FIFO, directory, symlink ... in a page's place holds no page
            return len(keys)
        finally:
            dirs.close()

    def _get_into(self, keys: list[str], views: list[memoryview]) -> int:
        header = bytearray(VALUE_HEADER_NBYTES)
        dirs = self._subdirs(create=False)
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                sub = dirs.fd(key)
                if sub is None or not self._read_one(sub, key, header, view):
                    return i
            return len(keys)
        finally:
            dirs.close()

    def _read_one(self, sub: int, key: str, header: bytearray, view: memoryview) -> bool:
        """Read and verify one value into ``view``; False (after clean-up) when it is no hit."""
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
            # forever. O_NOFOLLOW: a symlink in a page's place is not followed.
            fd = os.open(key, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=sub)
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise StorageError(f"file storage: open {key}: {e}") from e
            self._count(num_corrupt_values=1)  # a symlink holds no page: remove the link
            self._drop(sub, key, None)
            return False
        try:
            st = os.fstat(fd)
            if (
                stat.S_ISREG(st.st_mode)
                and st.st_size == self.value_nbytes
                and os.readv(fd, [header, view]) == self.value_nbytes
            ):
                verdict = self._verify(key, header, view)  # counts what fails
            else:
                verdict = "not a value"
                self._count(num_corrupt_values=1)
            if verdict == INTACT:
                self._stamps.stamp_fd(fd)
        except OSError as e:
            raise StorageError(f"file storage: read {key}: {e}") from e
        finally:
            os.close(fd)
        if verdict != INTACT:
            self._drop(sub, key, st)
            return False
        return True

    def _authentic(self, sub: int, key: str, scratch: bytearray) -> bool:
        """True when the value stored under ``key`` is intact and tagged under our secret."""
        try:
            fd = os.open(key, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=sub)
        except OSError:
            return False
        try:
            view = memoryview(scratch)
            return (
                os.fstat(fd).st_size == self.value_nbytes
                and os.readv(fd, [view]) == self.value_nbytes
                and verify_value(key, view[:VALUE_HEADER_NBYTES], view[VALUE_HEADER_NBYTES:],
                                 self._auth) == INTACT
            )
        except OSError:
            return False
        finally:
            os.close(fd)

    def _set(self, keys: list[str], views: list[memoryview]) -> int:
        num_written = 0
        num_stored = len(keys)
        dirs = self._subdirs(create=True)
        scratch = bytearray(self.value_nbytes) if self._auth is not None else bytearray()
        try:
            for i, (key, view) in enumerate(zip(keys, views, strict=True)):
                sub = dirs.fd(key)
                if sub is None:
                    # ROOT/<xx> is a symlink or a file: not ours to follow or replace.
                    self._count(num_errors=1)
                    num_stored = i
                    break
                try:
                    st = os.stat(key, dir_fd=sub, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                except OSError as e:
                    raise StorageError(f"file storage: stat {key}: {e}") from e
                if st is not None and stat.S_ISREG(st.st_mode):
                    if self._auth is None or self._authentic(sub, key, scratch):
                        self._stamps.stamp_name(sub, key)  # a re-offered page is a recent page
                        continue
                    # With a secret, a value we cannot verify (planted, or another
                    # secret's) must not stand in for ours: it is replaced below.
                    self._count(num_unauthentic_values=1)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    # Not ours to remove, and os.replace cannot go over it: the pages
                    # from here on cannot be stored (a FIFO, socket or symlink is replaced).
                    num_stored = i
                    break
                self._write(sub, key, view)
                num_written += 1
        finally:
            dirs.close()
        if num_written:
            self._count(written_nbytes=num_written * self.page_nbytes)
            with self._lock:
                self._tracked_nbytes += num_written * self.value_nbytes
            if self.capacity_nbytes is not None and self._tracked_nbytes > self.capacity_nbytes:
                self._evict()
        return num_stored

    def _delete(self, keys: list[str]) -> int:
        num_deleted = 0
        dirs = self._subdirs(create=False)
        try:
            for key in keys:
                sub = dirs.fd(key)
                if sub is None:
                    continue
                try:
                    os.unlink(key, dir_fd=sub)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise StorageError(f"file storage: unlink {key}: {e}") from e
                num_deleted += 1
        finally:
            dirs.close()
        with self._lock:
            self._tracked_nbytes = max(0, self._tracked_nbytes - num_deleted * self.value_nbytes)
        return num_deleted

    def _clear(self) -> int:
        values, temp_nbytes, _ = self._scan(sweep=True)
        num_deleted = 0
        dirs = self._subdirs(create=False)
        try:
            for _, _, subdir, name in values:
                sub = dirs.fd(subdir)
                if sub is None:
                    continue
                try:
                    os.unlink(name, dir_fd=sub)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise StorageError(f"file storage: unlink {subdir}/{name}: {e}") from e
                num_deleted += 1
        finally:
            dirs.close()
        with self._lock:
            self._tracked_nbytes = temp_nbytes
        return num_deleted

    def _close(self) -> None:
        os.close(self._root_fd)

    def _read_epoch(self) -> int:
        return read_epoch(self._root_fd, str(self.root))

    def _bump_epoch(self) -> int:
        return bump_epoch(self._root_fd, str(self.root), self._file_mode)

    def _advance_epoch(self, epoch: int) -> int:
        return advance_epoch(self._root_fd, str(self.root), self._file_mode, epoch)

    def _usage(self) -> StorageUsage:
        values = self._scan(sweep=False).values
        return StorageUsage(len(values), sum(nbytes for _, nbytes, _, _ in values))

    # ---- internals --------------------------------------------------------------

    def _write(self, sub: int, key: str, view: memoryview) -> None:
        temp = layout.temp_name(key, next(self._temp_ids))
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, self._file_mode, dir_fd=sub)
            try:
                parts = [memoryview(self._header(key, view)), view]
                while parts:
                    written = os.writev(fd, parts)
                    parts = _advance(parts, written)
                if self.fsync:
                    os.fsync(fd)
                stamp = self._stamps.next()
                os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            os.replace(temp, key, src_dir_fd=sub, dst_dir_fd=sub)
        except OSError as e:
            try:
                os.unlink(temp, dir_fd=sub)
            except OSError:
                pass
            raise StorageError(f"file storage: write {self.root}/{key[:2]}/{key}: {e}") from e

    def _drop(self, sub: int, key: str, read_stat: os.stat_result | None) -> None:
        """Remove a value that failed verification (counted by the caller), if still there.

        Best effort: a store that cannot be written (read-only mount) still serves
        its intact pages, so a failed removal is counted, not raised. A directory in
        a page's place is left alone (removing a tree is not a cache's business).
        """
        if read_stat is not None and stat.S_ISDIR(read_stat.st_mode):
            return
        try:
            st = os.stat(key, dir_fd=sub, follow_symlinks=False)
            # Another process may have replaced the bad file with a good one meanwhile.
            if read_stat is None and not stat.S_ISLNK(st.st_mode):
                return
            if read_stat is not None and st.st_ino != read_stat.st_ino:
                return
            os.unlink(key, dir_fd=sub)
        except FileNotFoundError:
            return
        except OSError:
            self._count(num_errors=1)
            return
        if read_stat is not None and stat.S_ISREG(read_stat.st_mode):
            with self._lock:
                self._tracked_nbytes = max(0, self._tracked_nbytes - read_stat.st_size)

    def _subdirs(self, *, create: bool) -> layout.Subdirs:
        return layout.Subdirs(self._root_fd, create=create, dir_mode=self._dir_mode)

    def _scan(self, *, sweep: bool) -> layout.Scan:
        try:
            return layout.scan(self._root_fd, sweep=sweep)
        except OSError as e:
            raise StorageError(f"file storage: scan {self.root}: {e}") from e

    def _evict(self) -> None:
        assert self.capacity_nbytes is not None, "eviction needs a capacity"
        with self._evict_lock:
            target = int(self.capacity_nbytes * self.low_watermark)
            done = evict_oldest(self._root_fd, self._scan(sweep=True), target, self._dir_mode)
            with self._lock:
                self._tracked_nbytes = done.total_nbytes
        if done.num_errors:
            self._count(num_errors=done.num_errors)
        self._count(num_evicted_pages=done.num_evicted)


def _advance(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The parts still to write after a short ``writev`` of ``nbytes``."""
    while parts and nbytes >= len(parts[0]):
        nbytes -= len(parts[0])
        parts = parts[1:]
    if parts and nbytes:
        parts = [parts[0][nbytes:], *parts[1:]]
    return parts

