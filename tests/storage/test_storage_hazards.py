"""File storage against a hostile directory: FIFOs and directories in a page's place,
a read-only store, backend exceptions of any type.

Every call that could block on a FIFO runs under :func:`bounded`: a regression fails
after a few seconds (the FIFO is then opened for writing, which releases the blocked
reader) instead of hanging the suite.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from kv_layouts import KV
from leak_checks import assert_quiescent
from serving import read_prefix, serve, serve_kv

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.storage import (
    VALUE_HEADER_NBYTES,
    FileStorage,
    StorageError,
    model_identity,
    page_keys,
)
from hicache.tree import token_key

BOUND_S = 5.0
MID = model_identity("hazards", revision="r1")
FP = KV.fingerprint()
A = [1, 1, 2, 2, 3, 3, 4, 4]  # 4 pages of 2 tokens


def release_fifo(path: Path) -> None:
    """Unblock a reader stuck opening the FIFO at ``path`` (it then reads EOF)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only while a reader waits
    except OSError:
        return
    os.close(fd)


def bounded(fn: Callable[[], object], what: str, fifos: tuple[Path, ...] = ()) -> object:
    """``fn()``, or a test failure if it does not return within ``BOUND_S`` seconds."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        for _ in range(100):  # a reader may open the FIFO again: keep releasing a while
            for fifo in fifos:
                release_fifo(fifo)
            thread.join(0.1)
            if not thread.is_alive():
                break
        pytest.fail(f"{what} did not return within {BOUND_S} s (blocked on a FIFO)")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


def make_pages(num_pages: int, page_nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (num_pages, page_nbytes), dtype=torch.uint8, generator=gen)


def stored(tmp_path: Path, num_pages: int = 3, page_nbytes: int = 256):
    store = FileStorage(tmp_path, page_nbytes=page_nbytes)
    keys = page_keys(np.arange(4 * num_pages), 4, "t", FP, MID)
    pages = make_pages(num_pages, page_nbytes)
    assert store.set(keys, list(pages)) == num_pages
    return store, keys, pages


def path_of(store: FileStorage, key: str) -> Path:
    return store.root / key[:2] / key


# ---- the backend -------------------------------------------------------------------


def test_file_fifo_in_place_of_a_page_is_a_miss_never_a_hang(tmp_path):
    store, keys, pages = stored(tmp_path)
    fifo = path_of(store, keys[1])
    fifo.unlink()
    os.mkfifo(fifo)
    out = torch.zeros_like(pages)
    assert store.exists(keys) == 1  # a FIFO holds no page
    assert bounded(lambda: store.get_into(keys, list(out)), "get_into", (fifo,)) == 1
    assert torch.equal(out[0], pages[0])
    c = store.counters()
    assert (c.num_hit_pages, c.num_corrupt_values, c.num_errors) == (1, 1, 0)
    assert not fifo.exists()  # removed like any damaged value
    os.mkfifo(fifo)
    # A backup replaces a FIFO with the page (before: "already stored", never readable).
    assert bounded(lambda: store.set(keys, list(pages)), "set", (fifo,)) == 3
    assert store.get_into(keys, list(out)) == 3 and torch.equal(out, pages)
    assert store.counters().written_nbytes == 4 * 256  # 3 first, then page 1 again


def test_file_directory_in_place_of_a_page_is_a_clean_miss(tmp_path):
    store, keys, pages = stored(tmp_path)
    directory = path_of(store, keys[1])
    directory.unlink()
    directory.mkdir()
    (directory / "someone-elses-file").write_bytes(b"x")
    out = torch.zeros_like(pages)
    assert store.exists(keys) == 1
    # Before: removing the "corrupt value" raised, and the whole read failed with it.
    assert store.get_into(keys, list(out)) == 1
    assert torch.equal(out[0], pages[0])  # the preceding page is not lost
    c = store.counters()
    assert (c.num_hit_pages, c.num_corrupt_values, c.num_errors) == (1, 1, 0)
    assert (directory / "someone-elses-file").exists()  # not ours: left alone
    # A backup stores the pages before it and reports where it stopped; no error.
    assert store.set(keys, list(pages)) == 1
    assert store.counters().num_errors == 0


def test_file_capacity_clean_up_skips_what_is_not_a_value(tmp_path):
    page_nbytes = 256
    value_nbytes = VALUE_HEADER_NBYTES + page_nbytes
    store = FileStorage(tmp_path, page_nbytes=page_nbytes, capacity_nbytes=2 * value_nbytes)
    keys = page_keys(np.arange(16), 4, "t", FP, MID)
    pages = make_pages(4, page_nbytes)
    odd = tmp_path / keys[3][:2] / "zz-not-a-value"
    odd.parent.mkdir(exist_ok=True)
    odd.mkdir()
    fifo = tmp_path / keys[3][:2] / "zz-fifo"
    os.mkfifo(fifo)
    for i in range(4):  # over the cap: the clean-up scans the directory
        assert bounded(lambda i=i: store.set([keys[i]], [pages[i]]), "set", (fifo,)) == 1
    assert odd.is_dir() and fifo.exists()
    assert store.counters().num_errors == 0
    assert store.counters().num_evicted_pages >= 2


class _ReadOnly:
    """Every call FileStorage makes that would change the directory fails like a
    read-only mount (EROFS). Tests run as root, where permissions stop nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
        real_open = os.open

        def refuse(name: str) -> Callable[..., object]:
            def fail(*args: object, **kwargs: object) -> object:
                self.calls[name] = self.calls.get(name, 0) + 1
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]))

            return fail

        def open_(path, flags, *args, **kwargs):
            if flags & write_flags:
                return refuse("open")(path)
            return real_open(path, flags, *args, **kwargs)

        for name in ("utime", "unlink", "replace", "rename", "mkdir", "rmdir"):
            monkeypatch.setattr(os, name, refuse(name))
        monkeypatch.setattr(os, "open", open_)


def test_file_reads_work_on_a_read_only_store(tmp_path, monkeypatch):
    store, keys, pages = stored(tmp_path)
    reader = FileStorage(tmp_path, page_nbytes=256)
    ro = _ReadOnly(monkeypatch)
    out = torch.zeros_like(pages)
    # Before: the recency stamp's EROFS escaped as a raw OSError, failing every read.
    assert reader.get_into(keys, list(out)) == 3 and torch.equal(out, pages)
    assert ro.calls.get("utime", 0) == 3  # stamping was tried, and failed quietly
    assert reader.counters().num_errors == 0
    with pytest.raises(StorageError, match="Read-only"):
        reader.set(page_keys(np.arange(4), 4, "other", FP, MID), [pages[0]])
    assert reader.counters().num_errors == 1


def test_file_corrupt_value_on_a_read_only_store_keeps_the_leading_pages(tmp_path, monkeypatch):
    store, keys, pages = stored(tmp_path)
    path = path_of(store, keys[1])
    data = bytearray(path.read_bytes())
    data[40] ^= 1
    path.write_bytes(bytes(data))
    _ReadOnly(monkeypatch)
    out = torch.zeros_like(pages)
    # Before: the failed removal raised, and page 0 was lost with it.
    assert store.get_into(keys, list(out)) == 1 and torch.equal(out[0], pages[0])
    c = store.counters()
    assert (c.num_corrupt_values, c.num_errors) == (1, 1)  # the failed removal is counted


def test_any_backend_exception_is_a_counted_storage_error(tmp_path):
    class Broken(FileStorage):
        def _exists(self, keys):
            raise KeyError("a client library's own error")

        def _get_into(self, keys, views):
            raise RuntimeError("transport failed")

    store = Broken(tmp_path, page_nbytes=64)
    keys = page_keys(np.arange(4), 4, None, FP, MID)
    with pytest.raises(StorageError, match="KeyError"):
        store.exists(keys)
    with pytest.raises(StorageError, match="transport failed") as info:
        store.get_into(keys, [bytearray(64)])
    assert isinstance(info.value.__cause__, RuntimeError)
    assert store.counters().num_errors == 2


# ---- through HiCache ---------------------------------------------------------------


def make(tmp_path: Path, **kw) -> HiCache:
    cfg = dict(device_tokens=8, host_tokens=16, storage=f"file:{tmp_path}", executor="thread",
               model_id=MID)
    cfg.update(kw)
    return HiCache(CacheConfig(KV, **cfg))


def store_a(tmp_path: Path) -> list[Path]:
    """A first cache computes A and stores it; returns the paths of its 4 page files."""
    with make(tmp_path) as first:
        serve_kv(first, A)
        keys = first._third_tier.page_keys(token_key(A, KV.page_size), None)
    assert len(keys) == 4
    return [tmp_path / k[:2] / k for k in keys]


def test_fifo_page_file_is_a_miss_under_wait_complete(tmp_path):
    paths = store_a(tmp_path)
    paths[2].unlink()
    os.mkfifo(paths[2])
    cache = make(tmp_path, prefetch_policy="wait_complete")
    h = bounded(lambda: cache.match(A + [5, 5]), "match", (paths[2],))
    assert (h.device_len, h.host_len) == (0, 4)  # pages 0 and 1; the FIFO is a miss
    read_prefix(cache, h, A)
    cache.release(h)
    s = cache.stats()
    assert (s["storage_hit_tokens"], s["storage_errors"]) == (4, 0)
    # exists() already stops at the FIFO, so the read never opens it (get_into's own
    # guard is tested on the backend above).
    assert cache.storage.backend.counters().num_get_pages == 2
    assert_quiescent(cache)
    bounded(cache.close, "close", (paths[2],))


@pytest.mark.parametrize("finish", ["wait_all", "close"])
def test_fifo_page_file_never_blocks_wait_all_or_close_under_best_effort(tmp_path, finish):
    paths = store_a(tmp_path)
    paths[1].unlink()
    os.mkfifo(paths[1])
    cache = make(tmp_path, prefetch_policy="best_effort")
    job = cache.prefetch(A)
    assert job is not None
    if finish == "wait_all":
        bounded(cache.wait_all, "wait_all", (paths[1],))
        s = cache.stats()
        assert (s["storage_hit_tokens"], s["host_cached_tokens"], s["storage_errors"]) == (2, 2, 0)
        assert_quiescent(cache)
    bounded(cache.close, "close", (paths[1],))
    assert job.done.is_set() and job.num_done == 1


def test_directory_page_file_is_a_clean_miss_keeping_the_preceding_page(tmp_path):
    paths = store_a(tmp_path)
    paths[2].unlink()
    paths[2].mkdir()
    cache = make(tmp_path, prefetch_policy="wait_complete")
    h = cache.match(A + [5, 5])
    # Before: the read job failed as a whole (storage_errors 1) and pages 0-1 were lost.
    assert (h.device_len, h.host_len) == (0, 4)
    read_prefix(cache, h, A)
    cache.release(h)
    s = cache.stats()
    assert (s["storage_hit_tokens"], s["storage_errors"]) == (4, 0)
    assert_quiescent(cache)
    cache.close()


def test_read_only_store_serves_every_intact_page(tmp_path, monkeypatch):
    store_a(tmp_path)
    cache = make(tmp_path, prefetch_policy="wait_complete")
    ro = _ReadOnly(monkeypatch)
    h = cache.match(A)
    assert (h.device_len, h.host_len) == (0, 8)  # before: 0 hits, every prefetch failed
    read_prefix(cache, h, A)
    cache.release(h)
    assert cache.stats()["storage_hit_tokens"] == 8 and ro.calls.get("utime", 0) == 4
    # Writing new pages to it fails: counted by the cache and the backend, serving goes on.
    serve_kv(cache, [9, 9, 8, 8])
    cache.wait_all()
    s = cache.stats()
    assert (s["storage_errors"], s["storage_write_bytes"]) == (1, 0)
    assert cache.storage.backend.counters().num_errors == 1
    assert_quiescent(cache)
    cache.close()


# A cache in a private mount namespace where the store is a read-only bind mount:
# the kernel refuses every write (EROFS), as on a read-only volume.
READ_ONLY_WORKER = r"""
import json, sys
sys.path[:0] = sys.argv[2:]
from kv_layouts import KV
from serving import read_prefix, serve_kv
from test_storage_hazards import A, make
from pathlib import Path
cache = make(Path(sys.argv[1]), prefetch_policy="wait_complete")
h = cache.match(A)
lens = [h.device_len, h.host_len]
read_prefix(cache, h, A)
cache.release(h)
serve_kv(cache, [9, 9, 8, 8])
cache.wait_all()
cache.check_integrity()
s = cache.stats()
c = cache.storage.backend.counters()
cache.close()
print(json.dumps({"lens": lens, "hits": s["storage_hit_tokens"], "errors": s["storage_errors"],
                  "backend_errors": c.num_errors}))
"""


def _can_mount_read_only(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount --bind {probe} {probe} && mount -o remount,ro,bind {probe} {probe}"],
        capture_output=True,
    )
    return proc.returncode == 0


def test_read_only_bind_mount_serves_every_intact_page(tmp_path):
    if not _can_mount_read_only(tmp_path):
        pytest.skip("needs unshare -m and mount (a private mount namespace)")
    root = tmp_path / "store"
    store_a(root)
    here = Path(__file__).parent  # test_storage_hazards and, above it, the shared modules
    script = (f"mount --bind {root} {root} && mount -o remount,ro,bind {root} {root} && "
              f'exec "$0" -c "$1" {root} {here.parent} {here}')
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, READ_ONLY_WORKER],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"lens": [0, 8], "hits": 8, "errors": 1, "backend_errors": 1}


# A full hit only matches (no alloc, no insert): repeating a request repeats its match alone.
serve_skipping_hits = partial(serve, skip_cached=True)


def test_storage_worker_survives_an_unexpected_backend_exception(tmp_path):
    cfg = dict(device_tokens=8, host_tokens=32, tree="python", storage=f"file:{tmp_path}",
               model_id="test-model")
    first = HiCache(CacheConfig(KV, executor="immediate", **cfg))
    serve_skipping_hits(first, [1, 2])
    first.close()
    cache = HiCache(CacheConfig(KV, executor="immediate", **cfg))

    def broken(keys, views):
        raise RuntimeError("transport error")

    cache.storage.backend.get_into = broken
    job = cache.prefetch([1, 2])
    assert job.done.wait(5), "the failed read never finished"
    cache.poll()
    s = cache.stats()
    assert s["storage_errors"] == 1 and s["host_pages_used"] == 0
    assert all(t.is_alive() for t in cache.storage._threads)
    cache.check_integrity()
    cache.close()
