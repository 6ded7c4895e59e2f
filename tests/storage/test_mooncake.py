"""Mooncake Store backend against a real ``mooncake_master`` on loopback.

Skipped when the optional extra is not installed, unless HICACHE_REQUIRE_MOONCAKE=1
(CI sets it after .ci/install_mooncake.sh), in which case a missing package fails.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from optional import need

from hicache.storage import VALUE_HEADER_NBYTES, StorageError, make_storage, page_keys

need("mooncake")

from mooncake.store import MooncakeDistributedStore  # noqa: E402

from hicache.storage.mooncake import MooncakeStorage  # noqa: E402
from hicache.testing.mooncake_master import start_mooncake_master  # noqa: E402

PAGE_NBYTES = 16 * 1024
FP = "L2-H2-D8-float16-P4"
MID = "test-model"


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    handle = start_mooncake_master(
        segment_nbytes=64 << 20, log_dir=tmp_path_factory.mktemp("mooncake")
    )
    yield handle
    handle.stop()


def client(master, **options) -> MooncakeStorage:
    options.setdefault("segment_nbytes", 0)  # pages live in the master's segment holder
    store = make_storage(master.spec, page_nbytes=PAGE_NBYTES, **options)
    assert isinstance(store, MooncakeStorage)
    return store


def raw_client(master) -> MooncakeDistributedStore:
    raw = MooncakeDistributedStore()
    rc = raw.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.master_address)
    assert rc == 0
    return raw


def make_pages(num_pages: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages, PAGE_NBYTES), dtype=torch.uint8, generator=gen)


def test_mooncake_round_trip_between_clients(master):
    keys = page_keys(np.arange(40), 4, "round-trip", FP, MID)
    pages = make_pages(len(keys), seed=1)
    writer = client(master)
    writer.register_memory(pages)
    assert writer.set(keys, list(pages)) == len(keys)
    assert writer.set(keys[:3], list(pages[:3])) == 3  # already present: still stored
    writer.close()
    reader = client(master)  # a fresh client sees pages the closed one wrote
    host = torch.zeros_like(pages)  # the "host pool": pages land in it directly
    reader.register_memory(host)
    assert reader.get_into(keys, list(host)) == len(keys)
    assert torch.equal(host, pages)
    c = reader.counters()
    assert (c.num_hit_pages, c.read_nbytes, c.num_errors) == (10, 10 * PAGE_NBYTES, 0)
    assert reader.delete(keys) == len(keys)
    assert reader.get_into(keys, list(host)) == 0
    reader.close()


def test_mooncake_exists_counts_leading_keys(master):
    store = client(master)
    keys = page_keys(np.arange(32), 4, "exists", FP, MID)
    pages = make_pages(len(keys), seed=2)
    assert store.exists(keys) == 0
    assert store.set(keys[:3] + keys[4:], list(pages[:3]) + list(pages[4:])) == 7
    assert store.exists(keys) == 3  # key 3 is missing: nothing past it counts
    assert store.exists(keys[4:]) == 4
    out = torch.zeros_like(pages)
    assert store.get_into(keys, list(out)) == 3
    assert torch.equal(out[:3], pages[:3])
    store.delete(keys)
    store.close()


@pytest.mark.parametrize("damage", ["same_length", "truncated", "other_key"])
def test_mooncake_checksum_detects_corruption(master, damage):
    store = client(master)
    keys = page_keys(np.arange(12), 4, f"corrupt-{damage}", FP, MID)
    pages = make_pages(3, seed=3)
    assert store.set(keys, list(pages)) == 3
    raw = raw_client(master)
    if damage == "same_length":
        bad = bytearray(raw.get(keys[1]))
        bad[VALUE_HEADER_NBYTES + 7] ^= 0xFF
    elif damage == "truncated":
        bad = bytearray(raw.get(keys[1]))[: VALUE_HEADER_NBYTES + 100]
    else:
        bad = bytearray(raw.get(keys[2]))  # intact, but another key's value
    assert raw.upsert(keys[1], bytes(bad)) == 0
    out = torch.zeros_like(pages)
    assert store.get_into(keys, list(out)) == 1
    assert torch.equal(out[0], pages[0])
    assert store.counters().num_corrupt_values == 1
    assert store.exists(keys) == 1  # the bad value was removed
    raw.close()
    store.delete(keys)
    store.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mooncake_unreachable_master_is_a_storage_error():
    port = _closed_port()
    spec = f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/metadata"
    start = time.monotonic()
    with pytest.raises(StorageError, match="unreachable"):
        make_storage(spec, page_nbytes=PAGE_NBYTES, connect_timeout_s=1.0)
    assert time.monotonic() - start < 5.0


def test_mooncake_master_killed_mid_run(tmp_path):
    """The master dies under a live client: errors, bounded waits, no crash, no garbage."""
    with start_mooncake_master(segment_nbytes=16 << 20, log_dir=tmp_path) as own:
        store = client(own, retry_after_s=30.0)
        keys = page_keys(np.arange(16), 4, "killed", FP, MID)
        pages = make_pages(len(keys), seed=4)
        assert store.set(keys, list(pages)) == 4
        own.kill_master()
        out = torch.zeros_like(pages)
        start = time.monotonic()
        with pytest.raises(StorageError):
            store.get_into(keys, list(out))
        assert time.monotonic() - start < 15.0  # the client library's own retries
        # The breaker is open now: every op fails at once instead of waiting again.
        for op in (
            lambda: store.exists(keys),
            lambda: store.set(keys, list(pages)),
            lambda: store.get_into(keys, list(out)),
        ):
            start = time.monotonic()
            with pytest.raises(StorageError, match="unavailable"):
                op()
            assert time.monotonic() - start < 0.5
        assert store.counters().num_errors == 4
        assert store.counters().num_hit_pages == 0
        start = time.monotonic()
        store.close()  # the library retries its unmount for a while; bounded all the same
        assert time.monotonic() - start < 20.0


def test_mooncake_process_exits_cleanly_after_master_loss(tmp_path):
    script = textwrap.dedent(
        f"""
        import numpy as np
        from hicache.storage import StorageError, make_storage, page_keys
        from hicache.testing.mooncake_master import start_mooncake_master
        with start_mooncake_master(log_dir={str(tmp_path)!r}) as m:
            s = make_storage(m.spec, page_nbytes=4096, segment_nbytes=16 << 20)
            keys = page_keys(np.arange(8), 4, None, "fp", "m")
            assert s.set(keys, [bytes(4096)] * 2) == 2
            m.kill_master()
            try:
                s.exists(keys)
            except StorageError as e:
                print("storage error:", e)
            s.close()
        print("done")
        """
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "storage error:" in proc.stdout and proc.stdout.rstrip().endswith("done")
    assert time.monotonic() - start < 45.0  # includes importing torch in a fresh interpreter


def test_mooncake_threads_share_one_client(master):
    store = client(master)
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            keys = page_keys(np.arange(32) + 1000 * thread, 4, "threads", FP, MID)
            pages = make_pages(len(keys), seed=10 + thread)
            out = torch.zeros_like(pages)
            for _ in range(5):
                assert store.set(keys, list(pages)) == len(keys)
                assert store.get_into(keys, list(out)) == len(keys)
                assert torch.equal(out, pages)
                assert store.delete(keys) == len(keys)
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert store.counters().num_hit_pages == 4 * 5 * 8
    store.close()


def test_mooncake_spec_query_options(master):
    store = make_storage(
        f"{master.spec}&segment_nbytes=0&local_buffer_nbytes={8 << 20}&retry_after_s=0.5",
        page_nbytes=PAGE_NBYTES,
    )
    assert isinstance(store, MooncakeStorage) and store.retry_after_s == 0.5
    keys = page_keys(np.arange(4), 4, "spec", FP, MID)
    assert store.set(keys, [bytes(PAGE_NBYTES)]) == 1
    assert store.get(keys) == [bytes(PAGE_NBYTES)]
    store.delete(keys)
    store.close()


@pytest.mark.parametrize("attacker_secret", [None, "another-secret"])
def test_mooncake_planted_pages_are_a_clean_miss_for_the_secret_holder(
    master, monkeypatch, attacker_secret
):
    """Anyone who reaches the store can put pages under public keys; with a storage
    secret they are never served, each is removed, and the owner's pages still hit."""
    monkeypatch.delenv("HICACHE_STORAGE_SECRET", raising=False)
    secret = "owner-secret-5f1c2a9e77d04b8c"
    mine = page_keys(np.arange(12), 4, f"mine-{attacker_secret}", FP, MID)
    theirs = page_keys(np.arange(16), 4, f"theirs-{attacker_secret}", FP, MID)
    owner_pages = make_pages(3, seed=5)
    owner = client(master, secret=secret)
    assert owner.set(mine, list(owner_pages)) == 3
    attacker = client(master, secret=attacker_secret)
    forged = make_pages(4, seed=6)
    assert attacker.set(theirs, list(forged)) == 4
    plain = client(master)  # without a secret the store is trusted: forged KV is served
    out = torch.zeros_like(forged)
    assert plain.get_into(theirs, list(out)) == 4 and torch.equal(out, forged)
    plain.close()

    out = torch.zeros_like(owner_pages)
    assert owner.get_into(mine, list(out)) == 3 and torch.equal(out, owner_pages)
    out = torch.zeros_like(forged)
    assert owner.exists(theirs) == 4
    assert owner.get_into(theirs, list(out)) == 0  # a clean miss
    c = owner.counters()
    assert (c.num_unauthentic_values, c.num_corrupt_values, c.num_errors) == (4, 0, 0)
    assert owner.exists(theirs) == 0  # every planted page of the batch was removed ...
    assert owner.set(theirs, list(forged)) == 4  # ... so our own pages replace them
    assert owner.get_into(theirs, list(out)) == 4 and torch.equal(out, forged)
    for store in (owner, attacker):
        store.delete(mine + theirs)
        store.close()
