"""The storage secret: pages planted in a shared third tier are never served (issue 30,
part 2). An attacker who can write into the store but lacks the secret files forged KV
under the public keys the victim looks up; the victim misses cleanly, counts it, and
its own pages still hit."""

from __future__ import annotations

import logging
import random
import zlib

import numpy as np
import pytest
import torch
from kv_layouts import KV, P
from leak_checks import assert_quiescent
from serving import compute, expected_kv, read_prefix, serve_kv

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.storage import (
    SECRET_ENV,
    VALUE_HEADER_NBYTES,
    FileStorage,
    PageAuthenticator,
    make_storage,
    page_keys,
)
from hicache.storage.base import encode_header

SECRET = "owner-secret-5f1c2a9e77d04b8c"
OTHER = "someone-elses-secret-0000"
MID = "test-model"
A = [1, 1, 2, 2, 3, 3, 4, 4]
PAGE = KV.page_nbytes


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)


def keys_of(tokens: list[int]) -> list[str]:
    """The keys any process can derive from public facts (model id, layout, tokens)."""
    return page_keys(np.array(tokens), P, None, KV.fingerprint(), MID)


def forged_pages(num: int) -> list[bytes]:
    return [bytes([0xA5]) * PAGE for _ in range(num)]


def plant(root, keys: list[str], secret: str | None = None) -> None:
    """Replace whatever is stored under ``keys`` with forged pages."""
    attacker = FileStorage(root, page_nbytes=PAGE, secret=secret)
    attacker.delete(keys)
    assert attacker.set(keys, forged_pages(len(keys))) == len(keys)


# ---- the backend ------------------------------------------------------------------


@pytest.mark.parametrize("attacker_secret", [None, OTHER])
def test_planted_values_are_a_clean_miss_and_the_owners_still_hit(tmp_path, attacker_secret):
    owner = FileStorage(tmp_path, page_nbytes=PAGE, secret=SECRET)
    assert owner.authenticated
    mine = keys_of(list(range(8)))
    theirs = keys_of(A)
    owner_pages = [bytes([i]) * PAGE for i in range(4)]
    assert owner.set(mine, owner_pages) == 4
    plant(tmp_path, theirs, attacker_secret)

    victim = FileStorage(tmp_path, page_nbytes=PAGE, secret=SECRET)
    assert victim.get(mine) == owner_pages  # the owner's own pages hit
    assert victim.exists(theirs) == 4  # present ...
    assert victim.get(theirs) == []  # ... but never served
    c = victim.counters()
    assert (c.num_hit_pages, c.num_unauthentic_values, c.num_corrupt_values) == (4, 1, 0)
    assert victim.exists(theirs) == 0  # the refused value was removed
    # Storing our own pages replaces the planted ones still there (no "already stored").
    assert victim.set(theirs, owner_pages) == 4
    assert victim.counters().num_unauthentic_values == 4  # pages 1-3 found by set
    assert victim.get(theirs) == owner_pages


def test_a_thread_counts_the_unauthentic_values_it_found_itself(tmp_path):
    """The storage tier's read thread attributes to a read only what that read refused:
    the write thread replacing planted values at the same time counts in the backend's
    total, not in the reader's own count (it made a prefetch report 4 refused pages, not
    3, when a write overlapped it)."""
    import threading

    plant(tmp_path, keys_of(A), OTHER)
    victim = FileStorage(tmp_path, page_nbytes=PAGE, secret=SECRET)
    writer = threading.Thread(target=victim.set, args=(keys_of(A)[1:], [bytes(PAGE)] * 3))
    writer.start()  # finds and replaces 3 planted values, in its own thread
    writer.join()
    assert victim.counters().num_unauthentic_values == 3
    assert victim.thread_unauthentic_values() == 0  # none found by this thread
    assert victim.get(keys_of(A)) == []  # page 0 is still the planted one: refused here
    assert victim.thread_unauthentic_values() == 1
    assert victim.counters().num_unauthentic_values == 4


def test_a_forgery_with_a_valid_checksum_is_unauthentic_not_corrupt(tmp_path):
    owner = FileStorage(tmp_path, page_nbytes=PAGE, secret=SECRET)
    key = keys_of(A)[0]
    assert owner.set([key], [bytes(PAGE)]) == 1
    path = tmp_path / key[:2] / key
    data = bytearray(path.read_bytes())
    data[VALUE_HEADER_NBYTES:] = b"\x01" * PAGE  # forged payload, tag of the old one kept
    crc = zlib.crc32(bytes(data[VALUE_HEADER_NBYTES:]),
                     zlib.crc32(key.encode() + PAGE.to_bytes(8, "little")))
    data[16:20] = crc.to_bytes(4, "little")  # the checksum is public: recomputed
    path.write_bytes(bytes(data))
    assert FileStorage(tmp_path, page_nbytes=PAGE).get([key]) == [b"\x01" * PAGE]  # no secret
    assert owner.get([key]) == []
    c = owner.counters()
    assert (c.num_unauthentic_values, c.num_corrupt_values) == (1, 0)


def test_without_a_secret_the_store_is_trusted_as_before(tmp_path):
    keys = keys_of(A)
    plant(tmp_path, keys)
    reader = FileStorage(tmp_path, page_nbytes=PAGE)
    assert not reader.authenticated
    assert reader.get(keys) == forged_pages(4)  # whatever the store holds is served
    tagged = FileStorage(tmp_path / "t", page_nbytes=PAGE, secret=SECRET)
    assert tagged.set(keys, forged_pages(4)) == 4
    assert FileStorage(tmp_path / "t", page_nbytes=PAGE).get(keys) == forged_pages(4)


def test_the_secret_comes_from_the_environment_when_not_given(tmp_path, monkeypatch):
    keys = keys_of(A)
    FileStorage(tmp_path, page_nbytes=PAGE, secret=SECRET).set(keys, forged_pages(4))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert make_storage(f"file:{tmp_path}", page_nbytes=PAGE).get(keys) == forged_pages(4)
    monkeypatch.setenv(SECRET_ENV, OTHER)
    assert make_storage(f"file:{tmp_path}", page_nbytes=PAGE).get(keys) == []
    monkeypatch.setenv(SECRET_ENV, "")  # empty: no secret
    assert not make_storage(f"file:{tmp_path}", page_nbytes=PAGE).authenticated


def test_the_tag_covers_key_length_and_bytes():
    auth = PageAuthenticator(SECRET)
    page = memoryview(bytes(range(256)) * 4)
    key, other_key = keys_of(A)[:2]
    tag = auth.tag(key, page)
    assert len(tag) == 32 and auth.verify(key, page, tag)
    assert not auth.verify(other_key, page, tag)  # another key's value
    flipped = bytearray(page)
    flipped[500] ^= 1
    assert not auth.verify(key, memoryview(flipped), tag)
    assert not PageAuthenticator(OTHER).verify(key, page, tag)
    assert PageAuthenticator(SECRET.encode()).tag(key, page) == tag  # str and its bytes agree
    header = encode_header(key, page, auth)
    assert len(header) == VALUE_HEADER_NBYTES and tag in header


# ---- the secret is never shown ------------------------------------------------------


def test_the_secret_is_never_shown(tmp_path, caplog):
    cfg = CacheConfig(KV, device_tokens=8, host_tokens=16, storage=f"file:{tmp_path}",
                      executor="thread", model_id=MID, storage_secret=SECRET)
    conn = ConnectorConfig.from_sources({"storage": f"file:{tmp_path}"},
                                        {"HICACHE_STORAGE_SECRET": SECRET})
    with caplog.at_level(logging.DEBUG):
        cache = HiCache(cfg)
        serve_kv(cache, A)
        cache.wait_all()
        shown = [repr(cfg), str(cfg), repr(conn), repr(cache.storage.backend),
                 repr(PageAuthenticator(SECRET)), str(cache.stats())]
        cache.close()
    for text in [*shown, caplog.text]:
        assert SECRET not in text
    for bad, kind in ((12345, TypeError), ("", ValueError), (b"", ValueError)):
        with pytest.raises(kind, match="storage_secret: expected a non-empty str or bytes") as e:
            CacheConfig(KV, device_tokens=8, storage_secret=bad)
        assert "12345" not in str(e.value)
    with pytest.raises(TypeError, match=r"storage_secret: expected"):
        ConnectorConfig(storage_secret=["x"])  # type: ignore[arg-type]


# ---- through the cache --------------------------------------------------------------


def make(tmp_path, **kw) -> HiCache:
    cfg = dict(device_tokens=8, host_tokens=16, storage=f"file:{tmp_path}", executor="thread",
               model_id=MID, prefetch_policy="wait_complete")
    cfg.update(kw)
    return HiCache(CacheConfig(KV, **cfg))


def device_k(cache: HiCache, h, layer: int) -> torch.Tensor:
    table = h.page_table()[: h.prefix_len // P]
    h.wait_layer(layer)
    return cache.device_pool.read_pages(layer, table)[0]


def test_a_cache_without_the_secret_serves_planted_kv(tmp_path):
    """The hole this closes: without a secret, forged pages become the prompt's KV."""
    plant(tmp_path, keys_of(A))
    cache = make(tmp_path)
    h = cache.match(A)
    assert h.prefix_len == len(A)
    assert not torch.equal(device_k(cache, h, 0), expected_kv(A, 0))  # the forged KV
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_a_cache_with_the_secret_misses_planted_kv_and_hits_its_own(tmp_path):
    plant(tmp_path, keys_of(A))
    victim = make(tmp_path, storage_secret=SECRET)
    h = victim.match(A)
    assert h.prefix_len == 0  # a clean miss: computed, never the planted KV
    compute(victim, h, A)
    victim.insert(h, A)
    victim.release(h)
    victim.wait_all()
    s = victim.stats()
    assert (s["storage_unauthentic_pages"], s["storage_hit_tokens"]) == (1, 0)
    assert s["storage_write_bytes"] == 4 * PAGE  # its own pages replaced the planted ones
    assert_quiescent(victim)
    victim.close()

    owner = make(tmp_path, storage_secret=SECRET)
    h = owner.match(A)
    assert h.prefix_len == len(A)  # the owner's own pages hit
    read_prefix(owner, h, A)
    owner.release(h)
    s = owner.stats()
    assert (s["storage_hit_tokens"], s["storage_unauthentic_pages"]) == (len(A), 0)
    assert_quiescent(owner)
    owner.close()

    stranger = make(tmp_path, storage_secret=OTHER)  # another secret: nothing verifies
    h = stranger.match(A)
    assert h.prefix_len == 0
    stranger.release(h)
    assert stranger.stats()["storage_unauthentic_pages"] == 1
    assert_quiescent(stranger)
    stranger.close()


# ---- the attack of issue 30, with the reference engine ---------------------------------


def test_kv_of_other_weights_planted_under_the_models_identity_never_steers_a_secret_holder(
    tmp_path, model, one_torch_thread, monkeypatch
):
    """The attacker runs other weights, claims the public model's identity, and fills a
    shared directory. Without a secret the victim is served that KV; with one it computes
    everything and generates exactly what the model generates without a cache."""
    from engine_processes import ENGINE_MAX_NEW_TOKENS, ENGINE_PAGE_SIZE, no_cache_tokens

    from hicache.sim.engine import Engine
    from hicache.sim.model import Model, preset

    spec = f"file:{tmp_path}"
    rng = random.Random(7)  # three unrelated prompts
    prompts = [[rng.randrange(32000) for _ in range(120 + 16 * i)] for i in range(3)]
    want = no_cache_tokens(model, prompts)
    whole = [(len(p) - 1) // ENGINE_PAGE_SIZE * ENGINE_PAGE_SIZE for p in prompts]
    attacker_model = Model(preset("tiny"), seed=1)
    attacker_model.identity = model.identity  # the identity is public
    with Engine(attacker_model, "hierarchical", 512, 1024, storage=spec) as attacker:
        for p in prompts:
            attacker.generate(p, ENGINE_MAX_NEW_TOKENS)

    def victim():
        return Engine(model, "hierarchical", 512, 1024, storage=spec,
                      prefetch_policy="wait_complete")

    with victim() as trusting:  # no secret: the planted pages are its prefix
        served = [trusting.generate(p, ENGINE_MAX_NEW_TOKENS) for p in prompts]
    assert [r.host_hit_tokens for r in served] == whole
    assert any(r.tokens != w for r, w in zip(served, want, strict=True))  # steered

    monkeypatch.setenv(SECRET_ENV, SECRET)
    with victim() as guarded:
        outs = [guarded.generate(p, ENGINE_MAX_NEW_TOKENS) for p in prompts]
        guarded.check_integrity()
        s = guarded.stats()
    assert [r.host_hit_tokens for r in outs] == [0, 0, 0]
    assert [r.tokens for r in outs] == want
    assert s["storage_unauthentic_pages"] == 3 and s["storage_hit_tokens"] == 0
    with Engine(Model(preset("tiny"), seed=0), "hierarchical", 512, 1024, storage=spec,
                prefetch_policy="wait_complete") as owner:  # the owner's pages now hit
        again = [owner.generate(p, ENGINE_MAX_NEW_TOKENS) for p in prompts]
        owner.check_integrity()
    assert [r.host_hit_tokens for r in again] == whole
    assert [r.tokens for r in again] == want


def test_the_vllm_connector_opens_its_store_with_the_configured_secret(tmp_path):
    """Both halves open their backend through ``HiCacheConnector._open_storage``."""
    from types import SimpleNamespace

    from optional_vllm import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed")
    from hicache.integrations.vllm.connector import HiCacheConnector

    keys = keys_of(A)
    FileStorage(tmp_path, page_nbytes=PAGE, secret=SECRET).set(keys, forged_pages(4))
    for secret, hits in ((SECRET, 4), (OTHER, 0)):
        cfg = ConnectorConfig.from_sources({"storage": f"file:{tmp_path}"},
                                           {"HICACHE_STORAGE_SECRET": secret})
        store = HiCacheConnector._open_storage(SimpleNamespace(hc_config=cfg, page_nbytes=PAGE))
        assert store.authenticated and len(store.get(keys)) == hits
        store.close()
