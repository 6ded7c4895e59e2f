"""KV events: exact event streams, and a mirror built only from events equals the cache."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from kv_layouts import KV_TINY, TREE_KINDS, P
from leak_checks import assert_no_leaks
from serving import serve as serve_request

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored, Mirror, page_hashes
from hicache.tree import RadixTree, make_tree, token_key

A = [1, 2, 3, 4, 5, 6]


def hashes_of(tokens, prev=0):
    return page_hashes(token_key(tokens, P), P, prev)


def content(cache: HiCache) -> dict[str, set]:
    """The (namespace, page hash) pairs each tier holds, read from the tree."""
    tiers = {"device": set(), "host": set()}
    for node in cache.tree.nodes():
        _, hashes = cache.tree.node_hashes(node)
        for tier, present in (("device", node.on_device), ("host", node.on_host)):
            if present:
                tiers[tier].update((node.namespace, h) for h in hashes)
    return tiers


# With KV a load back must land before the insert; the random mirror scenario fills the
# device, so an allocation may be refused there.
serve = partial(serve_request, finish_loads=True, may_refuse=True)


def test_hashes_chain_over_the_prefix():
    long = hashes_of(A + [7, 8])
    assert hashes_of(A) == long[:3]
    assert hashes_of([5, 6], prev=long[1]) == [long[2]]
    assert hashes_of([1, 2, 3, 5])[0] == long[0] and hashes_of([1, 2, 3, 5])[1] != long[1]
    assert len(set(long)) == 4 and all(0 <= h < 2**64 for h in long)
    assert hashes_of([2, 1]) != hashes_of([1, 2])  # order matters within a page


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_logs_nothing_until_enabled_then_node_hashes_match(kind):
    tree = make_tree(kind, P)
    leaf = tree.insert(A, torch.arange(3)).last_node
    assert tree.take_events() == []
    tree.enable_events()
    tree.match_prefix(A[:2])  # split: no content change, no event
    assert tree.take_events() == []
    assert tree.node_hashes(leaf) == (hashes_of(A)[0], hashes_of(A)[1:])
    with pytest.raises(ValueError, match="root"):
        tree.node_hashes(tree.root())
    tree.evict_device(4)
    assert tree.take_events() == [(False, "device", None, hashes_of(A)[0], hashes_of(A)[1:], 4)]
    assert tree.take_events() == []
    tree.check_integrity()


@pytest.mark.parametrize("tree", TREE_KINDS)
@pytest.mark.parametrize("lifecycle", ["python", "auto"])
def test_exact_event_stream_through_the_tiers(tree, lifecycle):
    """Insert, write-through backup, device eviction, load back, host eviction, reset."""
    cache = HiCache(CacheConfig(KV_TINY, device_tokens=8, host_tokens=8, allocate_kv=False,
                                kv_events=True, tree=tree, lifecycle=lifecycle))
    # Events need no hand-over: over the native tree the C++ lifecycle stays in charge.
    assert cache.lifecycle == ("native" if (tree, lifecycle) == ("native", "auto") else "python")
    ha = hashes_of(A)
    hb = hashes_of([9, 9, 9, 9])
    serve(cache, A)
    assert cache.take_events() == [
        BlockStored("device", tuple(ha), None, 6, None),
        BlockStored("host", tuple(ha), None, 6, None),
    ]
    serve(cache, [9, 9, 9, 9])  # needs 2 pages, 1 free: A's last page leaves the device
    assert cache.take_events() == [
        BlockRemoved("device", (ha[2],), None),
        BlockStored("device", tuple(hb), None, 4, None),
        # host: 1 free page, B needs 2: A's last page (host-only leaf) leaves first
        BlockRemoved("host", (ha[2],), None),
        BlockStored("host", tuple(hb), None, 4, None),
    ]
    assert cache.reset().complete
    assert cache.take_events() == [
        BlockRemoved("device", tuple(ha[:2]), None),  # LRU: A before B in both tiers
        BlockRemoved("device", tuple(hb), None),
        BlockRemoved("host", tuple(ha[:2]), None),
        BlockRemoved("host", tuple(hb), None),
        AllBlocksCleared("device"),
        AllBlocksCleared("host"),
    ]
    assert_no_leaks(cache)


def test_load_back_and_namespaces_in_events():
    cache = HiCache(CacheConfig(KV_TINY, device_tokens=6, host_tokens=16, allocate_kv=False,
                                kv_events=True, tree="python"))
    serve(cache, A, "t")
    serve(cache, [9] * 6)  # evicts all of A from the device (it stays on the host)
    cache.take_events()
    h = cache.match(A, "t")  # loads A back: stored on the device again
    assert h.prefix_len == 6
    events = cache.take_events()
    assert [e for e in events if e.tier == "device" and isinstance(e, BlockStored)] == [
        BlockStored("device", tuple(hashes_of(A)), None, 6, "t"),
    ]
    cache.release(h)
    assert_no_leaks(cache)


def test_events_off_by_default_and_bad_flag():
    cache = HiCache(CacheConfig(KV_TINY, device_tokens=8, allocate_kv=False))
    serve(cache, A)
    assert cache.take_events() == [] and cache._events is None
    cache.check_integrity()
    with pytest.raises(TypeError, match="kv_events"):
        CacheConfig(KV_TINY, device_tokens=8, kv_events=1)


def test_storage_events(tmp_path):
    cfg = CacheConfig(KV_TINY, device_tokens=16, host_tokens=32, storage=f"file:{tmp_path}",
                      model_id="m", kv_events=True, tree="python")
    with HiCache(cfg) as cache:
        serve(cache, A)
        cache.wait_all()
        for job in list(cache._inflight.storage_pins.values()):
            job.done.wait()
        cache.poll()
        events = cache.take_events()
        assert BlockStored("storage", tuple(hashes_of(A)), None, 6, None) in events
        cache.reset(storage=True)
        assert cache.take_events()[-1] == AllBlocksCleared("storage")
        assert_no_leaks(cache)


# ------------------------------------------------------------------ mirror
MIRROR_CONFIGS = [
    dict(tree=t, lifecycle=lc, allocate_kv=False, write_policy=wp)
    for t in TREE_KINDS
    for lc in ("python", "auto")
    for wp in ("write_through", "write_through_selective", "write_back")
] + [
    dict(tree=t, allocate_kv=True, executor="thread", write_policy=wp)
    for t in TREE_KINDS
    for wp in ("write_through", "write_back")
]


@pytest.mark.parametrize("cfg", MIRROR_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_mirror_from_events_equals_the_cache(cfg):
    """Random requests over a small cache: evictions, loads, backups, pins and resets."""
    rng = random.Random(11)
    cache = HiCache(CacheConfig(KV_TINY, device_tokens=24, host_tokens=40, kv_events=True, **cfg))
    stems = [[rng.randrange(4) for _ in range(12)] for _ in range(6)]
    mirror = Mirror()
    held = []
    for step in range(300):
        op = rng.random()
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(2, 13)] + [rng.randrange(4) for _ in range(rng.randrange(3))]
        ns = rng.choice([None, None, "t"])
        if op < 0.6:
            serve(cache, tokens, ns)
        elif op < 0.7 and len(held) < 2:
            held.append(cache.match(tokens, ns))
        elif op < 0.8 and held:
            cache.release(held.pop(rng.randrange(len(held))))
        elif op < 0.87:
            cache.pin(tokens, ns)
        elif op < 0.92:
            cache.unpin(tokens, ns)
        elif op < 0.95:
            cache.reset()
        else:
            cache.wait_all()
        if step % 10 == 0:
            cache.wait_all()
        for event in cache.take_events():
            mirror.apply(event)
        want = content(cache)
        assert mirror.tiers["device"] == want["device"], f"step {step}"
        assert mirror.tiers["host"] == want["host"], f"step {step}"
        cache.check_integrity()
    s = cache.stats()  # the workload went through every kind of tier change
    assert min(s["loads"], s["backups"], s["device_evicted_tokens"]) > 0
    if cfg["write_policy"] != "write_through_selective":  # too few backups to fill the host
        assert s["host_evicted_tokens"] > 0
    for h in held:
        cache.release(h)
    cache.reset()
    for event in cache.take_events():
        mirror.apply(event)
    assert mirror.tiers["device"] == content(cache)["device"]
    cache.close()


def test_python_tree_event_hashes_match_the_reference_function():
    tree = RadixTree(P)
    tree.enable_events()
    tree.insert([3, 1, 4, 1, 5, 9], torch.arange(3))
    tree.insert([3, 1, 4, 2], torch.tensor([0, 3]))
    (_, _, _, _, first, _), (_, _, _, parent, second, _) = tree.take_events()
    assert first == hashes_of([3, 1, 4, 1, 5, 9])
    assert parent == first[0] and second == hashes_of([3, 1, 4, 2])[1:]
    tree.check_integrity()


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_node_hashes_bad_input(kind):
    tree = make_tree(kind, P)
    leaf = tree.insert(A, torch.arange(3)).last_node
    with pytest.raises(TypeError):
        tree.node_hashes("node")
    tree.evict_device(6)
    with pytest.raises(ValueError):
        tree.node_hashes(leaf)  # removed: stale
    tree.check_integrity()
