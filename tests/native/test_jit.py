"""The native extension's loader: the module compiled at install time, the JIT fallback,
per-checkout build directories, no rebuild whatever ninja PATH finds first, and no hang
after an interrupted build."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from hicache.native import build as jit

VENV_BIN = os.path.dirname(sys.executable)
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# The two PATH orders of the issue: the venv's tools first (activated), the system's first.
PATH_ORDERS = {
    "venv-first": f"{VENV_BIN}:{SYSTEM_PATH}",
    "system-first": f"{SYSTEM_PATH}:{VENV_BIN}",
}
_PROBE = (
    "from hicache.native import build as jit\n"
    "print(jit.native_origin(), jit.native_build_seconds(), jit.native_unavailable_reason())\n"
)


def _prebuilt_so() -> Path:
    found = sorted(jit._PACKAGE.glob(f"{jit._MODULE}.*.so"))
    if not found or not (jit._PACKAGE / jit.BUILD_INFO_NAME).exists():
        pytest.skip("no module compiled at install time here (make install builds it; "
                    "without a compiler the JIT build and the Python fallbacks remain)")
    return found[0]


def _probe(tmp_path: Path, path: str, **env: str) -> tuple[str, str]:
    """Load the extension in a fresh process with PATH = ``path`` and a ninja first on it
    that records being run; returns (stdout, stderr) and fails if ninja ran."""
    spy_dir = tmp_path / "spy"
    spy_dir.mkdir(exist_ok=True)
    ran = tmp_path / "ninja-ran"
    ninja = spy_dir / "ninja"
    ninja.write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\nexit 1\n")
    ninja.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{spy_dir}:{path}", **env}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env=full_env, timeout=300, check=True)
    assert not ran.exists(), f"ninja ran: {ran.read_text()}"
    return out.stdout.strip(), out.stderr


def test_the_module_compiled_at_install_loads_under_either_path_order(tmp_path):
    _prebuilt_so()
    for name, path in [*PATH_ORDERS.items(), *PATH_ORDERS.items()]:  # alternate twice
        stdout, stderr = _probe(tmp_path, path)
        assert stdout.split()[:2] == ["prebuilt", "0.0"], (name, stdout, stderr)
        assert "compiling" not in stderr, (name, stderr)


def test_a_finished_jit_build_is_reused_under_either_path_order(tmp_path, monkeypatch):
    so = _prebuilt_so()
    monkeypatch.setenv("HICACHE_BUILD_DIR", str(tmp_path / "build"))
    build_dir = jit.build_directory()
    build_dir.mkdir(parents=True)
    # What a finished JIT build leaves: the module (the same sources and torch as the
    # installed one, so the installed binary stands in for it) and the marker.
    shutil.copy(so, build_dir / f"{jit._MODULE}.so")
    (build_dir / jit._BUILT_MARKER).write_text(f"{jit._MODULE}.so\n")
    for name, path in [*PATH_ORDERS.items(), *PATH_ORDERS.items()]:
        stdout, stderr = _probe(tmp_path, path, HICACHE_NATIVE="jit",
                                HICACHE_BUILD_DIR=str(tmp_path / "build"))
        assert stdout.split()[:2] == ["jit-cache", "0.0"], (name, stdout, stderr)
        assert "compiling" not in stderr, (name, stderr)


def test_a_stale_installed_module_is_not_imported(tmp_path, monkeypatch):
    info = dict(jit.build_info(), sources="0" * 16)
    (tmp_path / jit.BUILD_INFO_NAME).write_text(json.dumps(info))
    monkeypatch.setattr(jit, "_PACKAGE", tmp_path)
    result = jit._load_prebuilt()
    assert result.module is None
    assert "stale" in result.reason and "sources: built for '0000000000000000'" in result.reason


def test_an_unknown_native_mode_is_reported(monkeypatch):
    monkeypatch.setenv("HICACHE_NATIVE", "sometimes")
    result = jit._load.__wrapped__()
    assert result.module is None
    assert result.reason == (
        "HICACHE_NATIVE: expected 'auto', 'prebuilt', 'jit' or 'sanitize', got 'sometimes'"
    )


def test_each_checkout_gets_its_own_build_directory(tmp_path, monkeypatch):
    here = jit.source_digest()
    copy = tmp_path / "csrc"
    shutil.copytree(jit._CSRC, copy)
    monkeypatch.setattr(jit, "_CSRC", copy)
    assert jit.source_digest() != here  # same sources elsewhere: another module
    assert jit.content_digest() == jit.content_digest(jit._CSRC)  # same contents


def test_a_jit_build_announces_itself_and_clears_a_stale_lock(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HICACHE_BUILD_DIR", str(tmp_path))
    build_dir = jit.build_directory()
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what an interrupted cpp_extension build leaves
    seen = {}
    module = types.ModuleType("fake")
    module.__file__ = str(build_dir / "_native.so")

    def fake_load(**kwargs):
        seen["lock_present"] = (build_dir / "lock").exists()
        seen["build_directory"] = kwargs["build_directory"]
        Path(module.__file__).write_bytes(b"")
        return module

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(jit, "_import_file", lambda path: module)
    result = jit._jit_build(build_dir)
    if result.module is None and "ninja not found" in result.reason:
        pytest.skip(result.reason)
    assert result.module is module, result.reason
    assert result.origin == "jit-build"
    assert seen == {"lock_present": False, "build_directory": str(build_dir)}
    err = capsys.readouterr().err
    assert "hicache: compiling the native extension" in err
    assert "hicache: native extension built in " in err
    # The next process finds the marker and imports without building.
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("rebuilt"))
    again = jit._jit_build(build_dir)
    assert again.module is module and again.origin == "jit-cache"
    assert "compiling" not in capsys.readouterr().err


def test_the_build_lock_is_released_when_its_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from pathlib import Path\n"
         "from hicache.native.build import _build_lock\n"
         "with _build_lock(Path(sys.argv[1])):\n"
         "    print('held', flush=True)\n"
         "    time.sleep(120)\n",
         str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "hicache.flock", "a") as f:
            with pytest.raises(BlockingIOError):  # held: another build waits
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait(timeout=30)
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel
    finally:
        if holder.poll() is None:
            holder.kill()


def test_native_status_says_where_the_module_came_from(tmp_path, monkeypatch):
    module = types.ModuleType("fake")
    (tmp_path / jit.BUILD_INFO_NAME).write_text(json.dumps({**jit.build_info(),
                                                            "build_seconds": 63.2}))
    monkeypatch.setattr(jit, "_PACKAGE", tmp_path)
    cases = [
        (jit._LoadResult(module, "", 0.0, "prebuilt"), "compiled at install (63.2 s)"),
        (jit._LoadResult(module, "", 71.04, "jit-build"), "compiled now (71.0 s)"),
        (jit._LoadResult(module, "", 0.0, "jit-cache"), "loaded from an earlier JIT build"),
        (jit._LoadResult(None, "ninja not found (pip install ninja)", 0.0),
         "unavailable, Python fallbacks in use (ninja not found (pip install ninja))"),
    ]
    for result, expected in cases:
        monkeypatch.setattr(jit, "_load", lambda result=result: result)
        assert jit.native_status() == expected


@pytest.mark.slow
def test_a_wheel_install_ships_the_compiled_module(tmp_path):
    """pip install . (not editable) puts the module and its build info into the package.

    Without build isolation, so that the build uses this environment's torch
    instead of downloading one (an isolated build asks for the same version, see
    buildtools/backend.py). Compiles the extension: minutes.
    """
    root = Path(__file__).resolve().parents[2]
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(root)],
        check=True, timeout=1800, cwd=tmp_path,
    )
    assert sorted(p.name for p in (target / "hicache" / "native").glob("_native*"))[-1] == (
        jit.BUILD_INFO_NAME)
    assert list((target / "hicache" / "native").glob(f"{jit._MODULE}.*.so"))
    assert list((target / "hicache" / "memory").glob("_copier.*.so"))  # the C copier too
    probe = ("import hicache; print(hicache.__file__)\n" + _PROBE
             + "from hicache.memory import copier; print(copier.load_copier().origin)\n")
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)}, check=True,
    )
    where, status = out.stdout.splitlines()[:2]
    assert where == str(target / "hicache" / "__init__.py"), out.stdout
    assert status.split()[:2] == ["prebuilt", "0.0"], (out.stdout, out.stderr)
    assert out.stdout.splitlines()[2] == "installed", out.stdout


def test_a_jit_build_prunes_stale_build_directories_but_not_its_own(tmp_path, monkeypatch):
    """After a JIT build, build directories of other digests unused for
    buildcache.MAX_AGE_DAYS go; the new one, the sanitized one of these sources, a
    recent one and one a live process holds stay."""
    from hicache import buildcache

    monkeypatch.setenv("HICACHE_BUILD_DIR", str(tmp_path))
    build_dir = jit.build_directory()
    old_stamp = time.time() - 40 * 86400
    kept = [jit.build_directory(sanitize=True).name, "native-recent", "native-held"]
    for name in ["native-0123456789abcdef", "native-asan-0123456789abcdef", *kept]:
        (tmp_path / name).mkdir()
        (tmp_path / name / buildcache.DIR_LOCK_NAME).write_bytes(b"")
        if name != "native-recent":
            for f in [tmp_path / name / buildcache.DIR_LOCK_NAME, tmp_path / name]:
                os.utime(f, (old_stamp, old_stamp))
    buildcache.hold(tmp_path / "native-held" / buildcache.DIR_LOCK_NAME)
    os.utime(tmp_path / "native-held" / buildcache.DIR_LOCK_NAME, (old_stamp, old_stamp))
    module = types.ModuleType("fake")
    module.__file__ = str(build_dir / "_native.so")

    def fake_compile(directory, sanitize):
        Path(module.__file__).write_bytes(b"")
        (directory / jit._BUILT_MARKER).write_text("_native.so\n")
        return module, 1.0

    monkeypatch.setattr(jit, "_compile", fake_compile)
    monkeypatch.setattr(jit, "_import_file", lambda path: module)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    result = jit._jit_build(build_dir)
    assert result.module is module and result.origin == "jit-build", result.reason
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([build_dir.name, *kept])
