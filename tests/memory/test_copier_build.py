"""The C row copier's build: compiled at install, the JIT build only as the fallback,
nothing left behind by a compiler that fails or hangs, stale builds pruned."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optional import skip_unless

from hicache import buildcache
from hicache.memory import copier as copier_module

needs_cc = skip_unless("cc")
DAY_S = 86400.0


@pytest.fixture
def fresh_copier(tmp_path, monkeypatch):
    """The loader with its cache cleared, its JIT cache in tmp_path/cache and no
    library compiled at install (tests put one at tmp_path/_copier.so)."""
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(copier_module, "INSTALLED_PATH", tmp_path / "_copier.so")
    copier_module.load_copier.cache_clear()
    yield copier_module
    copier_module.load_copier.cache_clear()  # later callers load the shipped source's library


def _fake_compiler(tmp_path: Path, body: str) -> str:
    """A compiler stand-in: a shell script, ``$OUT`` set to its ``-o`` argument."""
    path = tmp_path / "fake-cc"
    path.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\nOUT="$2"\n' + body)
    path.chmod(0o755)
    return str(path)


def _age(path: Path, days: float) -> None:
    stamp = time.time() - days * DAY_S
    os.utime(path, (stamp, stamp))


def test_the_copier_source_ships_with_the_package():
    root = Path(__file__).resolve().parents[2]
    assert copier_module.SOURCE_PATH == root / "hicache" / "memory" / "copier.c"
    assert "int hc_copy_rows(" in copier_module.SOURCE_PATH.read_text()
    assert '"memory/copier.c"' in (root / "pyproject.toml").read_text()  # wheel
    assert "include hicache/memory/copier.c" in (root / "MANIFEST.in").read_text()  # sdist
    # ... and setup.py compiles it at install, into the path the loader looks at.
    setup_py = (root / "setup.py").read_text()
    assert 'CopierLibrary("hicache.memory._copier", [COPIER_SOURCE]' in setup_py
    assert copier_module.INSTALLED_PATH.name.startswith("_copier")


@needs_cc
def test_the_library_compiled_at_install_is_loaded_without_compiling(fresh_copier, tmp_path,
                                                                     monkeypatch):
    source = fresh_copier.SOURCE_PATH.read_bytes()
    buildcache.compile_copier(source, fresh_copier.INSTALLED_PATH)  # what setup.py does
    ran = tmp_path / "compiler-ran"
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, f"touch {ran}\nexit 1\n"))
    loaded = fresh_copier.load_copier()
    assert loaded.origin == "installed" and loaded.reason == ""
    assert loaded.lib.hc_copy_rows is not None
    assert fresh_copier.copier_status() == "compiled at install"
    assert not ran.exists() and not (tmp_path / "cache").exists()


@needs_cc
def test_a_stale_installed_library_falls_back_to_the_jit_build(fresh_copier, tmp_path,
                                                               monkeypatch):
    """Installed from other bytes than today's copier.c (a checkout edited after
    install): never loaded; the JIT fallback compiles today's source into the cache."""
    source = fresh_copier.SOURCE_PATH.read_bytes()
    old = source + b"/* an older version */\n"
    buildcache.compile_copier(old, fresh_copier.INSTALLED_PATH)
    loaded = fresh_copier.load_copier()
    assert loaded.origin == "jit-build", loaded.reason
    assert loaded.reason.startswith("the copier compiled at install is stale (built from "
                                    f"'{buildcache.copier_digest(old)}'")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        fresh_copier._library_path(source).name]
    assert fresh_copier.copier_status() == "compiled now"
    # The next process finds the cached library and compiles nothing.
    fresh_copier.load_copier.cache_clear()
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "exit 1\n"))
    again = fresh_copier.load_copier()
    assert again.origin == "jit-cache" and again.lib is not None
    assert fresh_copier.copier_status() == "loaded from an earlier JIT build"


@needs_cc
def test_the_native_copier_is_rebuilt_when_its_source_changes(fresh_copier, tmp_path,
                                                              monkeypatch):
    """The library's name carries the digest of the bytes it was built from: an edited
    copier.c never loads a library compiled from the old source."""
    source = fresh_copier.SOURCE_PATH.read_bytes()
    edited = tmp_path / "copier.c"
    edited.write_bytes(source + b"/* edited */\n")
    monkeypatch.setattr(fresh_copier, "SOURCE_PATH", edited)
    lib = fresh_copier.load_native_copier()
    built = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert lib is not None and lib.hc_copy_rows is not None
    assert built == [fresh_copier._library_path(edited.read_bytes()).name]
    assert fresh_copier._library_path(source) != fresh_copier._library_path(edited.read_bytes())


def test_without_a_compiler_there_is_no_copier_and_the_reason_says_why(fresh_copier,
                                                                      monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    loaded = fresh_copier.load_copier()
    assert loaded.lib is None and fresh_copier.load_native_copier() is None
    assert loaded.reason == ("no copier compiled at install; no C compiler "
                             "('no-such-compiler' not found on PATH; set CC)")
    assert fresh_copier.copier_status().startswith("unavailable, torch copies in use (")


def test_a_compiler_that_times_out_leaves_no_file(tmp_path):
    """The compiler is killed with its whole process group: a linker it started that
    writes the output later must not leave a file behind either."""
    compiler = _fake_compiler(
        tmp_path, 'echo partial > "$OUT"\n(sleep 2; echo late > "$OUT") &\nsleep 30\n')
    out = tmp_path / "lib" / "copier.so"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        buildcache.compile_copier(b"int x;", out, compiler=compiler, timeout_s=0.5)
    assert time.monotonic() - start < 10
    time.sleep(2.5)  # past the moment the orphaned writer would have written
    assert list(out.parent.iterdir()) == []


def test_a_failed_compile_leaves_no_file_and_the_loader_reports_it(fresh_copier, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("CC", _fake_compiler(
        tmp_path, 'echo partial > "$OUT"\necho "copier.c:1: error: boom" >&2\nexit 1\n'))
    loaded = fresh_copier.load_copier()
    assert loaded.lib is None
    assert loaded.reason.endswith("the copier does not compile: copier.c:1: error: boom")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_timeout_in_the_loader_falls_back_and_leaves_no_file(fresh_copier, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, 'echo partial > "$OUT"\nsleep 30\n'))
    monkeypatch.setattr(buildcache, "COPIER_TIMEOUT_S", 0.5)
    loaded = fresh_copier.load_copier()
    assert loaded.lib is None and "TimeoutExpired" in loaded.reason
    assert list((tmp_path / "cache").iterdir()) == []


def test_prune_removes_only_old_unheld_entries_of_other_digests(tmp_path):
    root = tmp_path
    names = {
        "copier-old.so": 40,            # another digest, unused 40 days: removed
        "copier-recent.so": 3,          # another digest, used 3 days ago: kept
        "copier-current.so": 400,       # the current digest: kept however old
        "copier-held.so": 40,           # old, but a live process loaded it: kept
        "copier-x.so.tmp-abc": 1,       # a killed compile's temporary file: removed
        "unrelated.so": 400,            # not ours: kept
    }
    for name, days in names.items():
        (root / name).write_bytes(b"")
        _age(root / name, days)
    fresh_tmp = root / "copier-y.so.tmp-def"  # a compile running now: kept
    fresh_tmp.write_bytes(b"")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom pathlib import Path\nfrom hicache import buildcache\n"
         "buildcache.hold(Path(sys.argv[1]))\nprint('held', flush=True)\ntime.sleep(60)\n",
         str(root / "copier-held.so")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        _age(root / "copier-held.so", 40)  # hold() touched it; make it look old again
        removed = buildcache.prune_stale(root, "copier-", {"copier-current.so"})
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert sorted(p.name for p in removed) == ["copier-old.so", "copier-x.so.tmp-abc"]
    assert sorted(p.name for p in root.iterdir()) == [
        "copier-current.so", "copier-held.so", "copier-recent.so", "copier-y.so.tmp-def",
        "unrelated.so"]
    # Its holder gone, the old library goes at the next prune.
    assert [p.name for p in buildcache.prune_stale(root, "copier-", {"copier-current.so"})] == [
        "copier-held.so"]


def test_prune_ages_a_directory_by_its_newest_file_and_respects_its_lock(tmp_path):
    def build_dir(name: str, days: float, *, lock: bool = True) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "_native.so").write_bytes(b"")
        if lock:
            (d / buildcache.DIR_LOCK_NAME).write_bytes(b"")
        for f in [*d.iterdir(), d]:
            _age(f, days)
        return d

    build_dir("native-old", 40)
    build_dir("native-nolock", 40, lock=False)  # a build that never started: removed
    used = build_dir("native-used", 40)
    _age(used / buildcache.DIR_LOCK_NAME, 1)  # a loader touched it yesterday: kept
    held = build_dir("native-held", 40)
    buildcache.hold(held / buildcache.DIR_LOCK_NAME)  # this process loaded its module
    _age(held / buildcache.DIR_LOCK_NAME, 40)
    build_dir("native-current", 400)
    removed = buildcache.prune_stale(tmp_path, "native-", {"native-current"})
    assert sorted(p.name for p in removed) == ["native-nolock", "native-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "native-current", "native-held", "native-used"]
    # max_age_days is the knob: with 0 days, only the held and the current remain.
    assert [p.name for p in buildcache.prune_stale(tmp_path, "native-", {"native-current"},
                                                   max_age_days=0)] == ["native-used"]


@needs_cc
def test_a_jit_build_of_the_copier_prunes_stale_libraries(fresh_copier, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "copier-0123456789abcdef.so").write_bytes(b"")
    _age(cache / "copier-0123456789abcdef.so", 60)
    assert fresh_copier.load_copier().origin == "jit-build"
    assert [p.name for p in cache.iterdir()] == [
        fresh_copier._library_path(fresh_copier.SOURCE_PATH.read_bytes()).name]


def test_the_jit_caches_share_one_root(tmp_path, monkeypatch):
    monkeypatch.delenv("HICACHE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = b"int x;"
    assert buildcache.copier_cache_path(source).parent == tmp_path / "hicache"
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert buildcache.copier_cache_path(source).parent == tmp_path / "elsewhere"
