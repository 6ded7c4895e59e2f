"""What the file tier puts in its directory: exact names, and who owns a temp file.

Everything :class:`~hicache.storage.file.FileStorage` creates under its root::

    ROOT/.hicache-store                  marker: "this directory is a hicache store"
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

This module knows names and processes, not values or the cache.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
import stat
import threading

MARKER_NAME = ".hicache-store"
MARKER_TEXT = b"hicache file store v1\n"
STALE_TEMP_AGE_S = 600.0  # no write of one page takes this long
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_VALUE = re.compile(r"[0-9a-f]{32,128}")
_TEMP = re.compile(
    r"\.(?P<key>[0-9a-f]{32,128})\.(?:(?P<owner>[0-9a-f]{16})\.)?(?P<pid>[0-9]{1,10})"
    r"\.[0-9]{1,20}\.[0-9]{1,20}\.tmp"
)


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
            if entry.name == MARKER_NAME and entry.is_file(follow_symlinks=False):
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
    found = []
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
