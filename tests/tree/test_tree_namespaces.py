"""Namespace state is bounded (issue 46, hole 3): the root of a namespace that holds no
node and no lock is freed, on both trees, and the two trees agree on which namespaces
have a root (and in what order: nodes() order, which heap compaction follows).

A namespace's root goes when its last child is removed (eviction), when the last lock
taken on the root itself goes (a request that matched nothing), or by
``prune_namespaces`` (a reset: the roots lookups made and nothing filled). The default
namespace's root stays.
"""

from __future__ import annotations

import random

import pytest
import torch
from kv_layouts import TREE_KINDS

from hicache.components import ComponentSpec
from hicache.tree import IOStatus, make_tree

P = 2
SPECS = (ComponentSpec("window", window_tokens=3), ComponentSpec("state"))


def ids(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def fill(tree, num_namespaces: int, *, host: bool) -> None:
    """Two sequences (a branch) in each of ``num_namespaces`` namespaces; with ``host``,
    each node backed up to host memory too."""
    page = 0
    for i in range(num_namespaces):
        ns = f"tenant-{i}"
        for tail in (7, 8):
            tokens = [i, i, tail, tail]
            comps = [ids(10_000 + page, 2), ids(20_000 + page, 2)] if tree.components else ()
            tree.insert(tokens, ids(page, 2), ns, components=comps)
            page += 2
    if host:
        for node in tree.nodes():
            tree.attach_host(node, ids(50_000 + node.id, node.num_tokens // P))


@pytest.mark.parametrize("tree_kind", TREE_KINDS)
@pytest.mark.parametrize("specs", [(), SPECS], ids=["single", "hybrid"])
@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_evicting_every_page_of_a_namespace_frees_its_root(tree_kind, specs, host):
    tree = make_tree(tree_kind, P, components=specs)
    tree.insert([9, 9], ids(900, 1))  # the default namespace: its root stays
    fill(tree, 40, host=host)
    assert tree.namespaces() == [None] + [f"tenant-{i}" for i in range(40)]
    kept = tree.root("tenant-3")
    tree.lock(kept)  # a request that matched nothing in tenant-3 holds its root
    assert kept.lock_ref == 2
    tree.check_integrity()
    while True:
        dev = tree.evict_device(2**40)
        host_result = tree.evict_host(2**40)
        if not dev.page_ids.shape[0] and not host_result.page_ids.shape[0]:
            break
    assert tree.num_nodes == 0 and tree.device_tokens == 0 and tree.host_tokens == 0
    assert tree.namespaces() == [None, "tenant-3"]
    tree.check_integrity()
    tree.unlock(kept)  # its last lock: the namespace holds nothing, its root goes
    assert tree.namespaces() == [None]
    assert kept.lock_ref == 0 and kept.parent is None
    with pytest.raises(ValueError, match="stale"):
        tree.lock(kept)
    fresh = tree.root("tenant-3")  # a new root for a new use of the name
    assert fresh is not kept and fresh.lock_ref == 1
    assert tree.namespaces() == [None, "tenant-3"]
    tree.check_integrity()


@pytest.mark.parametrize("tree_kind", TREE_KINDS)
def test_prune_namespaces_frees_roots_that_lookups_made(tree_kind):
    tree = make_tree(tree_kind, P)
    for i in range(20):  # a match (no lock taken) makes a root and fills nothing
        assert tree.match_prefix([1, 1], f"ns-{i}").device_len == 0
    tree.insert([1, 1], ids(0, 1), "ns-5")
    held = tree.root("ns-7")
    tree.lock(held)
    assert len(tree.namespaces()) == 20
    assert tree.prune_namespaces() == 18
    assert tree.namespaces() == ["ns-5", "ns-7"]
    assert tree.match_prefix([1, 1], "ns-5").device_len == 2  # kept what it holds
    tree.unlock(held)
    assert tree.namespaces() == ["ns-5"]
    tree.check_integrity()


@pytest.mark.parametrize("tree_kind", TREE_KINDS)
def test_a_lock_on_a_nodes_path_does_not_hold_the_root_past_the_node(tree_kind):
    """Locks of nodes below a root are not root locks: once the node is evicted (after
    its unlock), the namespace holds nothing."""
    tree = make_tree(tree_kind, P)
    node = tree.insert([1, 1, 2, 2], ids(0, 2), "a").last_node
    tree.lock(node)
    assert tree.evict_device(100).num_evicted_tokens == 0
    assert tree.root("a").lock_ref == 1
    tree.unlock(node)
    assert tree.evict_device(100).num_evicted_tokens == 4
    assert tree.namespaces() == []
    tree.check_integrity()


@pytest.mark.parametrize("tree_kind", TREE_KINDS)
def test_io_in_flight_keeps_a_namespace(tree_kind):
    tree = make_tree(tree_kind, P)
    node = tree.insert([1, 1], ids(0, 1), "a").last_node
    tree.attach_host(node, ids(5, 1))
    tree.set_io_status(node, IOStatus.BACKING_UP)
    assert tree.evict_host(100).num_evicted_tokens == 0
    tree.set_io_status(node, IOStatus.NONE)
    assert tree.evict_device(100).num_evicted_tokens == 2  # host-only now: kept
    assert tree.namespaces() == ["a"]
    assert tree.evict_host(100).num_evicted_tokens == 2
    assert tree.namespaces() == []
    tree.check_integrity()


@pytest.mark.skipif("native" not in TREE_KINDS, reason="needs the native tree")
def test_the_native_tree_holds_a_namespace_name_once_and_frees_it():
    """A 1 MiB namespace costs about 1 MiB while it holds pages (not twice), and nothing
    once its pages are evicted; a removed node keeps its namespace's name readable
    after the namespace's index is reused; KV events name the namespace they were
    logged in."""
    tree = make_tree("native", P)
    tree.enable_events()
    tree.insert([0, 0], ids(0, 1))
    base = tree.memory_bytes()
    big = "n" * (1 << 20)
    node = tree.insert([1, 1], ids(1, 1), big).last_node
    grown = tree.memory_bytes() - base
    assert (1 << 20) < grown < (1 << 20) + 4096, grown
    assert tree.evict_device(2**40).num_evicted_tokens == 4
    assert tree.namespaces() == [None]  # the default namespace's root stays
    tree.insert([0, 0], ids(0, 1))
    tree.insert([2, 2], ids(2, 1), "other")  # reuses the freed namespace's index
    assert node.parent is None and node.namespace == big
    stored_ns = [e[2] for e in tree.take_events() if e[0]]
    assert stored_ns == [None, big, None, "other"]
    tree.evict_device(2**40)
    assert tree.memory_bytes() < base + 4096  # (a removed node still readable, slots)
    tree.check_integrity()


@pytest.mark.skipif("native" not in TREE_KINDS, reason="needs the native tree")
@pytest.mark.parametrize("specs", [(), SPECS], ids=["single", "hybrid"])
@pytest.mark.parametrize("seed", range(4))
def test_both_trees_free_the_same_namespaces(specs, seed):
    """Random inserts, locks, host copies and evictions over many namespaces: after
    every step both trees have the same namespaces, in the same order, and the same
    nodes (nodes() order included)."""
    from tree_observation import snapshot

    rng = random.Random(seed)
    trees = [make_tree(kind, P, components=specs) for kind in ("python", "native")]
    locked: list[list] = [[], []]
    page = 0
    for step in range(300):
        op = rng.choice(["insert", "insert", "lock_root", "unlock", "host", "evict_device",
                         "evict_host", "match", "prune"])
        ns = rng.choice([None] + [f"t{i}" for i in range(12)])
        tokens = [rng.randrange(3) for _ in range(rng.choice([2, 4, 6]))]
        num = rng.choice([2, 4, 100])
        which = rng.randrange(1000)
        for t, tree in enumerate(trees):
            if op == "insert":
                n = len(tokens) // P
                comps = ([ids(10_000 + page, n), ids(20_000 + page, n)] if specs else ())
                tree.insert(tokens, ids(page, n), ns, components=comps)
            elif op == "lock_root":
                root = tree.root(ns)
                tree.lock(root)
                locked[t].append(root)
            elif op == "unlock" and locked[t]:
                tree.unlock(locked[t].pop(which % len(locked[t])))
            elif op == "host":
                host_page = 100_000 + 1000 * step  # fresh ids, the same on both trees
                for node in tree.nodes():
                    if node.host_indices is None and (
                            node.parent.parent is None or node.parent.host_indices is not None):
                        tree.attach_host(node, ids(host_page, node.num_tokens // P))
                        host_page += node.num_tokens // P
            elif op == "evict_device":
                tree.evict_device(num)
            elif op == "evict_host":
                tree.evict_host(num)
            elif op == "match":
                tree.match_prefix(tokens, ns)
            elif op == "prune":
                tree.prune_namespaces()
        page += 8
        assert trees[0].namespaces() == trees[1].namespaces(), f"step {step} {op}"
        assert snapshot(trees[0]) == snapshot(trees[1]), f"step {step} {op}"
        for tree in trees:
            tree.check_integrity()
