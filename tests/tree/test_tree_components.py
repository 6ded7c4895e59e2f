"""Hybrid trees: window and state components beside full attention (docs/design.md,
"Hybrid models: components"), on both trees: what an insert keeps (the window tail, the
checkpoints at hit ends), what a match serves, eviction order and cascade, locks,
exact page accounting, and the errors of the component calls.

Page size 2 throughout; a window of 5 tokens reads the 2 pages before a hit.
"""

from __future__ import annotations

import pytest
import torch
from kv_layouts import TREE_KINDS

from hicache.components import ComponentKind, ComponentSpec
from hicache.tree import IOStatus, RadixTree, make_tree, token_key

P = 2
WINDOW = ComponentSpec("window", window_tokens=5)  # w = ceil(4 / 2) = 2 pages
STATE = ComponentSpec("state")


@pytest.fixture(params=TREE_KINDS)
def hybrid(request):
    """``hybrid(*specs, eviction="lru")``: a tree of the parametrized kind with components."""

    def factory(*specs: ComponentSpec, eviction: str = "lru"):
        return make_tree(request.param, P, eviction, components=specs)

    return factory


def ids(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def checkpoints(num_pages: int, at: dict[int, int]) -> torch.Tensor:
    """A state component's ids along a key: ``at`` maps a token count to its checkpoint."""
    out = torch.full((num_pages,), -1, dtype=torch.int64)
    for tokens, page in at.items():
        out[tokens // P - 1] = page
    return out


def seq(n: int, first: int = 0) -> list[int]:
    """``n`` pages of distinct tokens."""
    return list(range(first, first + n * P))


def held(tree, c: int, tier: str = "device") -> dict[int, list[int]]:
    """Component ``c``'s ids per node, keyed by the node's first token (tokens are distinct)."""
    out = {}
    for node in tree.nodes():
        pages = node.component_pages(c, tier)
        if pages is not None:
            out[int(node.tokens()[0])] = pages.tolist()
    return out


# --------------------------------------------------------------------- the spec
def test_component_spec_checks_its_fields():
    assert WINDOW.kind is ComponentKind.WINDOW and WINDOW.window_pages(P) == 2
    assert ComponentSpec("window", window_tokens=2).window_pages(16) == 1
    assert ComponentSpec("window", window_tokens=17).window_pages(16) == 1
    assert ComponentSpec("window", window_tokens=18).window_pages(16) == 2
    assert STATE.window_pages(P) == 0 and STATE.describe() == "state"
    assert ComponentSpec("window", window_tokens=128, width=5).describe() == "window:128x5"
    with pytest.raises(ValueError, match="kind"):
        ComponentSpec("mamba")
    with pytest.raises(ValueError, match=">= 2 tokens"):
        ComponentSpec("window", window_tokens=1)
    with pytest.raises(ValueError, match="no window"):
        ComponentSpec("state", window_tokens=4)
    with pytest.raises(ValueError, match="width"):
        ComponentSpec("state", width=0)
    with pytest.raises(TypeError, match="width"):
        ComponentSpec("state", width=1.5)
    with pytest.raises(TypeError, match="components"):
        make_tree("python", P, components=WINDOW)
    with pytest.raises(TypeError, match=r"components\[1\]"):
        make_tree("python", P, components=[WINDOW, "state"])


def test_a_single_kind_tree_refuses_every_component_index(make_tree):
    tree = make_tree(P)
    tree.insert(seq(2), ids(0, 2))
    node = next(iter(tree.nodes()))
    assert tree.components == () and tree.device_component_evictable_pages == 0
    for call in (
        lambda: tree.num_component_pages(0, "device"),
        lambda: tree.component_table(node, 0, "device"),
        lambda: tree.component_gaps(token_key(seq(2), P), 0, "host"),
        lambda: tree.attach_component(node, 0, "device", ids(9, 2)),
        lambda: tree.detach_component(node, 0, "device"),
        lambda: node.component_pages(0, "device"),
        lambda: tree.insert(seq(2), ids(0, 2), components=[ids(5, 2)]),
    ):
        with pytest.raises(ValueError, match="component"):
            call()
    with pytest.raises(ValueError, match="tier"):
        tree.num_component_pages(0, "disk")
    assert tree.probe_hit_key(token_key(seq(2), P)) == 4
    assert tree.match_prefix(seq(2)).full_len == 4
    tree.check_integrity()


# --------------------------------------------------------------------- insert
def test_insert_keeps_only_the_window_tail(hybrid):
    tree = hybrid(WINDOW)
    res = tree.insert(seq(10), ids(0, 10), components=[ids(100, 10)])
    # A hit at the end reads the 2 pages before it: only those are kept; the node is
    # split there (a window split), the rest of the window's pages come back.
    assert res.unused_pages.tolist() == list(range(100, 108))
    assert held(tree, 0) == {16: [108, 109]}
    assert [n.num_tokens for n in tree.nodes()] == [16, 4]
    assert tree.num_component_pages(0, "device") == 2
    assert tree.device_component_evictable_pages == 2
    assert tree.num_component_pages(0, "host") == 0
    tree.check_integrity()


def test_a_wide_window_keeps_width_ids_per_page(hybrid):
    tree = hybrid(ComponentSpec("window", window_tokens=5, width=3))
    res = tree.insert(seq(4), ids(0, 4), components=[ids(100, 12)])
    assert res.unused_pages.tolist() == list(range(100, 106))
    assert held(tree, 0) == {4: list(range(106, 112))}
    with pytest.raises(ValueError, match="all given or all -1"):
        tree.insert(seq(4, 50), ids(10, 4), components=[torch.tensor([-1, 5, 6] + [-1] * 9)])
    with pytest.raises(ValueError, match="12"):
        tree.insert(seq(4, 50), ids(10, 4), components=[ids(200, 4)])
    tree.check_integrity()


def test_insert_keeps_a_checkpoint_at_the_end_only(hybrid):
    tree = hybrid(STATE)
    res = tree.insert(seq(6), ids(0, 6), components=[checkpoints(6, {4: 50, 12: 51})])
    assert res.unused_pages.tolist() == [50]  # not at a node end
    assert held(tree, 0) == {0: [51]}
    tree.check_integrity()


def test_a_branch_point_gets_its_window_and_checkpoint(hybrid):
    tree = hybrid(WINDOW, STATE)
    a = seq(10)
    tree.insert(a, ids(0, 10), components=[ids(100, 10), checkpoints(10, {20: 500})])
    assert held(tree, 0) == {16: [108, 109]} and held(tree, 1) == {16: [500]}
    # b shares 6 pages: the full match is 12 tokens, but nothing can be served there.
    b = a[:12] + seq(4, 1000)
    m = tree.match_prefix(b)
    assert (m.device_len, m.host_len, m.full_len) == (0, 0, 12)
    # b is computed from 0 and inserted with its window pages and checkpoints at 12 and 20.
    res = tree.insert(b, ids(20, 10), components=[ids(200, 10), checkpoints(10, {12: 600, 20: 601})])
    assert res.num_cached_tokens == 12
    # Kept: the tail before the branch point (pages 4, 5: a window split at 8) and before
    # b's end, and the checkpoints at both ends; a's pages 0-5 are cached already.
    assert held(tree, 0) == {8: [204, 205], 16: [108, 109], 1004: [208, 209]}
    assert held(tree, 1) == {8: [600], 16: [500], 1004: [601]}
    assert sorted(res.unused_pages.tolist()) == [200, 201, 202, 203, 206, 207]
    assert [n.num_tokens for n in tree.path_to(res.last_node)] == [8, 4, 4, 4]
    m = tree.match_prefix(a[:12] + seq(3, 2000))
    assert (m.device_len, m.host_len, m.full_len) == (12, 0, 12)
    tree.check_integrity()


def test_an_end_made_by_a_window_split_keeps_nothing_later(hybrid):
    tree = hybrid(WINDOW)
    tree.insert(seq(6), ids(0, 6), components=[ids(100, 6)])  # nodes [0, 8) and [8, 12)
    # The next turn extends the leaf: its end and the end it hangs from are hit ends;
    # the window split at 8 is not (nothing is kept before 8).
    res = tree.insert(seq(8), ids(10, 8), components=[ids(200, 8)])
    assert held(tree, 0) == {8: [104, 105], 12: [206, 207]}
    assert sorted(res.unused_pages.tolist()) == list(range(200, 206))
    tree.check_integrity()


def test_gaps_name_exactly_what_an_insert_takes(hybrid):
    tree = hybrid(WINDOW, STATE)
    a = seq(8)
    tree.insert(a, ids(0, 8), components=[ids(100, 8), checkpoints(8, {16: 500})])
    b = a[:10] + seq(3, 1000)
    key = token_key(b, P)
    window_gaps = tree.component_gaps(key, 0, "device")
    state_gaps = tree.component_gaps(key, 1, "device")
    assert window_gaps.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert state_gaps.tolist() == [0, 0, 0, 0, 1, 0, 0, 1]
    res = tree.insert(b, ids(20, 8), components=[ids(200, 8), checkpoints(8, {10: 600, 16: 601})])
    taken = set(range(200, 208)) - set(res.unused_pages.tolist())
    assert sorted(taken) == [200 + i for i in range(8) if window_gaps[i]]
    assert 600 not in res.unused_pages.tolist() and 601 not in res.unused_pages.tolist()
    assert not tree.component_gaps(key, 0, "device").any()
    # insert_host keeps host pages only on nodes with a host copy: here the new leaf's.
    assert not tree.component_gaps(key, 0, "host").any()
    other = token_key(a[:10] + seq(3, 3000), P)
    assert tree.component_gaps(other, 0, "host").tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert tree.component_gaps(other, 1, "host").tolist() == [0, 0, 0, 0, 0, 0, 0, 1]
    tree.check_integrity()


# --------------------------------------------------------------------- match
def test_a_match_is_cut_back_to_what_every_component_serves(hybrid):
    tree = hybrid(WINDOW, STATE)
    tree.insert(seq(6), ids(0, 6), components=[ids(100, 6), checkpoints(6, {12: 500})])
    m = tree.match_prefix(seq(6) + [7777])
    assert (m.device_len, m.host_len, m.full_len) == (12, 0, 12)
    assert tree.component_table(m.last_node, 0, "device").tolist() == [-1] * 4 + [104, 105]
    assert tree.component_table(m.last_node, 1, "device").tolist() == [-1] * 5 + [500]
    # Without its checkpoint the end serves nothing (no other end has one).
    assert tree.detach_component(m.last_node, 1, "device").tolist() == [500]
    m = tree.match_prefix(seq(6))
    assert (m.device_len, m.host_len, m.full_len) == (0, 0, 12)
    assert m.last_node is tree.root() and m.last_device_node is tree.root()
    assert tree.probe_hit_key(token_key(seq(6), P)) == 0
    tree.check_integrity()


def test_a_window_hit_near_the_start_reads_what_there_is(hybrid):
    tree = hybrid(ComponentSpec("window", window_tokens=9))  # 4 pages
    tree.insert(seq(2), ids(0, 2), components=[ids(100, 2)])
    m = tree.match_prefix(seq(2) + [5555])
    assert (m.device_len, m.full_len) == (4, 4)  # 2 pages: the whole prefix is the window
    tree.check_integrity()


def test_a_host_hit_is_read_in_each_nodes_tier(hybrid):
    tree = hybrid(WINDOW, STATE)
    res = tree.insert(seq(3), ids(0, 3), components=[ids(100, 3), checkpoints(3, {6: 500})])
    top = res.last_node  # [0, 6): a window split made [0, 2) and [2, 6)
    leaf = tree.insert(seq(4), ids(10, 4), components=[ids(200, 4), checkpoints(4, {8: 600})])
    leaf = leaf.last_node  # [6, 8): shorter than the window, reads [4, 6) of top
    assert held(tree, 0) == {2: [101, 102], 6: [203]}
    tree.attach_host(next(iter(tree.path_to(top))), ids(1000, 1))
    tree.attach_host(top, ids(1001, 2))
    tree.attach_host(leaf, ids(1003, 1))
    tree.attach_component(leaf, 0, "host", ids(1100, 1))
    tree.attach_component(leaf, 1, "host", ids(1200, 1))
    assert tree.detach_device(leaf).tolist() == [13, 203, 600]  # its components follow
    m = tree.match_prefix(seq(4) + [9999])
    # The leaf is host-only: its window pages and checkpoint come from host memory, the
    # window's page before it from top's device copy.
    assert (m.device_len, m.host_len, m.full_len) == (6, 2, 8)
    assert tree.host_only_path(m) == [leaf]
    assert tree.component_table(leaf, 0, "host").tolist() == [-1, -1, -1, 1100]
    # Without top's device window no end serves: not the leaf's (its window reads top's
    # device pages; a host hit loads host-only nodes only), nor top's, nor the one before.
    tree.detach_component(top, 0, "device")
    m = tree.match_prefix(seq(4) + [9999])
    assert (m.device_len, m.host_len, m.full_len) == (0, 0, 8)
    tree.check_integrity()


def test_a_host_hit_loads_only_host_only_nodes_below_device_nodes_serving_nothing(hybrid):
    tree = hybrid(WINDOW, STATE)
    stem = tree.insert(seq(4), ids(0, 4), components=[ids(100, 4), checkpoints(4, {8: 500})])
    leaf = tree.insert(seq(8), ids(10, 8), components=[ids(200, 8), checkpoints(8, {16: 600})])
    stem, leaf = stem.last_node, leaf.last_node  # [4, 8) and [12, 16) hold window and state
    for node, base in [(n, 1000 + 10 * i) for i, n in enumerate(tree.path_to(leaf))]:
        tree.attach_host(node, ids(base, node.num_tokens // P))
        for c in (0, 1):
            device = node.component_pages(c, "device")
            if device is not None:
                tree.attach_component(node, c, "host", ids(base + 5 + 2 * c, device.shape[0]))
    tree.detach_device(leaf)  # the leaf goes host-only, its components with it
    tree.evict_component(1, "device", 1)  # the stem's device checkpoint goes
    m = tree.match_prefix(seq(8) + [7])
    # No end on the device serves now; the leaf's end does, from host memory: a load of
    # the leaf alone (the window before 16 lies within it).
    assert (m.device_len, m.host_len, m.full_len) == (0, 16, 16)
    assert m.last_device_node is tree.root() and m.last_node is leaf
    assert tree.host_only_path(m) == [leaf]
    assert tree.probe_hit_key(token_key(seq(8), P)) == 16
    tree.check_integrity()


# --------------------------------------------------------------------- eviction
def test_eviction_cascades_component_pages_with_the_full_copy(hybrid):
    tree = hybrid(WINDOW, STATE)
    tree.insert(seq(3), ids(0, 3), components=[ids(100, 3), checkpoints(3, {6: 500})])
    res = tree.evict_device(100)
    assert res.page_ids.tolist() == [1, 2, 101, 102, 500, 0]
    assert res.num_evicted_tokens == 6
    assert tree.num_component_pages(0, "device") == tree.num_component_pages(1, "device") == 0
    assert tree.num_nodes == 0
    tree.check_integrity()


def test_data_no_hit_can_use_goes_first(hybrid):
    tree = hybrid(WINDOW, STATE)
    # a's end has no checkpoint: its window pages serve no hit (rank -1).
    tree.insert(seq(3), ids(0, 3), components=[ids(100, 3), None])
    tree.insert(seq(3, 50), ids(10, 3), components=[ids(200, 3), checkpoints(3, {6: 500})])
    res = tree.evict_device(2)  # two page ids: a's window tail, although a is older
    assert res.page_ids.tolist() == [101, 102]
    assert res.num_evicted_tokens == 0
    assert held(tree, 0) == {52: [201, 202]}
    tree.check_integrity()


def test_a_tail_hits_passed_by_goes_before_a_fresh_leaf(hybrid):
    tree = hybrid(WINDOW)
    tree.insert(seq(4), ids(0, 4), components=[ids(100, 4)])  # turn 1: tail [4, 8)
    tree.insert(seq(8), ids(10, 8), components=[ids(200, 8)])  # turn 2 extends it
    for _ in range(3):  # turn 2's end is hit; every match refreshes the whole path
        assert tree.match_prefix(seq(8) + [9]).device_len == 16
    res = tree.evict_device(2)
    assert res.page_ids.tolist() == [102, 103]  # turn 1's tail: no hit read it since
    assert res.num_evicted_tokens == 0 and tree.num_nodes == 4
    tree.check_integrity()


def test_evict_component_takes_one_components_data_in_order(hybrid):
    tree = hybrid(WINDOW, STATE)
    for first in (0, 100, 200):  # three keys, inserted in this order
        tree.insert(seq(2, first), ids(first, 2), components=[ids(first + 50, 2),
                                                              checkpoints(2, {4: first + 90})])
    tree.match_prefix(seq(2, 0) + [7])  # the first key's hit reads its window and checkpoint
    res = tree.evict_component(1, "device", 2)  # the state only, least recently read first
    assert res.page_ids.tolist() == [190, 290] and res.num_evicted_tokens == 0
    assert tree.num_component_pages(0, "device") == 6 and tree.device_tokens == 12
    assert tree.evict_component(1, "host", 5).page_ids.tolist() == []
    with pytest.raises(ValueError, match="tier"):
        tree.evict_component(0, "disk", 1)
    tree.check_integrity()


def test_locks_hold_component_data(hybrid):
    tree = hybrid(WINDOW, STATE)
    res = tree.insert(seq(3), ids(0, 3), components=[ids(100, 3), checkpoints(3, {6: 500})])
    tree.lock(res.last_node)
    assert tree.device_component_evictable_pages == 0
    assert tree.evict_device(100).page_ids.tolist() == []
    with pytest.raises(ValueError, match="unlocked"):
        tree.detach_component(res.last_node, 1, "device")
    tree.unlock(res.last_node)
    assert tree.device_component_evictable_pages == 3
    tree.check_integrity()


def test_host_locks_and_io_hold_host_component_data(hybrid):
    tree = hybrid(STATE)
    res = tree.insert(seq(2), ids(0, 2), components=[checkpoints(2, {4: 500})])
    node = res.last_node
    tree.attach_host(node, ids(10, 2))
    tree.attach_component(node, 0, "host", ids(600, 1))
    assert tree.host_component_takeable_pages == 1
    tree.host_lock(node)
    assert tree.host_component_takeable_pages == 0
    assert tree.evict_host(100).page_ids.tolist() == []
    tree.host_unlock(node)
    tree.set_io_status(node, IOStatus.BACKING_UP)
    assert tree.host_component_takeable_pages == 0
    with pytest.raises(ValueError, match="no IO"):
        tree.detach_component(node, 0, "host")
    tree.set_io_status(node, IOStatus.NONE)
    assert tree.host_component_takeable_pages == 1
    # The node is on the device: its host copy and its host checkpoint both rank 1, as
    # old as each other; full attention goes first in a tie (its tail page, then the
    # checkpoint at its end with it).
    assert tree.evict_host(100, drop_device_resident=False).page_ids.tolist() == []
    assert tree.evict_host(2).page_ids.tolist() == [11, 600]
    tree.check_integrity()


def test_a_host_only_chain_with_component_data_is_not_merged(hybrid):
    tree = hybrid(STATE)
    a = tree.insert(seq(2), ids(0, 2), components=[checkpoints(2, {4: 500})]).last_node
    b = tree.insert(seq(4), ids(10, 4), components=[checkpoints(4, {8: 501})]).last_node
    for node, base in ((a, 100), (b, 200)):
        tree.attach_host(node, ids(base, 2))
        tree.attach_component(node, 0, "host", ids(base + 50, 1))
    assert sorted(tree.evict_device(100).page_ids.tolist()) == [0, 1, 12, 13, 500, 501]
    assert tree.num_nodes == 2  # a's end holds a checkpoint: not merged into b
    m = tree.match_prefix(seq(4))
    assert (m.device_len, m.host_len) == (0, 8)
    tree.check_integrity()


# --------------------------------------------------------------------- one record
def test_attach_and_detach_component_check_their_node(hybrid):
    tree = hybrid(WINDOW, STATE)
    node = tree.insert(seq(2), ids(0, 2)).last_node
    with pytest.raises(ValueError, match="host copy"):
        tree.attach_component(node, 0, "host", ids(10, 2))
    with pytest.raises(ValueError, match="expected 2 page ids"):
        tree.attach_component(node, 0, "device", ids(10, 3))
    with pytest.raises(ValueError, match="expected 1 page ids"):
        tree.attach_component(node, 1, "device", ids(10, 2))
    with pytest.raises(ValueError, match=">= 0"):
        tree.attach_component(node, 1, "device", torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        tree.attach_component(node, 2, "device", ids(10, 1))
    with pytest.raises(ValueError, match="tier"):
        tree.attach_component(node, 0, "disk", ids(10, 2))
    with pytest.raises(ValueError, match="non-root"):
        tree.attach_component(tree.root(), 1, "device", ids(10, 1))
    tree.attach_component(node, 0, "device", ids(10, 2))
    with pytest.raises(ValueError, match="already holds"):
        tree.attach_component(node, 0, "device", ids(20, 2))
    with pytest.raises(ValueError, match="holding component 1"):
        tree.detach_component(node, 1, "device")
    assert tree.num_component_pages(0, "device") == 2
    assert tree.detach_component(node, 0, "device").tolist() == [10, 11]
    assert tree.num_component_pages(0, "device") == 0
    tree.check_integrity()


def test_a_split_divides_window_pages_and_leaves_the_checkpoint_at_the_end(hybrid):
    tree = hybrid(ComponentSpec("window", window_tokens=9), STATE)  # w = 4 pages
    res = tree.insert(seq(4), ids(0, 4), components=[ids(100, 4), checkpoints(4, {8: 500})])
    m = tree.match_prefix(seq(2) + [4444])  # splits [0, 8) at 4
    assert (m.device_len, m.full_len) == (0, 4)  # no checkpoint at 4
    assert held(tree, 0) == {0: [100, 101], 4: [102, 103]}
    assert held(tree, 1) == {4: [500]}
    assert tree.component_table(res.last_node, 0, "device").tolist() == [100, 101, 102, 103]
    tree.check_integrity()


def test_integrity_catches_broken_component_bookkeeping(hybrid):
    tree = hybrid(WINDOW, STATE)
    if not isinstance(tree, RadixTree):
        pytest.skip("corrupts Python records")
    node = tree.insert(seq(2), ids(0, 2), components=[ids(100, 2), checkpoints(2, {4: 5})])
    node = node.last_node
    node.components[1].device = torch.tensor([7])  # same count, other id: still consistent
    tree.check_integrity()
    node.components[1].device = torch.tensor([7, 8])
    with pytest.raises(AssertionError, match="expected 1"):
        tree.check_integrity()
    node.components[1].device = torch.tensor([0])
    with pytest.raises(AssertionError, match="held twice"):
        tree.check_integrity()
    node.components[1].device = torch.tensor([7])
    node.components[0].host = torch.tensor([3, 4])
    with pytest.raises(AssertionError, match="without the node's host copy"):
        tree.check_integrity()


# ------------------------------------------------------------------- bad input (issue 45, 5)
def test_evict_component_clamps_a_huge_count_as_evict_device_does(hybrid):
    """``evict_component(c, tier, 2**64)`` evicts everything it can, on both trees (the
    native one raised pybind's TypeError), as ``evict_device(2**64)`` does."""
    tree = hybrid(WINDOW, STATE)
    tree.insert(seq(2), ids(0, 2), components=[ids(100, 2), checkpoints(2, {4: 5})])
    tree.insert(seq(2, 10), ids(2, 2), components=[ids(102, 2), checkpoints(2, {4: 6})])
    for n in (2**63, 2**64, 10**30):
        assert tree.evict_component(1, "host", n).page_ids.tolist() == []
    result = tree.evict_component(0, "device", 2**64)
    assert sorted(result.page_ids.tolist()) == [100, 101, 102, 103]
    assert result.num_evicted_tokens == 0 and tree.num_component_pages(0, "device") == 0
    assert tree.num_component_pages(1, "device") == 2 and tree.device_tokens == 8
    for bad, exc in ((-1, ValueError), (-(2**64), ValueError), (1.5, TypeError),
                     (True, TypeError), ("3", TypeError), (None, TypeError)):
        with pytest.raises(exc, match="num_pages"):
            tree.evict_component(1, "device", bad)
    tree.check_integrity()


def test_probe_hit_key_refuses_an_unhashable_namespace(hybrid):
    """``probe_hit_key(key, [])``: TypeError on both trees (the native hybrid tree skipped
    the namespace check and returned 0); a namespace that names no root probes 0."""
    for tree in (hybrid(WINDOW, STATE), hybrid()):
        key = token_key(seq(2), P)
        tree.insert_key(key, ids(0, 2), "a")
        for bad in ([], {}, {"a": 1}, bytearray(b"a")):
            with pytest.raises(TypeError):
                tree.probe_hit_key(key, bad)  # type: ignore[arg-type]
        for other in (5, b"a", "\ud800", "b", None):
            assert tree.probe_hit_key(key, other) == 0  # type: ignore[arg-type]
        assert tree.probe_hit_key(key, "a") == (0 if tree.components else 4)
        tree.check_integrity()


def bad_component_calls(tree, node, key: bytes) -> list[tuple[str, object]]:
    """Every component call of the tree protocol with bad counts, components, tiers,
    namespaces and page ids: ``(name, call)``, each call taking no argument."""
    import itertools

    import numpy as np

    counter = itertools.count(1000, 4)

    def fresh(n: int) -> torch.Tensor:  # page ids held nowhere yet (drawn as calls run)
        return ids(next(counter), n)

    calls: list[tuple[str, object]] = []
    for c in (-1, 2, 99, True, 1.0, "0", None, 2**64, np.int64(0)):
        calls += [
            (f"num_component_pages({c!r})", lambda c=c: tree.num_component_pages(c, "device")),
            (f"component_table({c!r})", lambda c=c: tree.component_table(node, c, "device")),
            (f"component_gaps({c!r})", lambda c=c: tree.component_gaps(key, c, "device")),
            (f"attach_component({c!r})", lambda c=c: tree.attach_component(node, c, "host", ids(7, 1))),
            (f"detach_component({c!r})", lambda c=c: tree.detach_component(node, c, "device")),
            (f"evict_component({c!r})", lambda c=c: tree.evict_component(c, "device", 1)),
        ]
    for tier in ("gpu", None, 0, "Device", b"device"):
        calls += [
            (f"num_component_pages({tier!r})", lambda t=tier: tree.num_component_pages(0, t)),
            (f"component_table({tier!r})", lambda t=tier: tree.component_table(node, 0, t)),
            (f"component_gaps({tier!r})", lambda t=tier: tree.component_gaps(key, 0, t)),
            (f"attach_component({tier!r})", lambda t=tier: tree.attach_component(node, 0, t, ids(7, 2))),
            (f"detach_component({tier!r})", lambda t=tier: tree.detach_component(node, 0, t)),
            (f"evict_component({tier!r})", lambda t=tier: tree.evict_component(0, t, 1)),
        ]
    for n in (-1, -(2**64), True, 1.5, "3", None):
        calls += [
            (f"evict_component(n={n!r})", lambda n=n: tree.evict_component(0, "device", n)),
            (f"evict_device({n!r})", lambda n=n: tree.evict_device(n)),
            (f"evict_host({n!r})", lambda n=n: tree.evict_host(n)),
            (f"path_missing_host({n!r})", lambda n=n: tree.path_missing_host(node, n)),
        ]
    for ns in ([], {}, 5, b"x", "\ud800", 1.5, ("a",)):
        calls += [
            (f"probe_hit_key({ns!r})", lambda ns=ns: tree.probe_hit_key(key, ns)),
            (f"probe_key({ns!r})", lambda ns=ns: tree.probe_key(key, ns)),
            (f"probe_path({ns!r})", lambda ns=ns: tree.probe_path(key, ns)),
            (f"component_gaps(ns={ns!r})", lambda ns=ns: tree.component_gaps(key, 0, "device", ns)),
            (f"match_key({ns!r})", lambda ns=ns: tree.match_key(key, ns)),
            (f"insert_key({ns!r})", lambda ns=ns: tree.insert_key(key, fresh(2), ns)),
            (f"insert_host({ns!r})", lambda ns=ns: tree.insert_host(seq(2), fresh(2), ns)),
        ]
    other = token_key(seq(2, 50), P)
    for pages in (ids(7, 3), torch.tensor([7], dtype=torch.int32), torch.tensor([-1]),
                  torch.tensor([[7]]), [7], None, torch.tensor([-2])):
        calls.append((f"attach_component(pages={pages!r})",
                      lambda p=pages: tree.attach_component(node, 1, "device", p)))
    for comps in (ids(1, 2), [ids(5, 2)], [ids(5, 2), None, None], [None, torch.tensor([-1, 900])],
                  [torch.tensor([-1, 901], dtype=torch.int32), None], [torch.tensor([-1, -3]), None],
                  "ab", [None, torch.tensor([-1, -1])]):
        calls += [
            (f"insert_key(components={comps!r})",
             lambda cs=comps: tree.insert_key(other, fresh(2), None, components=cs)),
            (f"insert_host(components={comps!r})",
             lambda cs=comps: tree.insert_host(seq(2, 50), fresh(2), None, components=cs)),
        ]
    return calls


def outcome(call) -> tuple[object, ...]:
    """What a call did, comparable across trees: the exception's type and message, or
    the result with nodes and tensors as plain values."""
    def plain(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return v.tolist()
        if hasattr(v, "num_tokens") and hasattr(v, "parent"):  # a node
            return ("node", v.num_tokens, v.on_device, v.on_host)
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        return v

    try:
        return ("ok", plain(call()))
    except Exception as exc:  # noqa: BLE001 (compared across trees)
        return ("raised", type(exc).__name__, str(exc))


@pytest.mark.skipif("native" not in TREE_KINDS, reason="needs the native tree")
@pytest.mark.parametrize("specs", [(WINDOW, STATE), ()], ids=["hybrid", "single"])
def test_both_trees_raise_the_same_on_bad_component_calls(specs):
    """Issue 45 case 5: the same bad input gets the same exception type and message
    from both trees (or the same result), and leaves both consistent."""
    def build(kind):
        tree = make_tree(kind, P, components=specs)
        comps = [ids(100, 2), checkpoints(2, {4: 5})] if specs else ()
        node = tree.insert(seq(2), ids(0, 2), components=comps).last_node
        return tree, node, token_key(seq(2), P)

    py, native = build("python"), build("native")
    calls = zip(bad_component_calls(*py), bad_component_calls(*native), strict=True)
    for (name, call_py), (_, call_native) in calls:
        a, b = outcome(call_py), outcome(call_native)
        assert a == b, f"{name}: Python tree {a}, native tree {b}"
        py[0].check_integrity()
        native[0].check_integrity()
    assert py[0].num_nodes == native[0].num_nodes
