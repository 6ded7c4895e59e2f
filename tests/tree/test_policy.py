"""Eviction policies: the exact order in which pages leave, on both trees.

One scenario serves every policy (page size 1, four leaves A B C D holding
device pages 0 1 2 3)::

    tick   1  2  3  4  5  6  7  8  9  10
    op     +A +B +C +D mA mA mA mC mC mB     (+ insert, m match)

    node   created  last_access  hits
    A      1        7            3
    B      2        10           1
    C      3        9            2
    D      4        4            0

Priorities (``priority`` policy only): A 5, B 1, C 0, D 1.
"""

from __future__ import annotations

import pytest
import torch
from kv_layouts import TREE_KINDS
from leak_checks import assert_no_leaks

from hicache.cache import HiCache
from hicache.config import CacheConfig, EvictionPolicy, KVConfig
from hicache.tree import RadixTree, factory, native

KINDS = TREE_KINDS

EXPECTED_ORDER = {
    "lru": [3, 0, 2, 1],  # D(4) A(7) C(9) B(10)
    "lfu": [3, 1, 2, 0],  # hits D0 B1 C2 A3
    "fifo": [0, 1, 2, 3],  # created A B C D
    "mru": [1, 2, 0, 3],  # last access B(10) C(9) A(7) D(4)
    "filo": [3, 2, 1, 0],  # created D C B A
    "priority": [2, 3, 1, 0],  # C(0); D(1, t4) B(1, t10); A(5)
    "slru": [3, 1, 0, 2],  # probationary D(t4) B(t10); protected A(t7) C(t9)
}


def make_tree(kind: str, policy: str):
    return factory.make_tree(kind, 1, policy)


def scenario(tree) -> list[int]:
    nodes = {}
    for page, tok in enumerate((10, 20, 30, 40)):
        nodes[tok] = tree.insert([tok], torch.tensor([page])).last_node
    for tok in (10, 10, 10, 30, 30, 20):
        tree.match_prefix([tok])
    for tok, prio in ((10, 5), (20, 1), (40, 1)):
        tree.raise_priority(nodes[tok], prio)
    order = []
    for _ in range(4):
        r = tree.evict_device(1)
        assert r.num_evicted_tokens == 1
        order += r.page_ids.tolist()
        tree.check_integrity()
    assert tree.device_tokens == 0 and tree.num_nodes == 0
    assert tree.evict_device(1).num_evicted_tokens == 0
    return order


def test_every_policy_has_an_expected_order():
    assert set(EXPECTED_ORDER) == {p.value for p in EvictionPolicy}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
def test_eviction_order(kind, policy):
    assert scenario(make_tree(kind, policy)) == EXPECTED_ORDER[policy]


@pytest.mark.parametrize("kind", KINDS)
def test_node_records_creation_tick_and_split_keeps_it(kind):
    tree = make_tree(kind, "fifo")
    a = tree.insert([1, 2], torch.tensor([0, 1])).last_node  # tick 1
    tree.match_prefix([9])  # tick 2: a miss still ticks the clock
    b = tree.insert([1, 3], torch.tensor([5, 2])).last_node  # tick 3: splits [1, 2]
    prefix = a.parent
    assert (a.created, prefix.created, b.created) == (1, 1, 3)
    # FIFO: the older leaf [2] first, then [3], then the prefix (a leaf by then).
    order = [tree.evict_device(1).page_ids.tolist() for _ in range(3)]
    assert order == [[1], [2], [0]]
    tree.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_priority_only_grows_and_covers_the_path(kind):
    tree = make_tree(kind, "priority")
    leaf = tree.insert([1, 2, 3], torch.tensor([0, 1, 2])).last_node
    tree.match_prefix([1, 2])  # splits: [1, 2] | [3]
    tree.raise_priority(leaf, 4)
    tree.raise_priority(leaf, 2)  # lower: no change
    assert [n.priority for n in tree.path_to(leaf)] == [4, 4]
    other = tree.insert([1, 2, 7], torch.tensor([0, 1, 3])).last_node
    assert other.priority == 0  # a new node starts at 0 under a priority-4 parent
    assert [tree.evict_device(1).page_ids.tolist() for _ in range(3)] == [[3], [2], [1]]
    tree.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("priority", "error"),
    [(True, TypeError), (1.5, TypeError), ("1", TypeError), (None, TypeError),
     (2**63, ValueError), (-(2**63), ValueError)],
)
def test_raise_priority_bad_input(kind, priority, error):
    tree = make_tree(kind, "priority")
    leaf = tree.insert([1], torch.tensor([0])).last_node
    with pytest.raises(error, match="priority"):
        tree.raise_priority(leaf, priority)
    assert leaf.priority == 0
    tree.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_raise_priority_on_a_removed_node_is_refused(kind):
    tree = make_tree(kind, "priority")
    leaf = tree.insert([1], torch.tensor([0])).last_node
    tree.evict_device(1)
    with pytest.raises(ValueError):
        tree.raise_priority(leaf, 1)
    tree.check_integrity()


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="eviction"):
        CacheConfig(KVConfig(1, 1, 1, page_size=1), device_tokens=4, eviction="random")
    with pytest.raises(ValueError):
        RadixTree(1, "random")
    if "native" in TREE_KINDS:
        with pytest.raises(ValueError, match="fifo"):
            native.load_native().Tree(1, "random")


@pytest.mark.parametrize("tree_kind", KINDS)
@pytest.mark.parametrize("lifecycle", ["python", "auto"])
def test_cache_priority_at_match_and_insert(tree_kind, lifecycle):
    """Through HiCache: a priority given at insert or match orders what alloc evicts."""
    cfg = CacheConfig(
        KVConfig(1, 1, 1, "float32", page_size=1), device_tokens=4, allocate_kv=False,
        eviction="priority", tree=tree_kind, lifecycle=lifecycle,
    )
    cache = HiCache(cfg)
    for tok, prio in ((10, 3), (20, None), (30, 1)):
        h = cache.match([tok])
        cache.alloc(h, 1)
        cache.insert(h, [tok], priority=prio)
        cache.release(h)
    h = cache.match([20], priority=2)  # B: 0 -> 2
    cache.release(h)
    with pytest.raises(TypeError, match="priority"):
        cache.match([40], priority="high")
    with pytest.raises(ValueError, match="priority"):
        cache.match([40], priority=2**63)
    h2 = cache.match([10])
    with pytest.raises(TypeError, match="priority"):
        cache.insert(h2, [10], priority=1.0)
    assert cache.tree.match_prefix([10]).last_node.priority == 3  # nothing changed
    cache.release(h2)
    assert cache.stats()["live_requests"] == 0
    with pytest.raises(ValueError, match="released"):
        cache.insert(h, [20], priority=1)  # released handle: refused before anything
    # 4 pages, 3 cached (priorities A 3, B 2, C 1) + 1 free; ask for 3: takes C then B.
    g = cache.match([50])
    pages = cache.alloc(g, 3)
    assert pages is not None
    assert cache.tree.match_prefix([10]).device_len == 1
    assert cache.tree.match_prefix([20]).device_len == 0
    assert cache.tree.match_prefix([30]).device_len == 0
    cache.release(g)
    assert_no_leaks(cache)
