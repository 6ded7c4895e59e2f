"""The C++ extension: JIT build, cache and load.

The sources in ``hicache/csrc`` (the radix tree, the page free list, HiCache's
bookkeeping-only lifecycle) are compiled on first use with
``torch.utils.cpp_extension.load`` into a build directory keyed by a hash of the
sources, their directory, the torch version and the Python version, so later
processes load the cached module in milliseconds. Any
failure (no compiler, no ninja, a build error) is reported as a reason, never
raised from here except by :func:`load_native`; callers fall back to their
pure-Python implementations.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("tree.cpp", "lifecycle.cpp", "bindings.cpp")  # translation units; headers are hashed too
_log = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The native tree cannot be built or loaded here; the message names why."""


class _LoadResult(NamedTuple):
    module: ModuleType | None
    reason: str  # why module is None ("" when it loaded)
    build_seconds: float  # time spent in cpp_extension.load (compile or cache hit)


def source_digest() -> str:
    """Hash of every C++ source and header, where they are, the torch and Python versions.

    Where: the build records the sources' paths, so two checkouts sharing one
    build directory would rebuild each other's module on every load.
    """
    h = hashlib.sha256()
    h.update(str(_CSRC).encode())
    for path in sorted(_CSRC.glob("*")):
        if path.suffix in (".h", ".cpp"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(os.environ.get("CXX", "c++").encode())
    return h.hexdigest()[:16]


def build_directory() -> Path:
    """Where the module is compiled and cached (``$HICACHE_BUILD_DIR`` overrides the root)."""
    root = os.environ.get("HICACHE_BUILD_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "hicache")
    return Path(root) / f"native-{source_digest()}"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` of the ninja wheel (or of this interpreter's venv) on PATH for the build.

    ``pip install ninja`` puts the binary next to the interpreter, which is not on
    PATH when the venv is not activated; cpp_extension looks it up on PATH.
    """
    if shutil.which("ninja") is not None:
        yield
        return
    dirs = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja  # the PyPI wheel of the build tool

        dirs.insert(0, ninja.BIN_DIR)
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([*dirs, old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory exclusively; clear a lock file a killed build left behind.

    cpp_extension marks a build in progress with a ``lock`` file and waits, forever,
    for it to disappear: a build interrupted by Ctrl-C or a kill leaves it behind
    and every later import would hang. This ``flock`` is released by the kernel
    however its holder dies, and while it is held no other hicache process is
    building here, so a ``lock`` file found then is stale.
    """
    import fcntl

    with open(build_dir / "hicache.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                _log.warning("hicache: removing the lock file of an interrupted build in %s",
                             build_dir)
                stale.unlink()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def _load() -> _LoadResult:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return _LoadResult(None, f"no C++ compiler ({cxx!r} not found on PATH; set CXX)", 0.0)
    from torch.utils import cpp_extension

    build_dir = build_directory()
    name = f"hicache_native_{build_dir.name.removeprefix('native-')}"
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _ninja_on_path(), _build_lock(build_dir):
            if shutil.which("ninja") is None:
                return _LoadResult(None, "ninja not found (pip install ninja)", 0.0)
            _log.info("hicache: loading the native extension from %s (compiles on first use)", build_dir)
            module = cpp_extension.load(
                name=name,
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=["-O3", "-std=c++20"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:  # any build or import failure means "fall back"
        first = str(exc).strip().splitlines()
        detail = first[0] if first else type(exc).__name__
        return _LoadResult(None, f"build error: {type(exc).__name__}: {detail}", 0.0)
    return _LoadResult(module, "", time.perf_counter() - start)


def load_native() -> ModuleType:
    """The compiled module (built on first use); raises :class:`NativeBuildError`."""
    result = _load()
    if result.module is None:
        raise NativeBuildError(f"hicache native extension unavailable: {result.reason}")
    return result.module


def native_available() -> bool:
    """True if the native extension builds and loads here (builds it on first call)."""
    return _load().module is not None


def native_unavailable_reason() -> str:
    """Why the native extension is unavailable ("" if it is available)."""
    return _load().reason


def native_build_seconds() -> float:
    """Seconds this process spent loading the module (the compile, if it was not cached)."""
    return _load().build_seconds
