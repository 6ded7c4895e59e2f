"""What the file tier puts in its directory: exact names, and who owns a temp file.

Everything :class:`~hicache.storage.file.FileStorage` creates under its root::

    ROOT/.hicache-store                  marker: "this directory is a hicache store"
    ROOT/EPOCH, ROOT/.epoch.lock         the tier's epoch, and the lock that advances it
    ROOT/.EPOCH.<pid>.<tid>.tmp          an epoch being written
    ROOT/<xx>/                           xx = two lowercase hex digits, a key's first two
    ROOT/<xx>/<key>                      a value (key: 32..128 lowercase hex, starts with xx)
    ROOT/<xx>/.<key>.<owner>.<pid>.<tid>.<n>.tmp   a write in progress

It reads, renames and deletes only entries whose names match these patterns, and
never through a symlink. ``owner`` names the pid namespace of the writing process
(a hash of the boot id and the namespace's inode), so a process can tell whether
it can check the writer's ``pid``: a temp file whose writer is gone (same owner,
no such process) is stale at once; any other temp file is stale once older than
:data:`STALE_TEMP_AGE_S` (another machine on a shared mount, another container,
a reused pid). Temp files of earlier versions (``.<key>.<pid>.<tid>.<n>.tmp``)
follow the age rule.

It also walks the directory for the backend: subdirectories opened relative to
the held root fd with ``O_NOFOLLOW`` (:class:`Subdirs`), the scan of values and
temp files (:func:`scan`), and the start-up checks (:func:`check_root`).

This module knows names, processes and directories, not values or the cache.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import socket
import stat
import threading
import time
from typing import NamedTuple

MARKER_NAME = ".hicache-store"
MARKER_TEXT = b"hicache file store v1\n"
EPOCH_NAME = "EPOCH"  # the tier's epoch (decimal); absent: 0
EPOCH_LOCK_NAME = ".epoch.lock"  # flock'ed while the epoch is advanced
_EPOCH_TEMP = re.compile(r"\.EPOCH\.[0-9]{1,10}\.[0-9]{1,20}\.tmp")
STALE_TEMP_AGE_S = 600.0  # no write of one page takes this long
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_VALUE = re.compile(r"[0-9a-f]{32,128}")
_TEMP = re.compile(
    r"\.(?P<key>[0-9a-f]{32,128})\.(?:(?P<owner>[0-9a-f]{16})\.)?(?P<pid>[0-9]{1,10})"
    r"\.[0-9]{1,20}\.[0-9]{1,20}\.tmp"
)


def is_root_file_name(name: str) -> bool:
    """The marker, the epoch record and its lock, an epoch being written."""
    return name in (MARKER_NAME, EPOCH_NAME, EPOCH_LOCK_NAME) or (
        _EPOCH_TEMP.fullmatch(name) is not None)


def epoch_temp_name() -> str:
    return f".{EPOCH_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"


def is_subdir_name(name: str) -> bool:
    return _SUBDIR.fullmatch(name) is not None


def is_value_name(subdir: str, name: str) -> bool:
    return _VALUE.fullmatch(name) is not None and name[:2] == subdir


def parse_temp_name(subdir: str, name: str) -> tuple[str | None, int] | None:
    """(owner tag or None for an old-style name, writer pid) of a temp file name, else None."""
    m = _TEMP.fullmatch(name)
    if m is None or m["key"][:2] != subdir:
        return None
    return m["owner"], int(m["pid"])


@functools.lru_cache(maxsize=1)
def owner_tag() -> str:
    """16 hex digits naming the pid namespace this process lives in (same boot, same
    namespace: the same pids mean the same processes)."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(socket.gethostname().encode())
    try:
        parts.append(os.readlink("/proc/self/ns/pid").encode())
    except OSError:
        parts.append(b"no-pid-namespace")
    return hashlib.blake2b(b"\0".join(parts), digest_size=8).hexdigest()


def temp_name(key: str, serial: int) -> str:
    """A temp file name for a write of ``key`` by this process and thread."""
    return f".{key}.{owner_tag()}.{os.getpid()}.{threading.get_ident()}.{serial}.tmp"


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists in this pid namespace (a zombie counts)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    except (OverflowError, OSError):
        return False
    return True


def temp_is_stale(owner: str | None, pid: int, age_s: float) -> bool:
    """True when no live writer can own a temp file of this owner, pid and age."""
    if age_s > STALE_TEMP_AGE_S:
        return True
    if owner is None or owner != owner_tag():
        return False  # written elsewhere: its pid means nothing here, age decides
    return not pid_alive(pid)


def unsafe_reason(st: os.stat_result) -> str | None:
    """Why a directory with this ``lstat`` is unsafe to trust as a private store, or None.

    Other users who can write into it (group or other write bit) or its owner, if that
    is not us, can plant values under any key.
    """
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "group" if mode & stat.S_IWGRP else "others"
        if mode & stat.S_IWGRP and mode & stat.S_IWOTH:
            who = "group and others"
        return f"it is writable by {who} (mode {mode:04o})"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
    return None


def foreign_entries(root_fd: int, limit: int = 3) -> list[str]:
    """Up to ``limit`` entries under the root (and in its hex subdirectories) that the
    file tier did not create: symlinks, other names, other files."""
    found: list[str] = []
    with os.scandir(root_fd) as entries:
        for entry in entries:
            if len(found) >= limit:
                break
            if is_root_file_name(entry.name) and entry.is_file(follow_symlinks=False):
                continue
            if entry.is_symlink():
                found.append(f"{entry.name} (a symlink)")
                continue
            if not (is_subdir_name(entry.name) and entry.is_dir(follow_symlinks=False)):
                found.append(entry.name)
                continue
            found.extend(_foreign_in_subdir(root_fd, entry.name, limit - len(found)))
    return found[:limit]


def _foreign_in_subdir(root_fd: int, subdir: str, limit: int) -> list[str]:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(subdir, flags, dir_fd=root_fd)
    found: list[str] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if len(found) >= limit:
                    break
                name = entry.name
                if not (is_value_name(subdir, name) or parse_temp_name(subdir, name)):
                    found.append(f"{subdir}/{name}")
    finally:
        os.close(fd)
    return found


# ---- walking the directory: never through a symlink -----------------------------------

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_OURS = object()  # a subdirectory name held by something the tier did not create


class Subdirs:
    """The hex subdirectories one op uses, each opened once relative to the root fd with
    ``O_NOFOLLOW`` (a symlink or a file in their place is not ours), closed by ``close``.

    Raises ``OSError`` for failures other than "missing" and "not ours".
    """

    def __init__(self, root_fd: int, *, create: bool, dir_mode: int = 0o700) -> None:
        self._root_fd = root_fd
        self._create = create
        self._dir_mode = dir_mode
        self._fds: dict[str, object] = {}

    def fd(self, key: str) -> int | None:
        """The fd of ``key``'s subdirectory (``key`` may be the subdirectory name itself);
        None when it does not exist (and ``create`` is off) or is not ours."""
        name = key[:2]
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = self._open(name)
        return None if fd is _NOT_OURS else fd  # type: ignore[return-value]

    def _open(self, name: str) -> object:
        for attempt in range(2):
            try:
                return os.open(name, DIR_FLAGS, dir_fd=self._root_fd)
            except FileNotFoundError:
                if not self._create or attempt:
                    return _NOT_OURS
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    return _NOT_OURS  # a symlink or a file named like our subdirectory
                raise
            try:
                os.mkdir(name, self._dir_mode, dir_fd=self._root_fd)
            except FileExistsError:
                pass  # another writer made it meanwhile
        return _NOT_OURS

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not _NOT_OURS:
                os.close(fd)  # type: ignore[arg-type]
        self._fds.clear()


class Scan(NamedTuple):
    values: list[tuple[int, int, str, str]]  # (mtime_ns, nbytes, subdir, name) of each value
    temp_nbytes: int  # bytes of the temp files a live writer may own (left in place)
    unsafe: tuple[str, str] | None  # the first subdirectory others can write, and why


def scan(root_fd: int, *, sweep: bool) -> Scan:
    """Every value under the root, and its temp files; with ``sweep``, temp files no live
    writer can own are removed. Only the exact names of this module in real (non-symlink)
    hex subdirectories are looked at. Raises ``OSError``."""
    values = []
    temp_nbytes = 0
    unsafe = None
    now = time.time()
    # A fresh open of the root: scandir on a shared fd would share its directory offset
    # with a scan in another thread.
    top_fd = os.open(".", DIR_FLAGS, dir_fd=root_fd)
    try:
        with os.scandir(top_fd) as top:
            subdirs = [e.name for e in top
                       if is_subdir_name(e.name) and e.is_dir(follow_symlinks=False)]
    finally:
        os.close(top_fd)
    for subdir in subdirs:
        try:
            sub = os.open(subdir, DIR_FLAGS, dir_fd=root_fd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                continue  # gone, or swapped for something not ours meanwhile
            raise
        try:
            if unsafe is None:
                reason = unsafe_reason(os.fstat(sub))
                unsafe = None if reason is None else (subdir, reason)
            with os.scandir(sub) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue  # not a value (nor ours to remove)
                    name = entry.name
                    if is_value_name(subdir, name):
                        values.append((st.st_mtime_ns, st.st_size, subdir, name))
                        continue
                    temp = parse_temp_name(subdir, name)
                    if temp is None:
                        continue  # not a name we create: not ours
                    if sweep and temp_is_stale(*temp, now - st.st_mtime):
                        try:
                            os.unlink(name, dir_fd=sub)
                            continue
                        except FileNotFoundError:
                            continue
                        except OSError:
                            pass  # read-only store: it stays, and takes room
                    temp_nbytes += st.st_size
        finally:
            os.close(sub)
    return Scan(values, temp_nbytes, unsafe)


# ---- start-up checks ----------------------------------------------------------------


def unsafe_message(what: str, reason: str) -> str:
    return (
        f"file storage: refusing {what}: {reason}, so other users could plant KV that "
        f"this cache would serve. Expected a directory only its owner can write "
        f"(chmod go-w, or a new path: hicache creates it 0700); for a deliberately "
        f"shared cache pass the storage option shared=True and set a storage secret "
        f"(HICACHE_STORAGE_SECRET or storage_secret)"
    )


def check_root(root_fd: int, root: str, *, shared: bool, adopt: bool, file_mode: int) -> None:
    """Refuse an unsafe root (unless ``shared``), or one holding what the tier did not
    create (unless ``adopt``), with one ``ValueError``; mark a recognised root as a store.
    Run at open, before any other thread uses the root."""
    reason = unsafe_reason(os.fstat(root_fd))
    if reason is not None and not shared:
        raise ValueError(unsafe_message(root, reason))
    if _has_marker(root_fd):
        return
    foreign = foreign_entries(root_fd)
    if foreign and not adopt:
        raise ValueError(
            f"file storage: {root} holds entries hicache did not create "
            f"({', '.join(foreign)}); expected an empty directory or a hicache store. "
            f"Pass the storage option adopt=True to use it anyway (hicache then reads "
            f"and removes only its own entries), or choose another directory"
        )
    try:
        fd = os.open(MARKER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, file_mode, dir_fd=root_fd)
    except OSError:
        return  # a read-only store, or marked meanwhile: nothing to write
    try:
        os.write(fd, MARKER_TEXT)
    finally:
        os.close(fd)


def _has_marker(root_fd: int) -> bool:
    try:
        fd = os.open(MARKER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=root_fd)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(MARKER_TEXT)) == MARKER_TEXT
    finally:
        os.close(fd)
