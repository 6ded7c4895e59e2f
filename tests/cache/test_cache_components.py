"""HiCache over a hybrid KV layout (kv.components): a request's window and state pages,
what insert hands the tree, loads and backups that move component pages with full pages
(bitwise), failures, budgets, and exact page accounting, on both trees.

Layout: 2 layers per page (the full-attention layers), page size 2; a window component
of 3 tokens (1 page before a hit) and a state component of width 2.
"""

from __future__ import annotations

import pytest
import torch
from kv_layouts import TREE_KINDS
from leak_checks import assert_quiescent, finish_transfers

from hicache.cache import HiCache
from hicache.components import ComponentSpec
from hicache.config import CacheConfig, KVConfig

P = 2
SPECS = (ComponentSpec("window", window_tokens=3), ComponentSpec("state", width=2))
KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=P,
              components=SPECS)
W, S = 0, 1  # component indices
TREE = "python"


@pytest.fixture(autouse=True, params=TREE_KINDS)
def _tree_kind(request):
    global TREE
    TREE = request.param


def make(device_tokens=40, host_tokens=80, executor="thread", **kw) -> HiCache:
    kw.setdefault("tree", TREE)
    return HiCache(CacheConfig(KV, device_tokens=device_tokens, host_tokens=host_tokens,
                               executor=executor, **kw))


def fill(cache: HiCache, page: int, value: float) -> None:
    """Write ``value`` (+ the layer) into every slot of device page ``page``."""
    for layer in range(KV.num_layers):
        rows = torch.full((P, 1, 4), float(value + layer))
        cache.device_pool.write_pages(layer, torch.tensor([page]), rows, -rows)


def read(cache: HiCache, page: int) -> float:
    k, _ = cache.device_pool.read_pages(0, torch.tensor([page]))
    return float(k[0, 0, 0])


def window_value(tokens: list[int], page: int) -> float:
    """What a request writes into its window page for page ``page`` of ``tokens``."""
    return 10_000 + 100 * page + sum(tokens[: (page + 1) * P])


def state_value(tokens: list[int], length: int, group: int) -> float:
    """The recurrent state after ``length`` tokens, in state group ``group``."""
    return 50_000 + 7 * length + 1000 * group + sum(tokens[:length])


def serve(cache: HiCache, tokens: list[int], *, check: bool = True):
    """One request: check the prefix's window page and checkpoint bitwise, write its own,
    insert with a checkpoint at the inserted length and at the full match."""
    h = cache.match(tokens + [0])  # the last token is always computed
    h.wait()
    n = h.prefix_len
    if check and n:
        table = h.window_table(W)
        assert read(cache, int(table[n // P - 1, 0])) == window_value(tokens, n // P - 1)
        state = h.state_pages(S)
        for g in range(2):
            assert read(cache, int(state.read[g])) == state_value(tokens, n, g)
    end = len(tokens) // P * P
    marks = {pos for pos in (end, h.full_len) if n < pos <= end}
    assert cache.alloc(h, len(tokens) - n, checkpoints=marks) is not None
    table = h.window_table(W)
    for page in range(n // P, end // P):
        fill(cache, int(table[page, 0]), window_value(tokens, page))
    state = h.state_pages(S)
    for pos, ids in state.checkpoints.items():
        for g in range(2):
            fill(cache, int(ids[g]), state_value(tokens, pos, g))
    cache.insert(h, tokens)
    cache.release(h)
    return n, h.full_len


A = [1, 1, 2, 2, 3, 3, 4, 4]  # 4 pages
B = [1, 1, 2, 2, 5, 5, 6, 6]  # shares 2 pages with A


def test_insert_keeps_the_window_tail_and_checkpoints_with_exact_pages():
    cache = make(host_tokens=None)
    assert serve(cache, A) == (0, 0)
    tree = cache.tree
    # 4 full pages; the window keeps 1 page (the last); the state one checkpoint (2 ids)
    assert tree.device_tokens == 8
    assert tree.num_component_pages(W, "device") == 1
    assert tree.num_component_pages(S, "device") == 2
    assert cache.device_allocator.num_used_pages == 4 + 1 + 2
    assert serve(cache, A) == (8, 8)  # a hit at A's end: its window page and checkpoint
    assert_quiescent(cache)
    cache.close()


def test_a_branch_becomes_a_hit_once_its_checkpoint_is_inserted():
    cache = make(host_tokens=None)
    serve(cache, A)
    assert serve(cache, B) == (0, 4)  # full match of 4 tokens, no checkpoint there
    assert serve(cache, A[:4] + [9, 9]) == (4, 4)  # the branch point has its checkpoint now
    assert_quiescent(cache)
    cache.close()


@pytest.mark.parametrize("executor", ["thread", "manual"])
def test_evicted_to_host_and_loaded_back_with_component_pages_bitwise(executor):
    cache = make(device_tokens=32, host_tokens=64, executor=executor)  # 16 device pages
    serve(cache, A)
    finish_transfers(cache)
    tree = cache.tree
    assert tree.host_tokens == 8  # write-through: full pages and components backed up
    assert tree.num_component_pages(W, "host") == 1 and tree.num_component_pages(S, "host") == 2
    # 6 full pages, 6 window pages, a state and a checkpoint: all 16 device pages, so A
    # (4 full pages, 1 window page, a checkpoint: 7) goes host-only
    serve(cache, [7] * 12, check=False)
    finish_transfers(cache)
    assert tree.device_tokens == 12
    h = cache.match(A + [0])
    assert h.host_len > 0 and h.device_len + h.host_len == 8
    finish_transfers(cache)
    h.wait()
    table = h.window_table(W)
    assert read(cache, int(table[3, 0])) == window_value(A, 3)
    state = h.state_pages(S)
    assert [read(cache, int(state.read[g])) for g in range(2)] == [
        state_value(A, 8, g) for g in range(2)]
    cache.release(h)
    assert cache.stats()["loads"] == 1
    assert_quiescent(cache)
    cache.close()


def test_bookkeeping_cache_accounts_component_pages_exactly():
    cache = HiCache(CacheConfig(KV, device_tokens=40, host_tokens=48, allocate_kv=False,
                                tree=TREE))
    assert cache.lifecycle == "python"
    for tokens in (A, B, [3] * 10, A[:6] + [8, 8]):
        h = cache.match(tokens + [0])
        marks = {len(tokens) // P * P}
        assert cache.alloc(h, len(tokens) - h.prefix_len, checkpoints=marks) is not None
        cache.insert(h, tokens)
        cache.release(h)
        cache.check_integrity()
    s = cache.stats()
    assert s["device_pages_used"] == (cache.tree.device_tokens // P + sum(
        cache.tree.num_component_pages(c, "device") for c in (W, S)))
    cache.close()


def test_checkpoints_are_checked():
    cache = make(host_tokens=None)
    h = cache.match(A + [0])
    with pytest.raises(ValueError, match="multiples of 2"):
        cache.alloc(h, 8, checkpoints={3})
    with pytest.raises(ValueError, match=r"in \(0, 8\]"):
        cache.alloc(h, 8, checkpoints={10})
    with pytest.raises(TypeError, match="checkpoints"):
        cache.alloc(h, 8, checkpoints=8)
    assert h.state_pages(S) == (None, None, {})  # nothing matched, nothing allocated
    with pytest.raises(ValueError, match="not a window"):
        h.window_table(S)
    assert cache.alloc(h, 8, checkpoints={8}) is not None
    assert set(h.state_pages(S).checkpoints) == {8}
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_a_budget_keeps_each_component_within_its_share_of_a_tier():
    cache = make(device_tokens=40, host_tokens=80, component_host_fraction=0.05)
    for first in range(5):
        serve(cache, [first + 10] * 8, check=False)
        finish_transfers(cache)
    cap = int(0.05 * 40)  # host pages: 40
    for c in (W, S):
        assert cache.tree.num_component_pages(c, "host") <= cap
    assert_quiescent(cache)
    cache.close()


def _device_nodes(cache: HiCache) -> list[tuple[int, int]]:
    """The device-resident nodes as (start, end) token ranges, in path order."""
    out, todo = [], [(cache.tree.root(), 0)]
    while todo:
        node, start = todo.pop()
        for child in node.children.values():
            end = start + child.num_tokens
            if child.on_device:
                out.append((start, end))
            todo.append((child, end))
    return sorted(out)


def serve_end_only(cache: HiCache, tokens: list[int]) -> None:
    """Compute ``tokens`` whole (no KV check) with a checkpoint at their end only."""
    h = cache.match(tokens + [0])
    assert cache.alloc(h, len(tokens) - h.prefix_len, checkpoints={len(tokens)}) is not None
    cache.insert(h, tokens)
    cache.release(h)
    finish_transfers(cache)


def test_a_load_below_device_nodes_that_serve_nothing_keeps_them_on_the_device():
    """A's hit (12 tokens) is host-only from 6 on, below device nodes [0, 4) and [4, 6)
    whose ends serve nothing (no checkpoint at 4 or 6): the handle locks none of them
    (it locks the root). The load's device room must not evict them (the loaded nodes
    would hang from a node off the device): with only them to evict, it is refused."""
    cache = make(device_tokens=34, host_tokens=128)  # 17 device pages
    a = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    serve(cache, a)  # 6 full pages, the window's last page, a checkpoint at 12: 9 pages
    finish_transfers(cache)
    cache.release(cache.match(a[:4] + [9, 9]))  # splits A at 4
    c1 = cache.match([50] * 9)
    assert cache.alloc(c1, 8) is not None  # 10 pages: [10, 12) goes host-only
    c2 = cache.match([60] * 3)
    assert cache.alloc(c2, 2) is not None  # 4 pages: [6, 10) goes host-only
    cache.release(c2)
    tree = cache.tree
    assert _device_nodes(cache) == [(0, 4), (4, 6)]
    assert cache.device_allocator.num_free_pages == 4
    cache.check_integrity()
    # the load needs 3 full pages, the window page and the checkpoint: 6 > 4 free
    h = cache.match(a + [0])
    assert (h.device_len, h.host_len, h.prefix_len) == (0, 12, 0)
    assert cache.stats()["loads_refused_no_space"] == 1
    assert _device_nodes(cache) == [(0, 4), (4, 6)] and tree.device_tokens == 6
    cache.check_integrity()
    cache.release(h)
    cache.release(c1)
    assert serve(cache, a)[0] == 12  # with room, the load goes through (KV checked)
    assert_quiescent(cache)
    cache.close()


def test_a_load_below_device_nodes_another_load_fills_waits_for_that_load():
    """B's hit (10 tokens) loads [4, 10) below [0, 4), which A's load (still in flight)
    fills and whose end serves nothing (no checkpoint at 4): B reads [0, 4) too, so it
    waits for A's load, and when that fails B is cut back with A."""
    cache = make(device_tokens=40, host_tokens=128, executor="manual")
    a = [1, 1, 2, 2, 3, 3, 4, 4]
    b = [1, 1, 2, 2, 7, 7, 8, 8, 9, 9]
    serve_end_only(cache, a)
    serve_end_only(cache, b)  # A and B share [0, 4); no checkpoint at 4
    h = cache.match([])
    assert cache.alloc(h, 18) is not None  # all 20 device pages: both go host-only
    cache.release(h)
    finish_transfers(cache)
    assert _device_nodes(cache) == []
    ha = cache.match(a + [0])
    (load_a,) = cache.transfers.executor.pending()
    hb = cache.match(b + [0])
    assert (hb.device_len, hb.host_len, hb.prefix_len) == (0, 10, 10)
    (load_b,) = [t for t in cache.transfers.executor.pending() if t is not load_a]
    assert cache.transfers.executor.complete(load_b)
    cache.transfers.executor.fail(load_a, RuntimeError("injected"))
    assert not cache.finish_loads(hb)  # [0, 4) holds garbage: B recomputes from 0
    assert hb.prefix_len == 0
    assert not cache.finish_loads(ha) and ha.prefix_len == 0
    cache.release(ha)
    cache.release(hb)
    assert_quiescent(cache)
    cache.close()


# ------------------------------------------------------------- issue 45, cases 2-4
def insert_with(cache: HiCache, tokens: list[int], checkpoints: set[int]) -> None:
    """Compute ``tokens`` past the hit (no KV check) with ``checkpoints``; insert, release."""
    h = cache.match(tokens + [0])
    h.wait()
    n = len(tokens) - h.prefix_len
    marks = {p for p in checkpoints if h.prefix_len < p}
    assert cache.alloc(h, n, checkpoints=marks) is not None
    cache.insert(h, tokens)
    cache.release(h)
    finish_transfers(cache)


def push_off_device(cache: HiCache) -> None:
    """Allocate every device page once: all that is unlocked leaves the device."""
    h = cache.match([])
    # a page and its window page each, and the running state (2 pages)
    num_pages = (cache.device_allocator.num_pages - 2) // 2
    assert cache.alloc(h, num_pages * P) is not None
    cache.release(h)
    finish_transfers(cache)


@pytest.mark.parametrize("allocate_kv", [True, False])
def test_a_component_backup_never_evicts_its_own_nodes_host_copy_write_through(allocate_kv):
    """Issue 45 case 2. Host tier of 2 pages: A (1 page) is backed up with its window page.
    A later insert gives A a checkpoint on the device: the backup copies the checkpoint
    alone (2 pages) into A's host copy. Making room for it must not evict A's host copy
    (before the fix: ValueError from attach_component, a host page leaked)."""
    cache = make(device_tokens=40, host_tokens=4, host_reserve_nbytes=0,
                 allocate_kv=allocate_kv, **({} if allocate_kv else {"executor": "immediate"}))
    tree = cache.tree
    insert_with(cache, [1, 1], set())
    assert tree.host_tokens == 2 and tree.num_component_pages(W, "host") == 1
    insert_with(cache, [1, 1], {2})  # no hit at 2 yet (no checkpoint): computed again
    assert tree.num_component_pages(S, "device") == 2
    # the host tier is full of A's own copy: the checkpoint's backup is skipped
    assert tree.host_tokens == 2 and tree.num_component_pages(W, "host") == 1
    assert tree.num_component_pages(S, "host") == 0
    assert cache.host_allocator.num_used_pages == 2
    assert cache.stats()["backups_skipped"] == 1
    assert_quiescent(cache)
    cache.close()


@pytest.mark.parametrize("allocate_kv", [True, False])
def test_a_component_backup_never_evicts_its_own_nodes_host_copy_write_back(allocate_kv):
    """Issue 45 case 2 under write-back, host tier of 3 pages: A (1 page) is backed up
    alone (its window page, which no hit could use without a checkpoint, was evicted
    first). A later insert of B through A gives A a window page and a checkpoint on the
    device. B's eviction backs up B's path, A's part of it only A's new data (3 pages, 2
    free). Making room for that must not evict A's own host copy (before the fix:
    ValueError from attach_component, out of alloc)."""
    cache = make(device_tokens=40, host_tokens=6, host_reserve_nbytes=0,
                 write_policy="write_back", allocate_kv=allocate_kv,
                 **({} if allocate_kv else {"executor": "immediate"}))
    tree = cache.tree
    insert_with(cache, [1, 1], set())
    push_off_device(cache)  # A's window page evicted, A backed up (1 page) and freed
    assert tree.host_tokens == 2 and tree.device_tokens == 0
    assert cache.host_allocator.num_used_pages == 1
    insert_with(cache, [1, 1, 2, 2], {2, 4})  # A adopts device pages, gains W and S
    assert tree.device_tokens == 4 and tree.num_component_pages(S, "device") == 4
    assert tree.num_component_pages(W, "device") == 2
    push_off_device(cache)
    # A's host copy stayed; neither its new data nor B could be backed up (B dropped)
    assert tree.device_tokens == 0 and tree.host_tokens == 2
    assert tree.num_component_pages(W, "host") == tree.num_component_pages(S, "host") == 0
    assert cache.host_allocator.num_used_pages == 1
    assert cache.device_allocator.num_used_pages == 0
    assert cache.stats()["backups_skipped"] == 2
    assert_quiescent(cache)
    cache.close()


def test_write_back_without_kv_backs_up_an_evicted_leaf_alone():
    """Issue 45 case 4: a bookkeeping-only cache (allocate_kv=False) under write-back.
    When the eviction's backup copies the evicted leaf alone, no other node's copy is
    counted (before the fix: torch.cat() of an empty list raised out of alloc)."""
    cache = make(device_tokens=40, host_tokens=40, host_reserve_nbytes=0,
                 write_policy="write_back", allocate_kv=False, executor="immediate")
    tree = cache.tree
    insert_with(cache, [1, 1], {2})  # A: 1 page, its window page and a checkpoint
    push_off_device(cache)  # A alone is backed up, then freed
    assert tree.device_tokens == 0 and tree.host_tokens == 2
    assert tree.num_component_pages(W, "host") == 1 and tree.num_component_pages(S, "host") == 2
    assert cache.host_allocator.num_used_pages == 4
    insert_with(cache, [1, 1, 2, 2], {4})  # A loaded back; B below it
    push_off_device(cache)  # B backed up alone (A's host copy has every component)
    assert tree.host_tokens == 4 and cache.host_allocator.num_used_pages == 4 + 4
    assert cache.stats()["backups"] == 2 and cache.stats()["backups_skipped"] == 0
    assert_quiescent(cache)
    cache.close()


# a window of 2 pages before a hit, a state of 1 page
KV2 = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=P,
               components=(ComponentSpec("window", window_tokens=5), ComponentSpec("state")))


def serve_held(cache: HiCache, tokens: list[int], checkpoints: set[int]):
    """Compute and insert ``tokens`` (no KV check); the handle stays live (decoding)."""
    h = cache.match(tokens + [0])
    marks = {p for p in checkpoints if h.prefix_len < p}
    assert cache.alloc(h, len(tokens) - h.prefix_len, checkpoints=marks) is not None
    cache.insert(h, tokens)
    return h


def test_the_device_budget_never_takes_the_inserting_requests_window_tail():
    """Issue 45 case 3: a window budget of 1 page (5% of 20), a request inserts 8 tokens
    and keeps decoding: its window tail (2 pages) is over the budget, but it reads those
    pages next. The budget is enforced once the request locks its path (before the fix:
    window_table gave -1 before prefix_len 8 and the pages were freed)."""
    cache = HiCache(CacheConfig(KV2, device_tokens=40, host_tokens=None, tree=TREE,
                                component_device_fraction=0.05))
    h = serve_held(cache, [1] * 8, {8})
    assert h.prefix_len == 8
    table = h.window_table(W)
    assert bool((table[2:4] >= 0).all()), "the request's own window tail was evicted"
    assert cache.tree.num_component_pages(W, "device") == 2
    # 4 full pages, the window tail (2), the checkpoint (1), the running state (1)
    assert cache.device_allocator.num_used_pages == 4 + 2 + 1 + 1
    cache.check_integrity()
    cache.release(h)
    assert_quiescent(cache)
    cache.close()


def test_the_device_budget_takes_older_data_before_the_inserting_requests_tail():
    """Issue 45 case 3: older unlocked data (B, with a checkpoint at its end) and a new
    insert without one (A): A's own tail ranks as unusable (no hit can end at A's end),
    yet A's request reads it next. The budget (2 window pages) evicts B's tail instead
    (before the fix: A's)."""
    cache = HiCache(CacheConfig(KV2, device_tokens=40, host_tokens=None, tree=TREE,
                                component_device_fraction=0.1))
    cache.release(serve_held(cache, [5] * 8, {8}))
    h = serve_held(cache, [1] * 8, set())
    table = h.window_table(W)
    assert table[:, 0].tolist()[:2] == [-1, -1] and bool((table[2:4] >= 0).all())
    b = cache.match([5] * 8 + [0])
    assert b.full_len == 8 and b.prefix_len == 0  # B's tail went: no hit at 8
    cache.release(b)
    assert cache.tree.num_component_pages(W, "device") == 2
    # A: 4 + 2 window + running state; B: 4 full pages and its checkpoint
    assert cache.device_allocator.num_used_pages == (4 + 2 + 1) + (4 + 1)
    cache.check_integrity()
    cache.release(h)
    assert_quiescent(cache)
    cache.close()
