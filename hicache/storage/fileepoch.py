"""The file tier's epoch: ``ROOT/EPOCH``, read and advanced safely across processes.

The epoch is part of every page key (:func:`hicache.storage.keys.root_key`): bumping
it makes every stored page a miss for processes that read the new one. It lives in
``ROOT/EPOCH`` as a decimal number (absent: 0). :func:`bump_epoch` advances it under
an ``flock`` of ``ROOT/.epoch.lock``, so concurrent bumps from several processes each
get their own epoch, and writes it to a temp file that is fsync'ed and renamed over
the record (an epoch that went back would serve stale pages); :func:`advance_epoch`
raises it to a given epoch the same way (processes advancing to one epoch agree). Clearing the tier
never removes the epoch: a process still salting with an old epoch must not meet a
reused one.

Both functions work relative to the held root directory fd, never through a
symlink (names: :mod:`hicache.storage.filelayout`), and raise
:class:`~hicache.storage.base.StorageError` naming the file on failure. This
module knows nothing of values or the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable

from hicache.storage import filelayout as layout
from hicache.storage.base import StorageError


def read_epoch(root_fd: int, root: str) -> int:
    """The epoch recorded under the root (0 when never bumped); ``root`` names it in errors."""
    name = f"{root}/{layout.EPOCH_NAME}"
    try:
        fd = os.open(layout.EPOCH_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=root_fd)
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise StorageError(f"file storage: read {name}: {e}") from e
    try:
        text = os.read(fd, 64).decode("ascii", "replace")
    except OSError as e:
        raise StorageError(f"file storage: read {name}: {e}") from e
    finally:
        os.close(fd)
    if not text.strip().isdigit():
        raise StorageError(f"file storage: {name} holds {text[:40]!r}, expected a decimal "
                           "epoch")
    return int(text)


def bump_epoch(root_fd: int, root: str, file_mode: int) -> int:
    """Advance the epoch by one, one process at a time; return the new epoch.

    Files it creates get ``file_mode`` (before the umask).
    """
    return _update_epoch(root_fd, root, file_mode, lambda epoch: epoch + 1)


def advance_epoch(root_fd: int, root: str, file_mode: int, epoch: int) -> int:
    """Raise the epoch to at least ``epoch`` (max-merge), one process at a time; return
    the epoch recorded after."""
    return _update_epoch(root_fd, root, file_mode, lambda recorded: max(recorded, epoch))


def _update_epoch(root_fd: int, root: str, file_mode: int,
                  update: Callable[[int], int]) -> int:
    """Read the epoch, write ``update(epoch)`` (unless unchanged) under the lock; return it."""
    try:
        lock_fd = os.open(layout.EPOCH_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                          | os.O_CLOEXEC, file_mode, dir_fd=root_fd)
    except OSError as e:
        raise StorageError(f"file storage: bump the epoch in {root}: {e}") from e
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # read-advance-write, one process at a time
        recorded = read_epoch(root_fd, root)
        epoch = update(recorded)
        if epoch == recorded:
            return epoch
        temp = layout.epoch_temp_name()
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, file_mode, dir_fd=root_fd)
            try:
                os.write(fd, f"{epoch}\n".encode())
                os.fsync(fd)  # an epoch that went back would serve stale pages
            finally:
                os.close(fd)
            os.replace(temp, layout.EPOCH_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=root_fd)
            raise StorageError(f"file storage: write {root}/{layout.EPOCH_NAME}: {e}") from e
        return epoch
    finally:
        os.close(lock_fd)  # releases the flock
