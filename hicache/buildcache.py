"""Code hicache compiles itself: the C copier's compile command, where run-time (JIT)
builds are kept, and pruning the ones nothing uses any more.

Two things are compiled outside pip's own extension build: the C row copier
(``hicache/memory/copier.c``, :func:`compile_copier`; ``setup.py`` runs the same command
at install, the loader in ``hicache/memory/copier.py`` only as the fallback) and the
native tree's JIT build (``hicache/native/build.py``). Both keep what they build under
:func:`cache_root`, named by a digest of what went in, so every edit or upgrade adds
an entry; :func:`prune_stale` removes entries of other digests that no process holds
and none has used for ``MAX_AGE_DAYS``.

An entry in use is held with a shared ``flock`` (:func:`hold`) for the life of the
process that loaded it; a build holds its own exclusively. The pruner takes the lock
exclusively without waiting, so it never removes what a live process loaded or is
building, and the kernel drops the locks of a process however it ends.

Standard library only, and no hicache import: ``setup.py`` loads this file on its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

# An entry of another digest is removed once unused this long: long enough that two
# checkouts or versions used in turn keep their builds, short enough that a cache
# directory does not grow with every upgrade.
MAX_AGE_DAYS = 30.0
# A temporary file older than this belongs to a compile that was killed (they time out
# after COPIER_TIMEOUT_S).
TEMP_MAX_AGE_S = 3600.0
COPIER_TIMEOUT_S = 120.0
# The copier's compile flags, at install and in the JIT fallback alike.
COPIER_CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")
# The root of the copier's JIT cache, when set; the names of the libraries there.
COPIER_CACHE_ENV = "HICACHE_CACHE_DIR"
COPIER_PREFIX = "copier-"
# A JIT build directory's file that builds lock exclusively and loaders share.
DIR_LOCK_NAME = "hicache.flock"
_TEMP_MARK = ".tmp-"

# Files held open (and share-locked) by this process: what it loaded stays unprunable.
_held: list[int] = []


def cache_root(override_env: str) -> Path:
    """``$<override_env>``, else ``$XDG_CACHE_HOME/hicache``, else ``~/.cache/hicache``."""
    override = os.environ.get(override_env)
    if override:
        return Path(override)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hicache"


def copier_cache_path(source: bytes) -> Path:
    """Where the JIT fallback keeps the copier compiled from ``source``: the name
    carries the source's digest, so an edited ``copier.c`` builds a new library instead
    of loading one compiled from older bytes."""
    return cache_root(COPIER_CACHE_ENV) / f"{COPIER_PREFIX}{copier_digest(source)}.so"


def prune_copier_cache(source: bytes, **kwargs: float) -> list[Path]:
    """:func:`prune_stale` over the copier libraries of other sources than ``source``."""
    path = copier_cache_path(source)
    return prune_stale(path.parent, COPIER_PREFIX, {path.name}, **kwargs)


def copier_digest(source: bytes) -> str:
    """Digest of the copier's source bytes: in its cached library's name, and compiled
    into every library (``hc_source_digest()``) so a loader can tell a stale one."""
    return hashlib.sha256(source).hexdigest()[:16]


def compile_copier(source: bytes, out: Path, *, compiler: str | None = None,
                   timeout_s: float | None = None) -> None:
    """Compile the copier's C ``source`` into the shared library ``out``, atomically.

    ``compiler`` defaults to ``$CC``, else ``cc``; ``timeout_s`` to ``COPIER_TIMEOUT_S``. Raises ``OSError`` (no compiler),
    ``subprocess.CalledProcessError`` (a compile error; its ``stderr`` says which) or
    ``subprocess.TimeoutExpired``. Whatever happens, ``out`` is either the finished
    library or untouched, and no temporary file is left: the compiler runs in a
    process group of its own, killed whole on a timeout or an interrupt, so no
    orphaned linker writes the file after it was removed.
    """
    compiler = compiler or os.environ.get("CC", "cc")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + _TEMP_MARK)
    os.close(fd)
    cmd = [compiler, *COPIER_CFLAGS, f'-DHC_SOURCE_DIGEST="{copier_digest(source)}"',
           "-x", "c", "-", "-o", tmp]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(
                source, timeout=COPIER_TIMEOUT_S if timeout_s is None else timeout_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, stdout, stderr)
        os.replace(tmp, out)  # atomic: concurrent builders never see half a file
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def hold(path: Path) -> None:
    """Mark ``path`` (a file) in use for the rest of this process: a shared ``flock``
    on it, and its modification time set to now (what :func:`prune_stale` ages by)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)
    except OSError:
        os.close(fd)
        raise
    _held.append(fd)


def _try_lock(path: Path) -> int | None:
    """An exclusive ``flock`` on ``path`` if nobody holds one; None if it is held."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _last_used(entry: Path) -> float:
    """When ``entry`` was last built or loaded: a file's own mtime; a directory's newest
    file's (loaders touch the files they hold)."""
    if not entry.is_dir():
        return entry.stat().st_mtime
    times = [entry.stat().st_mtime]
    times += [p.stat().st_mtime for p in entry.iterdir() if p.is_file()]
    return max(times)


def prune_stale(root: Path, prefix: str, keep: set[str], *,
                max_age_days: float = MAX_AGE_DAYS, now: float | None = None) -> list[Path]:
    """Remove the entries of ``root`` named ``prefix*`` that are stale; return them.

    Stale: not named in ``keep`` (the current digests), unused for ``max_age_days``,
    and not held by any process (a file: its own ``flock``; a directory: the lock file
    ``DIR_LOCK_NAME`` inside). A temporary file of a killed compile goes after
    ``TEMP_MAX_AGE_S`` whatever its digest. Nothing here raises: an entry that cannot
    be examined or removed stays, for a later prune.
    """
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or entry.name in keep:
            continue
        try:
            age_s = now - _last_used(entry)
            is_temp = _TEMP_MARK in entry.name and not entry.is_dir()
            if age_s < (TEMP_MAX_AGE_S if is_temp else max_age_days * 86400.0):
                continue
            # A directory without a lock file never finished starting a build.
            lock_path = entry / DIR_LOCK_NAME if entry.is_dir() else entry
            fd = _try_lock(lock_path) if lock_path.exists() else None
            if fd is None and lock_path.exists():
                continue  # held by a live process
            try:
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            finally:
                if fd is not None:
                    os.close(fd)
        except OSError:
            continue
        removed.append(entry)
    return removed
