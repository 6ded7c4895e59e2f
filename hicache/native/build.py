"""The C++ extension: the module compiled at install time, or a JIT build as the fallback.

The sources in ``hicache/native/csrc`` (the radix tree, the page free list, HiCache's
bookkeeping-only lifecycle) are compiled once when the package is installed
(``make install``, ``pip install .``; see ``setup.py``) into ``hicache/native/_native``,
next to a ``_native_build.json`` that records what it was built from: a digest
of the sources' contents and the torch version. A process loads that module when
both still match, which costs milliseconds and never runs a build tool.

Only when they do not match (a source checkout whose ``csrc/`` changed, torch
upgraded under the package, an install without a compiler) does a JIT build
with ``torch.utils.cpp_extension.load`` run, into a build directory keyed by a
hash of the sources, their directory, the torch and the Python versions. Such a
build announces itself on stderr with its duration. Once a build directory
holds a finished module (a ``hicache.built`` marker names it), later processes
import it directly: ninja is not consulted again, so two ninja versions on
``PATH`` (a venv's and the system's, which read each other's ``.ninja_log`` as
stale) cannot make one process rebuild what another built.

``HICACHE_NATIVE`` selects the source: ``auto`` (default: the installed module,
else JIT), ``prebuilt`` (the installed module or nothing), ``jit`` (ignore the
installed module) or ``sanitize``: a JIT build with AddressSanitizer and
UndefinedBehaviorSanitizer into a build directory of its own (``native-asan-*``;
the installed module is untouched), which loads only in a process started with
the ASan runtime preloaded (``make sanitize`` does that). Any failure (no compiler, no ninja, a build error) is
reported as a reason, never raised from here except by :func:`load_native`;
callers fall back to their pure-Python implementations.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
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

from hicache.buildcache import DIR_LOCK_NAME, cache_root, hold, prune_stale
from hicache.errors import NativeBuildError  # defined with the others; raised from here

_PACKAGE = Path(__file__).resolve().parent
_CSRC = _PACKAGE / "csrc"
_SOURCES = ("tree.cpp", "components.cpp", "lifecycle.cpp", "bindings.cpp")  # translation units; headers are hashed too
_MODULE = "_native"  # the extension's name, installed as hicache.native._native
BUILD_INFO_NAME = "_native_build.json"  # written by setup.py next to the installed module
_DIR_PREFIX = "native-"  # JIT build directories: native-<digest>, native-asan-<digest>
_BUILT_MARKER = "hicache.built"  # written into a JIT build directory once its module loaded
_log = logging.getLogger(__name__)


class _LoadResult(NamedTuple):
    module: ModuleType | None
    reason: str  # why module is None ("" when it loaded)
    build_seconds: float  # time spent compiling in this process (0 when nothing was built)
    origin: str = ""  # "prebuilt", "jit-cache" or "jit-build"; "" when module is None


def content_digest(csrc: Path | None = None) -> str:
    """Hash of the names and contents of every C++ source and header (not their location)."""
    h = hashlib.sha256()
    for path in sorted((csrc or _CSRC).glob("*")):
        if path.suffix in (".h", ".hpp", ".cpp"):
            h.update(path.name.encode())
            h.update(len(path.read_bytes()).to_bytes(8, "little"))
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_info(csrc: Path | None = None) -> dict[str, str]:
    """What a compiled module depends on; the installed module loads only if this matches."""
    return {
        "sources": content_digest(csrc),
        "torch": torch.__version__,
        "python": sys.implementation.cache_tag or sys.version.split()[0],
    }


def source_digest() -> str:
    """Key of the JIT build directory: the sources, where they are, torch, Python, compiler.

    Where: cpp_extension's ninja file records the sources' paths, so two checkouts
    sharing one build directory would rebuild each other's module on every build.
    """
    h = hashlib.sha256()
    h.update(str(_CSRC).encode())
    h.update(content_digest().encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(os.environ.get("CXX", "c++").encode())
    return h.hexdigest()[:16]


# A sanitized build: ASan + UBSan, any UB report fatal, frames kept for the reports.
_SANITIZE_FLAGS = [
    "-O1", "-g", "-std=c++20", "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
]


def build_directory(sanitize: bool = False) -> Path:
    """Where the JIT module is compiled and cached (``$HICACHE_BUILD_DIR`` overrides the root)."""
    return cache_root("HICACHE_BUILD_DIR") / f"{_DIR_PREFIX}{'asan-' if sanitize else ''}{source_digest()}"


def prune_build_dirs(**kwargs: float) -> list[Path]:
    """Remove the JIT build directories of other sources, checkouts or versions than this
    one's that no process holds and none used for ``buildcache.MAX_AGE_DAYS``; return
    them (see :func:`hicache.buildcache.prune_stale`). Runs after every JIT build and
    at install."""
    keep = {build_directory(sanitize=False).name, build_directory(sanitize=True).name}
    return prune_stale(build_directory().parent, _DIR_PREFIX, keep, **kwargs)


def _hold(build_dir: Path) -> None:
    """Mark the build directory whose module this process loaded in use (never pruned
    while the process lives; its age counts from now)."""
    lock = build_dir / DIR_LOCK_NAME
    lock.touch()
    hold(lock)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` of the ninja wheel (or of this interpreter's venv) first on PATH.

    ``pip install ninja`` puts the binary next to the interpreter, which is not on
    PATH when the venv is not activated; cpp_extension looks it up on PATH. The
    wheel's binary goes first whatever PATH says, so every JIT build from this
    interpreter uses the same ninja.
    """
    dirs = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja  # the PyPI wheel of the build tool

        dirs.insert(0, ninja.BIN_DIR)
    dirs = [d for d in dirs if os.path.exists(os.path.join(d, "ninja"))]
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

    with open(build_dir / DIR_LOCK_NAME, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                _log.warning("removing the lock file of an interrupted build in %s", build_dir)
                stale.unlink()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_file(path: Path) -> ModuleType:
    """Import the extension at ``path`` (its init function is named after ``_MODULE``)."""
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_prebuilt() -> _LoadResult:
    """The module compiled at install time, if it was built from these sources and this torch."""
    info_path = _PACKAGE / BUILD_INFO_NAME
    try:
        recorded = json.loads(info_path.read_text())
    except FileNotFoundError:
        return _LoadResult(None, "no module compiled at install time", 0.0)
    except (OSError, ValueError) as exc:
        return _LoadResult(None, f"unreadable {info_path}: {exc}", 0.0)
    current = build_info()
    changed = [k for k in current if recorded.get(k) != current[k]]
    if changed:
        return _LoadResult(
            None,
            "the module compiled at install time is stale (" + ", ".join(
                f"{k}: built for {recorded.get(k)!r}, now {current[k]!r}" for k in changed
            ) + ")",
            0.0,
        )
    try:
        module = importlib.import_module(f"hicache.native.{_MODULE}")
    except ImportError as exc:
        return _LoadResult(None, f"the module compiled at install time does not import: {exc}", 0.0)
    return _LoadResult(module, "", 0.0, "prebuilt")


def _load_built(build_dir: Path) -> ModuleType | None:
    """The module a finished JIT build left in ``build_dir``, or None if there is none."""
    marker = build_dir / _BUILT_MARKER
    try:
        so_name = marker.read_text().strip()
    except OSError:
        return None
    so_path = build_dir / so_name
    if not so_name or not so_path.is_file():
        return None
    return _import_file(so_path)


def _jit_build(build_dir: Path, sanitize: bool = False) -> _LoadResult:
    """Compile the sources into ``build_dir`` (or import what an earlier build left there)."""
    cxx = os.environ.get("CXX", "c++")
    seconds = 0.0
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        module = _load_built(build_dir)
        if module is not None:
            _hold(build_dir)
            return _LoadResult(module, "", 0.0, "jit-cache")
        if shutil.which(cxx) is None:
            return _LoadResult(None, f"no C++ compiler ({cxx!r} not found on PATH; set CXX)", 0.0)
        with _ninja_on_path(), _build_lock(build_dir):
            module = _load_built(build_dir)  # another process may have built it meanwhile
            built_by = "jit-cache"
            if module is None:
                built_by = "jit-build"
                module, seconds = _compile(build_dir, sanitize)
        _hold(build_dir)
        if built_by == "jit-build":
            for stale in prune_build_dirs():
                _log.info("removed the stale JIT build directory %s", stale)
    except NativeBuildError as exc:
        return _LoadResult(None, str(exc), 0.0)
    except Exception as exc:  # any build or import failure means "fall back"
        first = str(exc).strip().splitlines()
        detail = first[0] if first else type(exc).__name__
        return _LoadResult(None, f"build error: {type(exc).__name__}: {detail}", 0.0)
    return _LoadResult(module, "", seconds, built_by)


def _compile(build_dir: Path, sanitize: bool) -> tuple[ModuleType, float]:
    """Run cpp_extension's build into ``build_dir`` (its lock held), mark it finished;
    return the module and the seconds the build took."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        raise NativeBuildError("ninja not found (pip install ninja)")
    # A user-visible notice, not a log record: a silent minute looks like a hang.
    sys.stderr.write(
        f"hicache: compiling the native extension into {build_dir} "
        "(its sources changed since install, or it was not built at install; "
        "about a minute)...\n"
    )
    sys.stderr.flush()
    start = time.perf_counter()
    module = cpp_extension.load(
        name=_MODULE,
        sources=[str(_CSRC / s) for s in _SOURCES],
        extra_cflags=_SANITIZE_FLAGS if sanitize else ["-O3", "-std=c++20"],
        extra_ldflags=["-fsanitize=address,undefined"] if sanitize else None,
        build_directory=str(build_dir),
        verbose=False,
    )
    seconds = time.perf_counter() - start
    so_file = getattr(module, "__file__", None)
    if so_file:
        (build_dir / _BUILT_MARKER).write_text(os.path.basename(so_file) + "\n")
    sys.stderr.write(f"hicache: native extension built in {seconds:.1f} s\n")
    sys.stderr.flush()
    return module, seconds


@functools.cache
def _load() -> _LoadResult:
    mode = os.environ.get("HICACHE_NATIVE", "auto")
    if mode not in ("auto", "prebuilt", "jit", "sanitize"):
        return _LoadResult(
            None,
            f"HICACHE_NATIVE: expected 'auto', 'prebuilt', 'jit' or 'sanitize', got {mode!r}",
            0.0,
        )
    if mode == "sanitize":
        return _jit_build(build_directory(sanitize=True), sanitize=True)
    prebuilt = _LoadResult(None, "HICACHE_NATIVE=jit", 0.0)
    if mode != "jit":
        prebuilt = _load_prebuilt()
        if prebuilt.module is not None or mode == "prebuilt":
            return prebuilt
        _log.info("native extension: %s; trying a JIT build", prebuilt.reason)
    result = _jit_build(build_directory())
    if result.module is None and mode == "auto":
        return result._replace(reason=f"{prebuilt.reason}; {result.reason}")
    return result


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
    """Seconds this process spent compiling the module (0 when nothing was compiled)."""
    return _load().build_seconds


def native_status() -> str:
    """One line for people: where the module came from, or why it is unavailable."""
    result = _load()
    if result.module is None:
        return f"unavailable, Python fallbacks in use ({result.reason})"
    if result.origin == "prebuilt":
        with contextlib.suppress(OSError, ValueError):
            seconds = json.loads((_PACKAGE / BUILD_INFO_NAME).read_text()).get("build_seconds")
            if seconds is not None:
                return f"compiled at install ({seconds} s)"
        return "compiled at install"
    if result.origin == "jit-build":
        return f"compiled now ({result.build_seconds:.1f} s)"
    return "loaded from an earlier JIT build"


def native_origin() -> str:
    """Where the loaded module came from: ``"prebuilt"`` (compiled at install time),
    ``"jit-cache"`` (an earlier JIT build), ``"jit-build"`` (compiled by this process),
    or ``""`` when it is unavailable."""
    return _load().origin
