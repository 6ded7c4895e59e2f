"""Recency and the size cap of the file tier: mtime stamps, and oldest-first clean-up.

Recency lives in each value file's mtime, so every process sharing a directory
sees one LRU order. :class:`Stamps` hands out this process's stamps: wall-clock
nanoseconds (so processes agree), strictly increasing within the process (so the
order is exact even when two accesses fall in one clock tick). Stamping is best
effort: recency is a hint for clean-up, and a read-only store (mount,
permissions) must still serve reads.

With a capacity set, a write that takes the process's view of the total past the
cap calls :func:`evict_oldest` on a fresh scan (the truth, including other
processes' files and temp files of writes in progress), which removes values
oldest first down to a target. Between scans a process does not see other
writers, so several writers can overshoot the cap by what the others wrote since
this one last scanned.

This module knows file names only through :mod:`hicache.storage.filelayout`;
nothing of values' content, keys' meaning or the cache.
"""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple

from hicache.storage import filelayout as layout


class Stamps:
    """This process's recency stamps, and stamping a value as recently used."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ns = 0

    def next(self) -> int:
        """A stamp later than every one this object gave before (ns since the epoch)."""
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def stamp_fd(self, fd: int) -> None:
        """Mark the open value recently used (best effort)."""
        stamp = self.next()
        try:
            os.utime(fd, ns=(stamp, stamp))
        except OSError:
            pass

    def stamp_name(self, sub: int, name: str) -> None:
        """Mark the value ``name`` in the directory ``sub`` recently used (best effort)."""
        stamp = self.next()
        try:
            os.utime(name, ns=(stamp, stamp), dir_fd=sub, follow_symlinks=False)
        except OSError:
            pass  # evicted by someone else since, or the store is read-only


class Evicted(NamedTuple):
    """What :func:`evict_oldest` did."""

    total_nbytes: int  # bytes on disk after (values and temp files)
    num_evicted: int  # values removed
    num_errors: int  # values it could not remove (they still take room)


def evict_oldest(root_fd: int, found: layout.Scan, target_nbytes: int, dir_mode: int) -> Evicted:
    """Remove values of ``found`` oldest first until the bytes on disk are at most
    ``target_nbytes`` (temp files count, and stay). Raises ``OSError`` only when a
    subdirectory cannot be opened for a reason other than "gone" or "not ours"."""
    values = sorted(found.values)
    total = sum(nbytes for _, nbytes, _, _ in values) + found.temp_nbytes
    num_evicted = num_errors = 0
    dirs = layout.Subdirs(root_fd, create=False, dir_mode=dir_mode)
    try:
        for _, nbytes, subdir, name in values:
            if total <= target_nbytes:
                break
            sub = dirs.fd(subdir)
            if sub is None:
                continue
            try:
                os.unlink(name, dir_fd=sub)
                num_evicted += 1
            except FileNotFoundError:
                pass
            except OSError:  # cannot remove it (permissions): it still takes room
                num_errors += 1
                continue
            total -= nbytes
    finally:
        dirs.close()
    return Evicted(total, num_evicted, num_errors)
