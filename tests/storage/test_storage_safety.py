"""The file tier stays inside its directory, sweeps dead writers' temp files, and is
private on disk by default (issue 31 items 8-9, issue 30 "safe defaults on disk")."""

from __future__ import annotations

import logging
import os
import select
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hicache.config import KVConfig
from hicache.storage import (
    VALUE_HEADER_NBYTES,
    FileStorage,
    make_storage,
    model_identity,
    page_keys,
)
from hicache.storage.filelayout import MARKER_NAME, owner_tag

FP = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4).fingerprint()
MID = model_identity("test-model", revision="r1")
PAGE = 64
VALUE = VALUE_HEADER_NBYTES + PAGE
REPO = Path(__file__).resolve().parents[2]


def keys_for(num_pages: int, namespace: str = "t") -> list[str]:
    return page_keys(np.arange(4 * num_pages), 4, namespace, FP, MID)


def pages(num: int, fill: int = 7) -> list[bytes]:
    return [bytes([fill + i]) * PAGE for i in range(num)]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def make_decoy(tmp_path: Path, key: str) -> Path:
    """A directory that is not the store's: an old dot-file, ordinary files, and files
    named exactly like a value and a dead writer's temp file of the store."""
    decoy = tmp_path / "home"
    decoy.mkdir()
    (decoy / ".netrc").write_bytes(b"machine example login me password secret\n")
    (decoy / "notes.txt").write_bytes(b"mine")
    (decoy / key).write_bytes(b"x" * VALUE)
    (decoy / f".{key}.1.2.3.tmp").write_bytes(b"partial")
    for p in decoy.iterdir():
        os.utime(p, (0, 0))  # old enough to look like a stale temp file
    return decoy


# ---- item 8: only its own entries, never through a symlink ---------------------------


def test_file_never_deletes_or_writes_through_a_symlinked_subdirectory(tmp_path):
    root = tmp_path / "store"
    keys = keys_for(40)
    store = FileStorage(root, page_nbytes=PAGE, capacity_nbytes=4 * VALUE, low_watermark=0.5)
    victim = keys[5]
    decoy = make_decoy(tmp_path, victim)
    before = snapshot(decoy)
    os.symlink(decoy, root / victim[:2])  # planted after the store was opened ...
    reopened = FileStorage(root, page_nbytes=PAGE, capacity_nbytes=4 * VALUE, low_watermark=0.5)
    assert snapshot(decoy) == before  # ... and before a process opened it: nothing swept
    for s in (store, reopened):
        assert s.exists([victim]) == 0 and s.get([victim]) == []  # the decoy's file is no value
        stored = s.set(keys, pages(len(keys)))
        assert stored == 5  # stops at the page it cannot store; nothing written there
        for i in range(0, 40, 3):  # over the cap many times: clean-up scans run
            s.set(keys[i:i + 1], pages(1))
        assert s.counters().num_evicted_pages > 0
        s.clear()
    assert snapshot(decoy) == before
    assert (root / victim[:2]).is_symlink()  # not ours: left in place


def test_file_refuses_a_root_it_does_not_recognise_unless_adopting(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    key = keys_for(1)[0]
    decoy = make_decoy(tmp_path, key)
    before = snapshot(decoy)
    os.symlink(decoy, root / key[:2])
    with pytest.raises(ValueError, match=r"did not create \(.. \(a symlink\)\).*adopt=True"):
        FileStorage(root, page_nbytes=PAGE)
    assert not (root / MARKER_NAME).exists()
    store = make_storage(f"file:{root}", page_nbytes=PAGE, adopt=True)
    assert (root / MARKER_NAME).is_file()
    assert store.set([key], pages(1)) == 0 and store.clear() == 0
    assert snapshot(decoy) == before
    FileStorage(root, page_nbytes=PAGE)  # marked: opens without adopt from now on

    other = tmp_path / "photos"
    other.mkdir(mode=0o700)
    (other / "cat.jpg").write_bytes(b"jpg")
    with pytest.raises(ValueError, match=r"did not create \(cat.jpg\)"):
        FileStorage(other, page_nbytes=PAGE)


def test_file_store_of_an_earlier_version_is_recognised_by_its_names(tmp_path):
    keys = keys_for(2)
    (tmp_path / keys[0][:2]).mkdir(mode=0o700)
    (tmp_path / keys[0][:2] / keys[0]).write_bytes(b"x" * VALUE)
    store = FileStorage(tmp_path, page_nbytes=PAGE)  # only its own names: no adopt needed
    assert (tmp_path / MARKER_NAME).is_file()
    assert store.get(keys[:1]) == []  # an old value fails verification: a miss, removed
    assert store.counters().num_corrupt_values == 1


def test_file_clear_keeps_what_it_did_not_create(tmp_path):
    store = FileStorage(tmp_path, page_nbytes=PAGE)
    keys = keys_for(6)
    assert store.set(keys, pages(6)) == 6
    plain = tmp_path / "zz"  # a plain non-hex directory inside the store (two characters)
    plain.mkdir()
    (plain / "a.txt").write_bytes(b"a")
    (plain / keys[0]).write_bytes(b"k")  # named like a key, but not where values live
    odd = tmp_path / keys[1][:2] / "README"  # an odd name inside a hex subdirectory
    odd.write_bytes(b"r")
    dotted = tmp_path / keys[2][:2] / ".profile"
    dotted.write_bytes(b"p")
    os.utime(dotted, (0, 0))
    assert store.clear() == 6
    assert FileStorage(tmp_path, page_nbytes=PAGE).clear() == 0
    assert snapshot(plain) == {"a.txt": b"a", keys[0]: b"k"}
    assert odd.read_bytes() == b"r" and dotted.read_bytes() == b"p"


def test_file_symlink_in_place_of_a_value_is_a_miss_and_its_target_survives(tmp_path):
    store = FileStorage(tmp_path / "store", page_nbytes=PAGE)
    keys = keys_for(2)
    assert store.set(keys, pages(2)) == 2
    target = tmp_path / "target"
    target.write_bytes(b"x" * VALUE)
    link = store.root / keys[1][:2] / keys[1]
    link.unlink()
    link.symlink_to(target)
    assert store.exists(keys) == 1
    assert store.get(keys) == pages(1)
    assert store.counters().num_corrupt_values == 1
    assert not link.is_symlink() and target.read_bytes() == b"x" * VALUE
    assert store.set(keys, pages(2)) == 2 and store.get(keys) == pages(2)


# ---- item 9: temp files of dead writers ---------------------------------------------

_WRITER = textwrap.dedent("""
    import os, sys, time
    from hicache.storage import FileStorage
    real = os.writev
    def stall(fd, parts):  # write a little, then hang as if killed mid-write
        real(fd, [parts[0], memoryview(parts[1])[:1000]])
        print("writing", flush=True)
        time.sleep(600)
    os.writev = stall
    FileStorage(sys.argv[1], page_nbytes=int(sys.argv[2])).set([sys.argv[3]], [bytes(int(sys.argv[2]))])
""")


def test_file_temp_of_a_killed_writer_is_counted_then_swept(tmp_path):
    page_nbytes = 1 << 20
    key = keys_for(1)[0]
    FileStorage(tmp_path, page_nbytes=page_nbytes)  # marks the root
    env = dict(os.environ, PYTHONPATH=str(REPO))
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), str(page_nbytes), key],
        stdout=subprocess.PIPE, env=env,
    )
    try:
        ready, _, _ = select.select([writer.stdout], [], [], 120)
        assert ready, "the writer never started writing"
        assert writer.stdout.readline() == b"writing\n"
        temps = list((tmp_path / key[:2]).glob(".*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size == VALUE_HEADER_NBYTES + 1000
        live = FileStorage(tmp_path, page_nbytes=page_nbytes, capacity_nbytes=10 * page_nbytes)
        assert temps[0].exists()  # its writer is alive: not swept ...
        assert live.tracked_nbytes == VALUE_HEADER_NBYTES + 1000  # ... and counted toward the cap
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert temps[0].exists()
    assert live.clear() == 0  # its writer is gone: the next scan sweeps it
    assert not temps[0].exists() and live.tracked_nbytes == 0


def test_file_planted_temp_files_follow_the_owner_and_age_rules(tmp_path):
    key = keys_for(1)[0]
    sub = tmp_path / key[:2]
    sub.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        tag = owner_tag()
        dead_temp = sub / f".{key}.{tag}.{dead.pid}.1.0.tmp"
        live_temp = sub / f".{key}.{tag}.{alive.pid}.1.0.tmp"
        remote_temp = sub / f".{key}.{'0' * 16}.{dead.pid}.1.0.tmp"  # another machine's
        old_remote = sub / f".{key}.{'0' * 16}.{alive.pid}.1.1.tmp"
        for p in (dead_temp, live_temp, remote_temp, old_remote):
            p.write_bytes(b"t" * 100)
        os.utime(old_remote, (time.time() - 3600, time.time() - 3600))
        store = FileStorage(tmp_path, page_nbytes=PAGE)
        assert not dead_temp.exists() and not old_remote.exists()
        assert live_temp.exists() and remote_temp.exists()
        assert store.tracked_nbytes == 200
    finally:
        alive.kill()
        alive.wait()


# ---- safe defaults on disk ------------------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_file_creates_a_private_directory_and_private_files(tmp_path):
    root = tmp_path / "new" / "store"
    store = FileStorage(root, page_nbytes=PAGE)
    keys = keys_for(2)
    assert store.set(keys, pages(2)) == 2
    assert mode_of(root) == 0o700
    assert {mode_of(root / k[:2]) for k in keys} == {0o700}
    assert {mode_of(root / k[:2] / k) for k in keys} == {0o600}
    assert mode_of(root / MARKER_NAME) == 0o600


@pytest.mark.parametrize("mode, who", [(0o777, "group and others"), (0o757, "others"),
                                        (0o775, "group"), (0o1777, "group and others")])
def test_file_refuses_a_directory_other_users_can_write(tmp_path, mode, who):
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(ValueError, match=f"writable by {who}.*shared=True") as err:
        FileStorage(root, page_nbytes=PAGE)
    assert str(err.value).count("\n") == 0  # one error, one line
    assert list(root.iterdir()) == []  # refused before anything was written


def test_file_refuses_a_directory_another_user_owns_and_an_open_subdirectory(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, -1)
    with pytest.raises(ValueError, match="owned by uid 12345"):
        FileStorage(root, page_nbytes=PAGE)
    os.chown(root, os.geteuid(), -1)
    store = FileStorage(root, page_nbytes=PAGE)
    key = keys_for(1)[0]
    assert store.set([key], pages(1)) == 1
    (root / key[:2]).chmod(0o777)
    with pytest.raises(ValueError, match=f"refusing {root}/{key[:2]}: it is writable"):
        FileStorage(root, page_nbytes=PAGE)


def test_file_shared_store_opens_and_warns_without_a_secret(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("HICACHE_STORAGE_SECRET", raising=False)
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="hicache.storage.file"):
        store = make_storage(f"file:{root}", page_nbytes=PAGE, shared=True)
    assert "without a storage secret" in caplog.text
    assert store.set(keys_for(1), pages(1)) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicache.storage.file"):
        make_storage(f"file:{root}", page_nbytes=PAGE, shared=True, secret="s" * 32)
    assert caplog.text == ""
    with pytest.raises(TypeError, match="shared: expected bool"):
        FileStorage(root, page_nbytes=PAGE, shared="yes")
