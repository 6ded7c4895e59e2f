"""Storage tier: page keys, the file backend, value integrity, specs."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.config import KVConfig
from hicache.storage import (
    VALUE_HEADER_NBYTES,
    FileStorage,
    StorageError,
    check_key,
    extend_keys,
    make_storage,
    model_identity,
    page_keys,
    root_key,
)

FP = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4).fingerprint()
MID = model_identity("test-model", revision="r1")


def make_pages(num_pages: int, page_nbytes: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages, page_nbytes), dtype=torch.uint8, generator=gen)


def keys_for(num_pages: int, page_size: int = 4, namespace: str | None = None) -> list[str]:
    return page_keys(np.arange(num_pages * page_size), page_size, namespace, FP, MID)


def value_path(store: FileStorage, key: str) -> Path:
    return store.root / key[:2] / key


# ---- keys ---------------------------------------------------------------------------


def test_keys_of_a_prefix_are_the_leading_keys():
    tokens = np.random.default_rng(0).integers(0, 50_000, 103)
    full = page_keys(tokens, 4, "tenant", FP, MID)
    assert len(full) == 103 // 4  # the partial last page has no key
    assert len(set(full)) == len(full)
    for num_tokens in range(0, 104):
        assert page_keys(tokens[:num_tokens], 4, "tenant", FP, MID) == full[: num_tokens // 4]
    for k in range(1, len(full)):
        assert extend_keys(full[k - 1], tokens[4 * k :], 4) == full[k:]
    changed = tokens.copy()
    changed[9] += 1  # inside page 2: pages 0-1 keep their keys, every later one changes
    other = page_keys(changed, 4, "tenant", FP, MID)
    assert other[:2] == full[:2]
    assert all(a != b for a, b in zip(other[2:], full[2:], strict=True))


def test_keys_do_not_depend_on_the_token_container():
    ids = [5, 0, 7, 123456, 9, 9, 1, 2]
    expected = page_keys(ids, 4, None, FP, MID)
    for tokens in (
        np.array(ids, dtype=np.int32),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint32),
        torch.tensor(ids, dtype=torch.int32),
        torch.tensor(ids, dtype=torch.int64),
        tuple(ids),
    ):
        assert page_keys(tokens, 4, None, FP, MID) == expected
    assert all(len(k) == 32 and check_key(k) == k for k in expected)


def test_keys_isolate_namespaces_layouts_and_models():
    tokens = np.arange(64)
    fingerprints = [
        FP,
        KVConfig(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4).fingerprint(),
        KVConfig(
            num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16"
        ).fingerprint(),
    ]
    # Same KV layout, different KV: other weights, revision, compute dtype, TP rank.
    model_ids = [
        MID,
        model_identity("test-model", revision="r2"),
        model_identity("test-model", weights_digest="0f" * 16),
        model_identity("other-model", revision="r1"),
        model_identity("test-model", revision="r1", dtype="bfloat16"),
        model_identity("test-model", revision="r1", tp_rank=1, tp_size=2),
        model_identity("test-model", revision="r1", extra={"rope_scaling": "yarn-4"}),
    ]
    assert len(set(model_ids)) == len(model_ids)
    seen: set[str] = set()
    num_keys = 0
    for namespace in (None, "", "a", "b"):
        for fp in fingerprints:
            for model_id in model_ids:
                keys = page_keys(tokens, 4, namespace, fp, model_id)
                seen.update(keys)
                num_keys += len(keys)
    assert len(seen) == num_keys  # no key shared by any two (tenant, layout, model) triples
    assert root_key(None, FP, MID) != root_key("", FP, MID)
    # Length-prefixed salt: moving a character between fields gives another salt.
    assert root_key("ab", "c-fp", MID) != root_key("a", "bc-fp", MID)
    assert root_key("a", "fp", "xmodel") != root_key("a", "fpx", "model")


def test_model_identity_is_canonical_and_checked():
    a = model_identity("m", revision="r", dtype="float16", extra={"x": "1", "y": "2"})
    b = model_identity("m", extra={"y": "2", "x": "1"}, dtype="float16", revision="r")
    assert a == b  # keyword order and mapping order do not matter
    assert model_identity("m", revision="r") == model_identity("m", revision="r", tp_rank=0)
    with pytest.raises(ValueError, match="weights_digest or revision"):
        model_identity("m")
    with pytest.raises(ValueError, match="name"):
        model_identity("", revision="r")
    with pytest.raises(ValueError, match="tp_rank"):
        model_identity("m", revision="r", tp_rank=2, tp_size=2)
    with pytest.raises(TypeError, match="tp_size"):
        model_identity("m", revision="r", tp_size=2.0)
    with pytest.raises(ValueError, match="dtype"):
        model_identity("m", revision="r", dtype="")
    with pytest.raises(TypeError, match="extra"):
        model_identity("m", revision="r", extra={"x": 1})
    for bad, error in ((None, TypeError), ("", ValueError), ("  ", ValueError), (3, TypeError)):
        with pytest.raises(error, match="model_id"):
            root_key(None, FP, bad)


def test_key_and_token_validation():
    with pytest.raises(TypeError, match="integer"):
        page_keys([1.0, 2.0, 3.0, 4.0], 4, None, FP, MID)
    with pytest.raises(ValueError, match="non-negative"):
        page_keys([1, -2, 3, 4], 4, None, FP, MID)
    with pytest.raises(ValueError, match="1-D"):
        page_keys(np.zeros((2, 4), dtype=np.int64), 4, None, FP, MID)
    with pytest.raises(ValueError, match="page_size"):
        page_keys([1, 2], 0, None, FP, MID)
    with pytest.raises(ValueError, match="fingerprint"):
        page_keys([1, 2], 1, None, "", MID)
    for bad in ("../../etc/passwd", "ABCDEF" * 6, "abc", "g" * 32, "a" * 129):
        with pytest.raises(ValueError, match="hex"):
            check_key(bad)
    with pytest.raises(TypeError):
        check_key(b"a" * 32)
    assert page_keys([], 4, None, FP, MID) == []


# ---- file backend -------------------------------------------------------------------


def test_file_round_trip_from_and_into_page_views(tmp_path):
    kv = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
    host = torch.randn(6, 2, 2, 4, 2, 8).to(torch.bfloat16)  # (pages, layers, K/V, P, H, D)
    store = make_storage(f"file:{tmp_path}", page_nbytes=kv.page_nbytes)
    keys = page_keys(np.arange(24), 4, "t", kv.fingerprint(), MID)
    assert store.set(keys[:5], [host[i] for i in range(5)]) == 5
    assert store.exists(keys) == 5
    assert store.exists(keys[1:]) == 4
    out = torch.zeros_like(host)
    assert store.get_into(keys, [out[i] for i in range(6)]) == 5  # leading hits only
    assert torch.equal(out[:5], host[:5])
    assert store.get(keys[2:4]) == [host[i].view(torch.uint8).numpy().tobytes() for i in (2, 3)]
    # Re-offering stored pages stores nothing new but reports them as stored.
    assert store.set(keys[:2], [np.zeros(kv.page_nbytes, np.uint8)] * 2) == 2
    assert store.get_into(keys[:1], [out[0]]) == 1 and torch.equal(out[0], host[0])
    c = store.counters()
    assert (c.num_set_pages, c.num_stored_pages, c.written_nbytes) == (7, 7, 5 * kv.page_nbytes)
    assert (c.num_get_pages, c.num_hit_pages, c.num_corrupt_values) == (9, 8, 0)
    assert store.delete(keys) == 5 and store.exists(keys) == 0
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".hicache-store"]


@pytest.mark.parametrize(
    "damage",
    ["flip_payload", "flip_header", "truncate", "extend", "wrong_key"],
)
def test_file_damaged_value_is_a_counted_removed_miss(tmp_path, damage):
    page_nbytes = 256
    store = FileStorage(tmp_path, page_nbytes=page_nbytes)
    keys = keys_for(3)
    pages = make_pages(3, page_nbytes)
    assert store.set(keys, list(pages)) == 3
    path = value_path(store, keys[1])
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[VALUE_HEADER_NBYTES + 100] ^= 0x01
    elif damage == "flip_header":
        data[8] ^= 0x80  # payload length field
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    else:  # an intact value of another key filed under this name
        data = bytearray(value_path(store, keys[2]).read_bytes())
    path.write_bytes(bytes(data))
    out = torch.zeros_like(pages)
    assert store.get_into(keys, list(out)) == 1
    assert torch.equal(out[0], pages[0])
    assert not path.exists()
    assert store.counters().num_corrupt_values == 1
    assert store.exists(keys) == 1
    assert store.set(keys, list(pages)) == 3  # the page can be backed up again
    assert store.get_into(keys, list(out)) == 3 and torch.equal(out, pages)


def test_file_capacity_evicts_least_recently_used_first(tmp_path):
    page_nbytes = 1000
    value_nbytes = VALUE_HEADER_NBYTES + page_nbytes
    store = FileStorage(
        tmp_path, page_nbytes=page_nbytes, capacity_nbytes=4 * value_nbytes, low_watermark=1.0
    )
    keys = [root_key(f"k{i}", FP, MID) for i in range(7)]  # unrelated single pages
    pages = make_pages(7, page_nbytes)
    buf = torch.zeros(page_nbytes, dtype=torch.uint8)
    for i in range(4):
        assert store.set([keys[i]], [pages[i]]) == 1
    assert store.get_into([keys[0]], [buf]) == 1  # k0 is now the most recent
    assert store.set([keys[4]], [pages[4]]) == 1  # over the cap: k1 goes
    present = [k for k in keys if store.exists([k])]
    assert present == [keys[0], keys[2], keys[3], keys[4]]
    assert store.set([keys[2]], [pages[2]]) == 1  # a re-offered page is refreshed too
    assert store.set([keys[5]], [pages[5]]) == 1  # k3 is the oldest now
    present = [k for k in keys if store.exists([k])]
    assert present == [keys[0], keys[2], keys[4], keys[5]]
    assert store.counters().num_evicted_pages == 2
    assert store.tracked_nbytes == 4 * value_nbytes
    # A second opener (another process) sees the same bytes and the same LRU order.
    other = FileStorage(
        tmp_path, page_nbytes=page_nbytes, capacity_nbytes=4 * value_nbytes, low_watermark=0.5
    )
    assert other.tracked_nbytes == 4 * value_nbytes
    assert other.set([keys[6]], [pages[6]]) == 1  # evicts down to 2 values: k0, k2, k4 go
    assert [k for k in keys if other.exists([k])] == [keys[5], keys[6]]


def _race_worker(root: str, key: str, page_nbytes: int, worker: int, rounds: int, q) -> None:
    try:
        _race(root, key, page_nbytes, worker, rounds, q)
    except Exception as e:  # reported to the parent instead of leaving it waiting
        q.put((worker, repr(e), 0, 0))


def _race(root: str, key: str, page_nbytes: int, worker: int, rounds: int, q) -> None:
    store = FileStorage(root, page_nbytes=page_nbytes)
    mine = np.full(page_nbytes, worker, dtype=np.uint8)
    out = np.empty(page_nbytes, dtype=np.uint8)
    num_bad = num_hits = 0
    for i in range(rounds):
        if i % 3 == 0:
            store.delete([key])
        store.set([key], [mine])
        if store.get_into([key], [out]):
            num_hits += 1
            # Whole-value atomicity: one writer's page, never a blend.
            if not (out[0] < 4 and (out == out[0]).all()):
                num_bad += 1
    q.put((worker, num_bad, num_hits, store.counters().num_corrupt_values))


def test_file_concurrent_processes_writing_one_key(tmp_path):
    page_nbytes = 256 * 1024
    key = root_key("race", FP, MID)
    ctx = mp.get_context("fork")  # the workers touch files only, never torch
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(str(tmp_path), key, page_nbytes, w, 300, q))
        for w in range(4)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(r[0] for r in results) == [0, 1, 2, 3]
    assert all(r[1] == 0 and r[3] == 0 for r in results), results  # nothing torn or corrupt
    assert sum(r[2] for r in results) > 0
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != key]
    assert leftovers == [".hicache-store"]  # every temp file was renamed or removed
    store = FileStorage(tmp_path, page_nbytes=page_nbytes)
    final = store.get([key])
    assert len(final) == 1 and len(set(final[0])) == 1


def test_file_threads_share_one_backend(tmp_path):
    store = FileStorage(tmp_path, page_nbytes=512, capacity_nbytes=40 * 544)
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            keys = keys_for(8, namespace=f"thread-{thread}")
            pages = make_pages(8, 512, seed=thread)
            out = torch.zeros_like(pages)
            for _ in range(20):
                assert store.set(keys, list(pages)) == 8
                num_hit = store.get_into(keys, list(out))  # others' writes may evict ours
                assert torch.equal(out[:num_hit], pages[:num_hit])
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert store.counters().num_corrupt_values == 0
    assert store.tracked_nbytes <= 40 * 544


def test_file_io_failure_is_a_storage_error(tmp_path, monkeypatch):
    store = FileStorage(tmp_path, page_nbytes=64)
    key = root_key("blocked", FP, MID)

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as m:
        m.setattr(os, "writev", fail)
        with pytest.raises(StorageError, match="write.*Input/output error"):
            store.set([key], [bytes(64)])
    assert store.counters().num_errors == 1
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".hicache-store"]  # no temp
    assert store.set([key], [bytes(64)]) == 1  # the backend keeps working
    store.close()
    with pytest.raises(StorageError, match="closed"):
        store.exists([key])


def test_file_a_file_in_place_of_a_subdirectory_is_not_replaced(tmp_path):
    store = FileStorage(tmp_path, page_nbytes=64)
    key = root_key("blocked", FP, MID)
    (tmp_path / key[:2]).write_bytes(b"not a directory")
    assert store.set([key], [bytes(64)]) == 0  # not ours to replace: counted, not raised
    assert store.counters().num_errors == 1
    assert store.exists([key]) == 0 and store.get([key]) == []
    assert (tmp_path / key[:2]).read_bytes() == b"not a directory"


def test_file_removes_stale_temp_files_on_open(tmp_path):
    key = root_key("stale", FP, MID)
    (tmp_path / key[:2]).mkdir()
    stale = tmp_path / key[:2] / f".{key}.1.2.3.tmp"
    fresh = tmp_path / key[:2] / f".{key}.1.2.4.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (0, 0))
    FileStorage(tmp_path, page_nbytes=64)
    assert not stale.exists() and fresh.exists()  # a live writer's temp file is kept


def test_bad_arguments_name_what_was_expected(tmp_path):
    store = FileStorage(tmp_path, page_nbytes=64)
    key = root_key("x", FP, MID)
    with pytest.raises(ValueError, match="expected 64 bytes"):
        store.set([key], [bytes(63)])
    with pytest.raises(ValueError, match="writable"):
        store.get_into([key], [bytes(64)])
    with pytest.raises(ValueError, match="one per key"):
        store.set([key, key], [bytes(64)])
    with pytest.raises(ValueError, match="contiguous"):
        store.set([key], [torch.zeros(2, 64, dtype=torch.uint8)[:, 0:32]])
    with pytest.raises(TypeError, match="single str"):
        store.exists(key)
    with pytest.raises(ValueError, match="hex"):
        store.set(["../escape"], [bytes(64)])
    with pytest.raises(ValueError, match="capacity_nbytes"):
        FileStorage(tmp_path, page_nbytes=64, capacity_nbytes=0)
    with pytest.raises(ValueError, match="page_nbytes"):
        FileStorage(tmp_path, page_nbytes=0)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "file:",
        "dir/only",
        "redis://127.0.0.1:6379",
        "mooncake://127.0.0.1:50051",
        "mooncake://127.0.0.1?metadata=http://127.0.0.1:8080/metadata",
        "mooncake://127.0.0.1:port?metadata=http://127.0.0.1:8080/metadata",
        "mooncake://127.0.0.1:50051/path?metadata=http://127.0.0.1:8080/metadata",
    ],
)
def test_bad_specs_name_the_expected_forms(spec):
    with pytest.raises(ValueError, match="file:DIR.*mooncake://HOST:PORT"):
        make_storage(spec, page_nbytes=64)


def test_spec_options_are_checked(tmp_path):
    with pytest.raises(TypeError, match="spec"):
        make_storage(None, page_nbytes=64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_nbytes"):
        make_storage(f"file:{tmp_path}", page_nbytes=64, segment_nbytes=1)
    with pytest.raises(ValueError, match="segment_nbytes"):
        make_storage(
            "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata&segment_nbytes=x",
            page_nbytes=64,
        )
    with pytest.raises(ValueError, match="expected some of"):
        make_storage(
            "mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata&bogus=1", page_nbytes=64
        )
    store = make_storage(f"file:{tmp_path}/sub", page_nbytes=64, capacity_nbytes=1 << 20)
    assert isinstance(store, FileStorage) and store.capacity_nbytes == 1 << 20


def test_storage_sizes_of_the_wrong_type_raise_type_error(tmp_path):
    """One checker (hicache/checks.py): a wrong type is a TypeError, a bad value a ValueError."""
    with pytest.raises(TypeError, match="page_nbytes: expected int, got str"):
        FileStorage(tmp_path, page_nbytes="64")
    with pytest.raises(TypeError, match="capacity_nbytes: expected int, got float"):
        FileStorage(tmp_path, page_nbytes=64, capacity_nbytes=1.5)
    with pytest.raises(TypeError, match="page_size: expected int, got float"):
        extend_keys(root_key(None, FP, MID), [1, 2], 1.0)


# ---- the storage tier's threads -----------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_tier_threads_run_on_the_cpus_given_and_stay_put_where_refused(tmp_path, caplog):
    from hicache.memory import HostPool
    from hicache.storage.worker import StorageJob, StorageTier

    kv = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    pool = HostPool(kv, 2)
    cpu = max(os.sched_getaffinity(0))
    tier = StorageTier(make_storage(f"file:{tmp_path / 'a'}", page_nbytes=pool.page_nbytes),
                       pool, cpus=frozenset({cpu}))
    assert [os.sched_getaffinity(t.native_id) for t in tier._threads] == [{cpu}, {cpu}]
    tier.close()
    # No such CPU: each thread says so and stays where it started; the tier still works.
    where = os.sched_getaffinity(0)
    with caplog.at_level("WARNING", logger="hicache.storage"):
        tier = StorageTier(make_storage(f"file:{tmp_path / 'b'}", page_nbytes=pool.page_nbytes),
                           pool, cpus=frozenset({4095}))
    assert [r.getMessage().split(" stays")[0] for r in caplog.records] == [
        "hicache storage: thread hicache-storage-write",
        "hicache storage: thread hicache-storage-read"]
    assert [os.sched_getaffinity(t.native_id) for t in tier._threads] == [where, where]
    job = tier.submit(StorageJob("write", keys_for(1), torch.tensor([0])))
    assert job.done.wait(30) and job.error is None and job.num_done == 1
    assert tier.poll() == [job]
    tier.close()
