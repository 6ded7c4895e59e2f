"""Radix tree: matching, splitting, insertion, locks, eviction order, tiers, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_layouts import pages

from hicache.tree import IOStatus


def sizes(tree):
    return (
        tree.device_evictable_tokens,
        tree.device_protected_tokens,
        tree.host_evictable_tokens,
        tree.host_protected_tokens,
        tree.num_nodes,
    )


def test_empty_tree_match(make_tree):
    tree = make_tree(2)
    m = tree.match_prefix([1, 2, 3, 4])
    assert (m.device_len, m.host_len) == (0, 0)
    assert m.last_node is tree.root() and m.last_device_node is tree.root()
    tree.check_integrity()


def test_insert_then_match_exact_accounting(make_tree):
    tree = make_tree(2)
    res = tree.insert([1, 2, 3, 4, 5, 6], pages(10, 11, 12))
    assert res.num_cached_tokens == 0
    assert sizes(tree) == (6, 0, 0, 0, 1)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.device_len, m.host_len) == (6, 0)
    assert tree.device_indices_of(m.last_device_node).tolist() == [10, 11, 12]
    # A request's page table: the cached prefix, then its new pages.
    assert tree.device_indices_of(m.last_device_node, pages(3, 4)).tolist() == [10, 11, 12, 3, 4]
    assert tree.device_indices_of(tree.root(), pages(5)).tolist() == [5]
    with pytest.raises(TypeError, match="extra"):
        tree.device_indices_of(m.last_device_node, [3])
    with pytest.raises(TypeError, match="extra"):
        tree.device_indices_of(m.last_device_node, torch.tensor([3], dtype=torch.int32))
    tree.check_integrity()


def test_partial_last_page_never_cached(make_tree):
    tree = make_tree(4)
    tree.insert([1, 2, 3, 4, 5, 6], pages(7))  # 6 tokens: one whole page of 4
    assert tree.device_tokens == 4
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_len == 4
    assert tree.match_prefix([1, 2, 3]).device_len == 0  # shorter than a page
    assert tree.match_prefix([]).device_len == 0  # empty prompt
    tree.check_integrity()


def test_match_ending_mid_node_splits_by_index_slicing(make_tree):
    tree = make_tree(2)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], pages(0, 1, 2, 3))
    m = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.device_len == 4
    assert tree.num_nodes == 2
    assert tree.device_indices_of(m.last_node).tolist() == [0, 1]
    assert m.last_node.num_tokens == 4
    # the rest of the run stayed where it was
    full = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert full.device_len == 8
    assert tree.device_indices_of(full.last_node).tolist() == [0, 1, 2, 3]
    tree.check_integrity()


def test_match_diverging_mid_page_counts_whole_pages_only(make_tree):
    tree = make_tree(4)
    tree.insert(list(range(1, 13)), pages(0, 1, 2))
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    assert m.device_len == 4
    tree.check_integrity()


def test_insert_returns_cached_prefix_and_branches(make_tree):
    tree = make_tree(2)
    tree.insert([1, 2, 3, 4], pages(0, 1))
    res = tree.insert([1, 2, 3, 4, 5, 6], pages(7, 8, 2))
    assert res.num_cached_tokens == 4  # pages 7, 8 were not taken: the caller frees them
    res = tree.insert([1, 2, 9, 9], pages(0, 3))
    assert res.num_cached_tokens == 2
    assert tree.num_nodes == 4  # [1,2] -> {[3,4] -> [5,6], [9,9]}
    assert tree.device_tokens == 8
    m = tree.match_prefix([1, 2, 9, 9])
    assert tree.device_indices_of(m.last_node).tolist() == [0, 3]
    tree.check_integrity()


def test_children_keyed_by_first_page(make_tree):
    tree = make_tree(2)
    tree.insert([1, 2, 3, 4], pages(0, 1))
    tree.insert([1, 3, 3, 4], pages(2, 3))  # differs inside the first page: a new child
    assert tree.num_nodes == 2
    assert tree.match_prefix([1, 3]).device_len == 2
    tree.check_integrity()


def test_accepts_numpy_and_tensors(make_tree):
    tree = make_tree(2)
    tree.insert(np.array([1, 2, 3, 4], dtype=np.int64), pages(0, 1))
    assert tree.match_prefix(torch.tensor([1, 2, 3, 4], dtype=torch.int32)).device_len == 4
    assert tree.match_prefix(np.array([1, 2, 3, 4], dtype=np.int32)).device_len == 4
    tree.check_integrity()


def test_lru_eviction_order_exact(make_tree):
    tree = make_tree(2)
    tree.insert([1, 1], pages(0))
    tree.insert([2, 2], pages(1))
    tree.insert([3, 3], pages(2))
    tree.match_prefix([1, 1])  # now 2 is the least recently used, then 3
    res = tree.evict_device(2)
    assert res.page_ids.tolist() == [1]
    res = tree.evict_device(4)
    assert res.page_ids.tolist() == [2, 0]
    assert res.num_evicted_tokens == 4
    assert sizes(tree) == (0, 0, 0, 0, 0)
    tree.check_integrity()


def test_lfu_eviction_order_exact(make_tree):
    tree = make_tree(2, "lfu")
    tree.insert([1, 1], pages(0))
    tree.insert([2, 2], pages(1))
    for _ in range(3):
        tree.match_prefix([1, 1])
    tree.match_prefix([2, 2])  # most recent, but fewer hits
    assert tree.evict_device(2).page_ids.tolist() == [1]
    tree.check_integrity()


def test_leaf_first_parent_becomes_candidate(make_tree):
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], pages(0, 1))
    tree.insert([1, 1, 3, 3], pages(0, 2))  # node [1,1] is the parent of two leaves
    tree.insert([9, 9], pages(3))
    # order of access: [1,1,*] leaves at ticks 1, 2; [9,9] at tick 3
    res = tree.evict_device(6)
    assert res.page_ids.tolist() == [1, 2, 0]
    assert tree.device_tokens == 2
    tree.check_integrity()


def test_locked_path_is_not_evicted(make_tree):
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], pages(0, 1))
    tree.insert([5, 5], pages(2))
    m = tree.match_prefix([1, 1, 2, 2])
    tree.lock(m.last_node)
    assert sizes(tree)[:2] == (2, 4)
    res = tree.evict_device(100)
    assert res.page_ids.tolist() == [2]
    tree.unlock(m.last_node)
    assert sizes(tree)[:2] == (4, 0)
    assert tree.evict_device(100).page_ids.tolist() == [0, 1]
    tree.check_integrity()


def test_partial_leaf_eviction_does_not_over_evict(make_tree):
    tree = make_tree(2)
    tree.insert(list(range(20)), pages(*range(10)))
    res = tree.evict_device(3)  # two pages: the tail of the leaf
    assert res.page_ids.tolist() == [8, 9]
    assert res.num_evicted_tokens == 4
    assert tree.device_tokens == 16
    assert tree.match_prefix(list(range(20))).device_len == 16
    tree.check_integrity()


def test_evict_zero_and_empty(make_tree):
    tree = make_tree(2)
    assert tree.evict_device(0).num_evicted_tokens == 0
    assert tree.evict_device(10).page_ids.tolist() == []
    assert tree.evict_host(10).page_ids.tolist() == []
    tree.check_integrity()


def test_host_copy_keeps_evicted_node_matchable(make_tree):
    tree = make_tree(2)
    node = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(node, pages(5, 6))
    assert sizes(tree) == (4, 0, 4, 0, 1)
    res = tree.evict_device(4)
    assert res.page_ids.tolist() == [0, 1]
    m = tree.match_prefix([1, 1, 2, 2, 3, 3])
    assert (m.device_len, m.host_len) == (0, 4)
    assert tree.host_only_path(m) == [m.last_node]
    assert m.last_node.host_indices.tolist() == [5, 6]
    assert sizes(tree) == (0, 0, 4, 0, 1)
    tree.check_integrity()


def test_insert_revives_host_only_nodes(make_tree):
    tree = make_tree(2)
    node = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(node, pages(5, 6))
    tree.evict_device(4)
    res = tree.insert([1, 1, 2, 2, 3, 3], pages(7, 8, 9))
    assert res.num_cached_tokens == 0  # nothing was on the device: all pages taken
    m = tree.match_prefix([1, 1, 2, 2, 3, 3])
    assert (m.device_len, m.host_len) == (6, 0)
    assert tree.device_indices_of(m.last_node).tolist() == [7, 8, 9]
    tree.check_integrity()


def test_device_node_without_host_copy_but_host_children_is_kept(make_tree):
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], pages(0, 1))
    m = tree.match_prefix([1, 1])  # split: [1,1] -> [2,2]
    child = tree.match_prefix([1, 1, 2, 2]).last_node
    tree.attach_host(child, pages(4))
    res = tree.evict_device(4)
    # the child goes host-only; the parent has no host copy and a child, so it stays
    assert res.page_ids.tolist() == [1]
    assert m.last_node.on_device
    tree.check_integrity()
    # write-back hook: offered the parent, it declines -> still kept
    offered = []
    res = tree.evict_device(2, backup=lambda n: offered.append(n) or False)
    assert offered == [m.last_node] and res.num_evicted_tokens == 0
    tree.check_integrity()


def test_backup_hook_counts_pending_tokens(make_tree):
    tree = make_tree(2)
    node = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node

    def hook(n):
        tree.attach_host(n, pages(3, 4))
        tree.set_io_status(n, IOStatus.BACKING_UP)
        return True

    res = tree.evict_device(4, backup=hook)
    assert (res.num_evicted_tokens, res.num_backup_tokens) == (0, 4)
    assert tree.evict_device(4).num_evicted_tokens == 0  # IO in flight: skipped
    tree.set_io_status(node, IOStatus.NONE)
    assert tree.detach_device(node).tolist() == [0, 1]
    tree.check_integrity()


def test_io_in_flight_is_skipped_by_both_tiers(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1], pages(0)).last_node
    b = tree.insert([2, 2], pages(1)).last_node
    tree.attach_host(a, pages(0))
    tree.attach_host(b, pages(1))
    tree.set_io_status(a, IOStatus.BACKING_UP)
    assert tree.evict_device(4).page_ids.tolist() == [1]
    assert tree.evict_host(4).page_ids.tolist() == [1]  # b host-only, removed
    tree.set_io_status(a, IOStatus.NONE)
    assert tree.evict_device(2).page_ids.tolist() == [0]
    tree.check_integrity()


def test_host_eviction_prefers_host_only_then_drops_device_resident_copies(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1], pages(0)).last_node
    b = tree.insert([2, 2], pages(1)).last_node
    tree.attach_host(a, pages(10))
    tree.attach_host(b, pages(11))
    tree.evict_device(2)  # a (oldest) goes host-only
    assert tree.match_prefix([2, 2]).device_len == 2
    res = tree.evict_host(2, drop_device_resident=False)
    assert res.page_ids.tolist() == [10]
    assert tree.evict_host(2, drop_device_resident=False).num_evicted_tokens == 0
    res = tree.evict_host(2)
    assert res.page_ids.tolist() == [11]
    assert b.on_device and not b.on_host
    assert sizes(tree) == (2, 0, 0, 0, 1)
    tree.check_integrity()


def test_host_eviction_takes_a_host_copy_whose_children_are_device_only(make_tree):
    # a is on both tiers, its only child c on the device alone: a's host copy is a
    # candidate though a has a child (host copies stay closed under ancestors).
    tree = make_tree(2)
    a = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(a, pages(10, 11))
    c = tree.insert([1, 1, 2, 2, 3, 3], pages(0, 1, 2)).last_node  # touches a
    leaf = tree.insert([5, 5], pages(3)).last_node
    tree.attach_host(leaf, pages(12))
    assert tree.host_takeable_tokens == 6
    tree.check_integrity()
    res = tree.evict_host(2)  # a least recent: its tail page goes (a split)
    assert res.page_ids.tolist() == [11] and res.num_evicted_tokens == 2
    head = tree.match_prefix([1, 1]).last_node  # the split's head: host copy kept
    assert head.on_host and not tree.match_prefix([1, 1, 2, 2]).last_node.on_host
    assert tree.host_takeable_tokens == 4
    tree.check_integrity()
    # The head just became a candidate (its child lost its copy); match touched it last.
    assert tree.evict_host(4).page_ids.tolist() == [12, 10]
    assert (tree.host_tokens, tree.host_takeable_tokens) == (0, 0)
    assert c.on_device and tree.device_tokens == 8  # device copies untouched
    tree.check_integrity()


def test_host_eviction_takes_children_first_and_never_what_a_lock_holds(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1], pages(0)).last_node
    tree.attach_host(a, pages(10))
    b = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(b, pages(11))
    tree.match_prefix([1, 1])  # a most recent: still b first (a has a host child)
    for hold, release in (
        (tree.host_lock, tree.host_unlock),
        (lambda n: tree.set_io_status(n, IOStatus.BACKING_UP),
         lambda n: tree.set_io_status(n, IOStatus.NONE)),
    ):
        hold(b)  # holds b's host copy and a's above it
        assert tree.host_takeable_tokens == 0
        assert tree.evict_host(4).num_evicted_tokens == 0
        tree.check_integrity()
        release(b)
        assert tree.host_takeable_tokens == 4
    assert tree.evict_host(2).page_ids.tolist() == [11]
    assert tree.host_takeable_tokens == 2  # a: its only child lost its host copy
    tree.check_integrity()
    assert tree.evict_host(2).page_ids.tolist() == [10]
    assert a.on_device and b.on_device and tree.host_tokens == 0
    tree.check_integrity()


def test_host_takeable_tokens_follows_splits_merges_and_detaches(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(a, pages(10, 11))
    b = tree.insert([1, 1, 2, 2, 3, 3], pages(0, 1, 2)).last_node
    tree.attach_host(b, pages(12))
    tree.set_io_status(b, IOStatus.BACKING_UP)
    tree.match_prefix([1, 1])  # splits a; both halves held by b's IO
    assert (tree.host_tokens, tree.host_takeable_tokens) == (6, 0)
    tree.check_integrity()
    assert tree.detach_host(b).tolist() == [12]  # the backup failed: IO over
    assert tree.host_takeable_tokens == 4
    tree.evict_device(6)  # b removed, then both halves host-only (merged again)
    assert tree.num_nodes == 1 and tree.host_takeable_tokens == 4
    tree.check_integrity()
    tree.host_lock(tree.match_prefix([1, 1, 2, 2]).last_node)
    assert tree.host_takeable_tokens == 0
    tree.check_integrity()


def test_host_lock_protects_host_copy(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1], pages(0)).last_node
    tree.attach_host(a, pages(3))
    tree.evict_device(2)
    tree.host_lock(a)
    assert sizes(tree)[2:4] == (0, 2)
    assert tree.evict_host(2).num_evicted_tokens == 0
    tree.host_unlock(a)
    assert tree.evict_host(2).page_ids.tolist() == [3]
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_split_of_node_with_io_in_flight_reports_both_halves(make_tree):
    splits = []
    tree = make_tree(2, on_split=lambda prefix, suffix: splits.append((prefix, suffix)))
    node = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(node, pages(7, 8))
    tree.set_io_status(node, IOStatus.BACKING_UP)
    m = tree.match_prefix([1, 1, 5, 5])
    assert splits == [(m.last_node, node)]
    assert m.last_node.io_status is IOStatus.BACKING_UP
    assert m.last_node.host_indices.tolist() == [7] and node.host_indices.tolist() == [8]
    tree.check_integrity()


def test_namespaces_never_share_nodes(make_tree):
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], pages(0, 1), namespace="a")
    assert tree.match_prefix([1, 1, 2, 2]).device_len == 0
    assert tree.match_prefix([1, 1, 2, 2], namespace="b").device_len == 0
    assert tree.match_prefix([1, 1, 2, 2], namespace="a").device_len == 4
    res = tree.insert([1, 1, 2, 2], pages(2, 3), namespace="b")
    assert res.num_cached_tokens == 0
    assert tree.device_tokens == 8
    tree.check_integrity()


def test_stale_node_is_rejected(make_tree):
    tree = make_tree(2)
    node = tree.insert([1, 1], pages(0)).last_node
    tree.evict_device(2)
    with pytest.raises(ValueError):
        tree.lock(node)
    tree.check_integrity()


@pytest.mark.parametrize(
    "tokens, exc",
    [
        ([1, 2.5], TypeError),
        (["a", "b"], TypeError),
        ([1, -2], ValueError),
        ([1, 2**40], ValueError),
        (np.array([1.0, 2.0]), TypeError),
        (np.array([[1, 2]]), ValueError),
        (torch.tensor([1.0, 2.0]), TypeError),
        ("12", TypeError),
        (None, TypeError),
    ],
)
def test_bad_tokens_raise_and_leave_tree_unchanged(make_tree, tokens, exc):
    tree = make_tree(2)
    tree.insert([1, 1], pages(0))
    before = sizes(tree)
    with pytest.raises(exc):
        tree.match_prefix(tokens)
    with pytest.raises(exc):
        tree.insert(tokens, pages(1))
    assert sizes(tree) == before
    tree.check_integrity()


@pytest.mark.parametrize(
    "indices, exc",
    [
        (pages(1), ValueError),  # wrong length
        (torch.tensor([1, 2], dtype=torch.int32), TypeError),
        ([1, 2], TypeError),
        (torch.tensor([[1, 2]]), ValueError),  # a shape mistake (hicache.checks)
    ],
)
def test_bad_indices_raise_and_leave_tree_unchanged(make_tree, indices, exc):
    tree = make_tree(2)
    before = sizes(tree)
    with pytest.raises(exc):
        tree.insert([1, 1, 2, 2], indices)
    assert sizes(tree) == before
    tree.check_integrity()


def test_bad_lock_unlock_and_counts(make_tree):
    tree = make_tree(2)
    node = tree.insert([1, 1], pages(0)).last_node
    before = sizes(tree)
    with pytest.raises(ValueError):
        tree.unlock(node)
    with pytest.raises(ValueError):
        tree.evict_device(-1)
    with pytest.raises(TypeError):
        tree.evict_device(1.5)
    with pytest.raises(ValueError):
        tree.evict_host(-3)
    with pytest.raises(ValueError):
        tree.host_unlock(node)
    with pytest.raises(TypeError):
        tree.match_prefix([1, 1], namespace=3)
    assert sizes(tree) == before
    tree.check_integrity()


def corrupt_counter(tree, name: str, delta: int) -> None:
    """Change a size counter without bookkeeping (the native tree: through its binding)."""
    target = getattr(tree, "_impl", tree)
    setattr(target, name, getattr(target, name) + delta)


def corrupt_lock_ref(tree, node, value: int) -> None:
    """Overwrite a node's lock count without bookkeeping (the binding's test-only entry)."""
    if hasattr(tree, "_impl"):
        tree._impl.set_lock_ref(node._h, value)
    else:
        node.lock_ref = value


def test_check_integrity_catches_corruption(make_tree):
    tree = make_tree(2)
    node = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    tree.attach_host(node, pages(5, 6))
    tree.check_integrity()
    for name in ("device_evictable_tokens", "host_takeable_tokens"):
        corrupt_counter(tree, name, 2)
        with pytest.raises(AssertionError, match=name):
            tree.check_integrity()
        corrupt_counter(tree, name, -2)
    tree.check_integrity()
    corrupt_lock_ref(tree, node, -1)
    with pytest.raises(AssertionError, match="negative lock"):
        tree.check_integrity()


def test_insert_host_adds_host_only_leaf_below_cached_prefix(make_tree):
    tree = make_tree(2)
    tree.insert([1, 1, 2, 2], pages(0, 1))
    res = tree.insert_host([1, 1, 2, 2, 3, 3, 4, 4], pages(10, 11, 12, 13))
    assert res.num_cached_tokens == 4  # host pages 10, 11 not taken: the caller frees them
    m = tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4])
    assert (m.device_len, m.host_len) == (4, 4)
    assert m.last_node.host_indices.tolist() == [12, 13]
    assert sizes(tree) == (4, 0, 4, 0, 2)
    assert tree.insert_host([1, 1, 2, 2, 3, 3], pages(20, 21, 22)).num_cached_tokens == 6
    with pytest.raises(ValueError):
        tree.insert_host([5, 5], pages(1, 2))
    assert tree.evict_host(4).page_ids.tolist() == [13, 12]  # split above: leaf first
    tree.check_integrity()


def test_probe_is_read_only(make_tree):
    from hicache.tree import token_key

    tree = make_tree(2)
    tree.insert([1, 1, 2, 2, 3, 3], pages(0, 1, 2))
    nodes_before = tree.num_nodes
    assert tree.probe_key(token_key([1, 1, 2, 2, 9, 9], 2)) == 4  # ends mid-node: no split
    assert tree.probe_key(token_key([1, 1, 2, 2, 3, 3, 4, 4], 2)) == 6
    assert tree.probe_key(token_key([5, 5], 2), namespace="other") == 0
    (node,) = tree.probe_path(token_key([1, 1, 2, 2, 9, 9], 2))  # the node holding the prefix
    assert node.num_tokens == 6 and tree.probe_path(token_key([5, 5], 2)) == []
    assert tree.probe_path(token_key([1, 1], 2), namespace="other") == []
    assert tree.num_nodes == nodes_before
    m = tree.match_prefix([1, 1])
    assert m.last_node.hit_count == 1  # the probes counted no hits
    tree.check_integrity()


def test_evicted_chain_merges_into_one_host_only_node(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1], pages(0)).last_node
    b = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    c = tree.insert([1, 1, 2, 2, 3, 3], pages(0, 1, 2)).last_node
    for node, host in ((a, 10), (b, 11), (c, 12)):
        tree.attach_host(node, pages(host))
    assert tree.num_nodes == 3
    res = tree.evict_device(6)
    assert res.page_ids.tolist() == [2, 1, 0]  # leaf first
    assert tree.num_nodes == 1
    m = tree.match_prefix([1, 1, 2, 2, 3, 3])
    assert (m.device_len, m.host_len) == (0, 6)
    assert m.last_node.host_indices.tolist() == [10, 11, 12]
    assert tree.evict_host(2).page_ids.tolist() == [12]  # tail of the merged node
    tree.check_integrity()


def test_path_missing_host_lists_what_a_backup_would_copy(make_tree):
    tree = make_tree(2)
    a = tree.insert([1, 1], pages(0)).last_node
    b = tree.insert([1, 1, 2, 2], pages(0, 1)).last_node
    c = tree.insert([1, 1, 2, 2, 3, 3], pages(0, 1, 2)).last_node
    assert tree.path_missing_host(c) == [a, b, c]
    tree.attach_host(b, pages(7))
    assert tree.path_missing_host(c) == [a, c]
    tree.attach_host(c, pages(8))
    tree.set_io_status(c, IOStatus.BACKING_UP)  # in flight: not listed
    assert tree.path_missing_host(c) == [a]
    tree.set_io_status(c, IOStatus.NONE)
    tree.match_prefix([1, 1, 2, 2, 3, 3])  # one more hit on the whole path
    assert tree.path_missing_host(c, min_hit_count=1) == [a]
    assert tree.path_missing_host(c, min_hit_count=2) == []
    assert tree.path_missing_host(tree.root()) == []
    with pytest.raises(ValueError):
        tree.path_missing_host(c, -1)
    with pytest.raises(TypeError):
        tree.path_missing_host(c, 1.5)
    tree.check_integrity()
