"""Contracts both trees keep under misuse (issue 31): hooks, threads, sizes, ownership, errors.

* A hook (``on_split``, the backup hook of ``evict_device``) may read the tree;
  the backup hook may also call host_lock, host_unlock, attach_host,
  set_io_status and evict_host. Every other tree-changing call from inside a
  hook raises the same ``RuntimeError`` in both trees, before changing
  anything; a hook that raises leaves the tree consistent.
* The tree owns the page ids it keeps (a copy).
* ``page_size`` is an int in [1, 2**24]; bad input gets the same exception type
  and message in both trees.
* The native tree serialises threads.

The scenarios that crashed the native tree before (segfault, SIGFPE, heap
corruption) run in a fresh process each, so that a regression fails one test
instead of killing the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kv_layouts import TREE_KINDS
from optional import skip_unless
from tree_observation import snapshot

from hicache.tree import IOStatus, RadixTree, native, token_key

ROOT = Path(__file__).resolve().parents[2]
needs_native = skip_unless("native")
SPLIT_ONLY_READS = "called from inside the on_split hook, which may only read the tree"
BACKUP_MAY = (
    "called from inside the backup hook, which may only read the tree and call "
    "host_lock, host_unlock, attach_host, set_io_status and evict_host"
)


def make(kind: str, page_size: int = 2, **kw):
    return RadixTree(page_size, **kw) if kind == "python" else native.NativeRadixTree(page_size, **kw)


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this checkout's hicache; fails on a crash."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (a negative one is a signal):\n{proc.stderr[-3000:]}"
    return proc


# --------------------------------------------- crash repros (fresh processes)
CRASHES = {
    # Item 1: the backup hook evicted the node it was offered; evict_device then
    # dereferenced its null parent (segfault).
    "backup_hook_evicts_offered_node": """
        import pytest, torch
        from hicache.tree import native
        tree = native.NativeRadixTree(2)
        tree.insert([1, 1, 2, 2], torch.tensor([0, 1]))
        def hook(node):
            tree.match_prefix([1, 1, 2, 2])
            tree.evict_device(100)
            return False
        with pytest.raises(RuntimeError, match="evict_device|match: called from inside the backup hook"):
            tree.evict_device(4, backup=hook)
        tree.check_integrity()
        assert tree.evict_device(4).page_ids.tolist() == [0, 1]
        tree.check_integrity()
    """,
    # Item 2: on_split during insert_host evicted the prefix just split; the new
    # leaf was hung under the freed node (heap-use-after-free).
    "on_split_evicts_prefix_in_insert_host": """
        import pytest, torch
        from hicache.tree import native
        tree = native.NativeRadixTree(2)
        tree.insert_host([1, 1, 2, 2], torch.tensor([0, 1]))
        tree.on_split = lambda prefix, suffix: tree.evict_host(100)
        with pytest.raises(RuntimeError, match="evict_host: called from inside the on_split hook"):
            tree.insert_host([1, 1, 3, 3], torch.tensor([5, 6]))
        tree.check_integrity()
        tree.on_split = None
        for i in range(600):  # proxies pruned, detached nodes freed
            tree.match_prefix([i % 50 + 10] * 2)
        assert tree.insert_host([1, 1, 3, 3], torch.tensor([5, 6])).num_cached_tokens == 2
        tree.check_integrity()
    """,
    # Item 4: the caller re-pointed its tensor after insert; the tree read the new one.
    "caller_repoints_page_tensor": """
        import torch
        from hicache.tree import native
        tree = native.NativeRadixTree(2)
        idx = torch.tensor([0, 1, 2])
        tree.insert([1, 1, 2, 2, 3, 3], idx)
        idx.set_(torch.empty(0, dtype=torch.int64))
        host = torch.tensor([7])
        tree.attach_host(tree.match_prefix([1, 1]).last_node, host)
        host.set_(torch.arange(10**6))
        assert tree.evict_device(6).page_ids.tolist() == [1, 2, 0]
        assert tree.evict_host(2).page_ids.tolist() == [7]
        tree.check_integrity()
    """,
    # Item 5: page_size 2**62 made 4 * page_size wrap to 0, then a modulo by it (SIGFPE).
    "page_size_2_62": """
        import pytest
        from hicache.native.build import load_native
        from hicache.tree import native
        for bad in (2**62, 2**24 + 1):
            with pytest.raises(ValueError, match=r"page_size: expected an int in \\[1, 2\\*\\*24\\]"):
                native.NativeRadixTree(bad)
            with pytest.raises(ValueError, match=r"page_size: expected an int in \\[1, 2\\*\\*24\\]"):
                load_native().Tree(bad, "lru")
        tree = native.NativeRadixTree(2**24)
        assert tree.match_key(b"\\0" * 4 * 2**24).device_len == 0
    """,
    # Item 3: threads on one tree entered it mid-split (heap corruption, segfault).
    "threads_on_one_tree": """
        import random, threading, torch
        from hicache.tree import native
        tree = native.NativeRadixTree(1)
        splits = []
        tree.on_split = lambda p, s: splits.append(p.id)  # Python code mid-operation
        def worker(seed):
            rng = random.Random(seed)
            for i in range(2000):
                toks = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
                op = rng.randrange(4)
                if op == 0:
                    tree.insert(toks, torch.arange(len(toks)))
                elif op == 1:
                    tree.match_prefix(toks)
                elif op == 2:
                    tree.evict_device(rng.randrange(1, 8))
                else:
                    tree.insert_host(toks, torch.arange(len(toks)))
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert splits
        assert tree.num_nodes == len(list(tree.nodes()))
    """,
}


@needs_native
@pytest.mark.parametrize("name", sorted(CRASHES))
def test_native_crash_repro_is_an_error_now(name):
    run_isolated(CRASHES[name])


# ------------------------------------------------------------ hook contract
def _split_tree(kind: str):
    """A tree whose next match of [1, 1] splits the leaf [1, 1, 2, 2]."""
    tree = make(kind)
    tree.insert([1, 1, 2, 2], torch.tensor([0, 1]))
    return tree


def _node_pair(tree):
    m = tree.match_prefix([1, 1, 2, 2])
    return m.last_node


REFUSED_IN_BOTH = {
    "match": lambda t, n: t.match_prefix([1, 1]),
    "insert": lambda t, n: t.insert([5, 5], torch.tensor([9])),
    "insert_host": lambda t, n: t.insert_host([6, 6], torch.tensor([9])),
    "lock": lambda t, n: t.lock(n),
    "unlock": lambda t, n: t.unlock(n),
    "raise_priority": lambda t, n: t.raise_priority(n, 5),
    "attach_device": lambda t, n: t.attach_device(n, torch.tensor([9])),
    "detach_device": lambda t, n: t.detach_device(n),
    "detach_host": lambda t, n: t.detach_host(n),
    "evict_device": lambda t, n: t.evict_device(2),
}
BACKUP_MAY_CALL = {
    "host_lock": lambda t, n: t.host_lock(n),
    "host_unlock": lambda t, n: t.host_unlock(n),
    "attach_host": lambda t, n: t.attach_host(n, torch.tensor([9])),
    "set_io_status": lambda t, n: t.set_io_status(n, IOStatus.NONE),
    "evict_host": lambda t, n: t.evict_host(2),
}


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("op", sorted(REFUSED_IN_BOTH | BACKUP_MAY_CALL))
def test_on_split_may_only_read(kind, op):
    tree = _split_tree(kind)
    call = (REFUSED_IN_BOTH | BACKUP_MAY_CALL)[op]
    seen = []

    def hook(prefix, suffix):
        seen.append((prefix.id, suffix.id, tree.num_nodes, len(tree.path_to(suffix))))
        before = snapshot(tree)
        with pytest.raises(RuntimeError) as err:
            call(tree, suffix)
        assert str(err.value) == f"{op}: {SPLIT_ONLY_READS}"
        assert snapshot(tree) == before  # refused before changing anything

    tree.on_split = hook
    assert tree.match_prefix([1, 1]).device_len == 2
    assert seen == [(2, 1, 2, 2)]
    tree.check_integrity()


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("op", sorted(REFUSED_IN_BOTH))
def test_backup_hook_refused_calls(kind, op):
    tree = _split_tree(kind)
    offered = []

    def hook(node):
        offered.append(node.id)
        before = snapshot(tree)
        with pytest.raises(RuntimeError) as err:
            REFUSED_IN_BOTH[op](tree, node)
        assert str(err.value) == f"{op}: {BACKUP_MAY}"
        assert snapshot(tree) == before
        return False

    result = tree.evict_device(4, backup=hook)
    assert offered == [1]
    # Declined and unchanged: the leaf is evicted as without a hook.
    assert result.page_ids.tolist() == [0, 1] and result.num_evicted_tokens == 4
    tree.check_integrity()


def test_backup_hook_may_back_up_and_both_trees_agree():
    """The write-back pattern from inside the hook, in both trees alike. A hook
    that declines after giving the node a host copy does not get it removed
    (its host pages would leak): attach_host made it a plain candidate again,
    and the same eviction then takes its device copy as any node's on both tiers."""
    states = []
    for kind in TREE_KINDS:
        tree = make(kind)
        tree.insert([1, 1, 2, 2], torch.tensor([0, 1]))
        tree.insert([3, 3], torch.tensor([2]))
        tree.insert_host([4, 4], torch.tensor([50]))

        def hook(node, tree=tree):
            tree.evict_host(2)  # makes room: takes the host-only leaf [4, 4]
            tree.attach_host(node, torch.arange(node.num_tokens // 2) + 60 + 10 * node.id)
            if node.key == token_key([3, 3], 2):
                return False  # declined with a host copy: skipped, not removed
            tree.set_io_status(node, IOStatus.BACKING_UP)
            return True

        r = tree.evict_device(6, backup=hook)
        tree.check_integrity()
        states.append((r.page_ids.tolist(), r.num_evicted_tokens, r.num_backup_tokens, snapshot(tree)))
    assert states[0][:3] == ([2], 2, 4)
    assert all(s == states[0] for s in states)


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("where", ["match", "insert", "insert_host", "evict_device", "evict_host", "backup"])
def test_a_raising_hook_leaves_the_tree_consistent(kind, where):
    tree = make(kind)
    tree.insert([1, 1, 2, 2, 3, 3], torch.tensor([0, 1, 2]))
    tree.insert([7, 7], torch.tensor([3]))
    tree.attach_host(tree.match_prefix([7, 7]).last_node, torch.tensor([10]))
    tree.insert_host([8, 8, 9, 9], torch.tensor([11, 12]))

    def boom(*args):
        raise KeyError("hook failed")

    tree.on_split = boom if where != "backup" else None
    calls = {
        "match": lambda: tree.match_prefix([1, 1]),
        "insert": lambda: tree.insert([1, 1, 5, 5], torch.tensor([4, 5])),
        "insert_host": lambda: tree.insert_host([1, 1, 5, 5], torch.tensor([20, 21])),
        "evict_device": lambda: tree.evict_device(2),
        "evict_host": lambda: tree.evict_host(2),
        "backup": lambda: tree.evict_device(100, backup=boom),
    }
    with pytest.raises(KeyError):
        calls[where]()
    tree.check_integrity()
    tree.on_split = None
    tree.evict_host(100)
    tree.evict_device(100)
    tree.check_integrity()
    assert tree.device_tokens == 0 and tree.num_nodes == 0


def test_reentrant_on_split_in_insert_host_same_refusal_and_state():
    """Item 6: a re-entrant call from on_split during insert_host is refused by
    both trees alike, and leaves identical trees (clock and eviction order)."""
    results = []
    for kind in TREE_KINDS:
        tree = make(kind)
        tree.insert([1, 1, 2, 2], torch.tensor([0, 1]))
        tree.insert_host([3, 3, 4, 4], torch.tensor([10, 11]))

        def hook(prefix, suffix, tree=tree):
            tree.match_prefix([1, 1, 2, 2])

        tree.on_split = hook
        with pytest.raises(RuntimeError) as err:
            tree.insert_host([3, 3, 5, 5], torch.tensor([12, 13]))
        tree.on_split = None
        tree.check_integrity()
        r = tree.insert_host([3, 3, 5, 5], torch.tensor([12, 13]))
        evicted = tree.evict_host(100).page_ids.tolist()
        tree.check_integrity()
        results.append((str(err.value), r.num_cached_tokens, evicted, snapshot(tree)))
    assert results[0][0] == f"match: {SPLIT_ONLY_READS}"
    assert all(r == results[0] for r in results)


# ------------------------------------------------------- ownership, sizes
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_owns_the_page_ids_it_keeps(kind):
    tree = make(kind)
    pages = torch.tensor([4, 5, 6])
    node = tree.insert([1, 1, 2, 2, 3, 3], pages).last_node
    pages.fill_(-1)
    assert node.device_indices.tolist() == [4, 5, 6]
    host = torch.tensor([7, 8, 9])
    tree.attach_host(node, host)
    host.set_(torch.arange(100))
    assert tree.evict_device(2).page_ids.tolist() == [6]
    assert tree.evict_host(2).page_ids.tolist() == [9]
    assert tree.device_indices_of(tree.match_prefix([1, 1, 2, 2]).last_node).tolist() == [4, 5]
    tree.check_integrity()


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize(
    ("page_size", "error", "message"),
    [
        (0, ValueError, "page_size: expected an int in [1, 2**24], got 0"),
        (-3, ValueError, "page_size: expected an int in [1, 2**24], got -3"),
        (2**24 + 1, ValueError, "page_size: expected an int in [1, 2**24], got 16777217"),
        (2**62, ValueError, f"page_size: expected an int in [1, 2**24], got {2**62}"),
        (2.0, TypeError, "page_size: expected int, got float"),
        (True, TypeError, "page_size: expected int, got bool"),
    ],
)
def test_page_size_range_checked(kind, page_size, error, message):
    with pytest.raises(error) as err:
        make(kind, page_size)
    assert str(err.value) == message
