"""The JIT loader: per-checkout build directories, and no hang after an interrupted build."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import types

import pytest

from hicache import jit


def test_each_checkout_gets_its_own_build_directory(tmp_path, monkeypatch):
    here = jit.source_digest()
    copy = tmp_path / "csrc"
    shutil.copytree(jit._CSRC, copy)
    monkeypatch.setattr(jit, "_CSRC", copy)
    assert jit.source_digest() != here  # same sources elsewhere: another module


def test_a_lock_file_left_by_a_killed_build_is_cleared(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_BUILD_DIR", str(tmp_path))
    build_dir = jit.build_directory()
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what an interrupted cpp_extension build leaves
    seen = {}
    module = types.ModuleType("fake")

    def fake_load(**kwargs):
        seen["lock_present"] = (build_dir / "lock").exists()
        seen["build_directory"] = kwargs["build_directory"]
        return module

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    result = jit._load.__wrapped__()
    if shutil.which("ninja") is None and result.module is None:
        pytest.skip(result.reason)
    assert result.module is module, result.reason
    assert seen == {"lock_present": False, "build_directory": str(build_dir)}


def test_the_build_lock_is_released_when_its_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from pathlib import Path\n"
         "from hicache.jit import _build_lock\n"
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
