"""Differential tests: the native tree against the Python tree, operation by operation.

Hypothesis drives both trees with the same operation sequences (match, insert,
insert_host, locks, host locks, IO status, attach/detach on both tiers, evictions
on both tiers with and without a backup hook, priorities, namespaces) under every
eviction policy and demands identical results: match lengths, node ids, returned
and evicted page ids in the same order, split callbacks, sizes, KV events and page
hashes, and the whole tree state after every step. Plus
the native tree's own contracts: proxy identity, stale handles, the fallback.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from optional import skip_unless
from tree_observation import FORMS, as_form, host_takeable_by_definition, snapshot

from hicache.components import ComponentSpec
from hicache.native import build as jit
from hicache.tree import IOStatus, RadixTree, factory, native, token_key
from hicache.tree.protocol import RadixTreeLike

pytestmark = skip_unless("native")

P = 2
NAMESPACES = [None, "a"]
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=12)
def outcome(fn, *args, **kwargs):
    """("ok", result) or ("raise", exception type): what both trees must agree on."""
    try:
        return "ok", fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        return "raise", type(exc)


def ids_of(nodes) -> list[int]:
    return [n.id for n in nodes]


def sizes(tree) -> tuple:
    return (
        tree.device_evictable_tokens,
        tree.device_protected_tokens,
        tree.host_evictable_tokens,
        tree.host_protected_tokens,
        tree.host_takeable_tokens,
        tree.device_tokens,
        tree.host_tokens,
        tree.num_nodes,
    )


class PythonVsNative(RuleBasedStateMachine):
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.splits = {"py": [], "nat": []}
        self.py = RadixTree(P, self.eviction, on_split=self._recorder("py"))
        self.nat = native.NativeRadixTree(P, self.eviction, on_split=self._recorder("nat"))
        self.py.enable_events()
        self.nat.enable_events()
        self.pairs: list[tuple] = []  # (python node, native node) seen in results
        self.locked: list[tuple] = []  # pairs locked once per entry
        self.next_device = 0
        self.next_host = {"py": 10_000, "nat": 10_000}  # host pages given by backup hooks

    def _recorder(self, side):
        return lambda prefix, suffix: self.splits[side].append((prefix.id, suffix.id))

    def remember(self, py_nodes, nat_nodes) -> None:
        for a, b in zip(py_nodes, nat_nodes, strict=True):
            assert a.id == b.id, f"node ids differ: {a.id} vs {b.id}"
            self.pairs.append((a, b))
        del self.pairs[:-40]

    def pages(self, n: int) -> torch.Tensor:
        ids = torch.arange(self.next_device, self.next_device + n, dtype=torch.int64)
        self.next_device += n
        return ids

    def pick(self, i: int):
        return self.pairs[i % len(self.pairs)]

    def both(self, op: str, i: int, *args):
        a, b = self.pick(i)
        ra = outcome(getattr(self.py, op), a, *args)
        rb = outcome(getattr(self.nat, op), b, *args)
        assert ra[0] == rb[0] and (ra[0] == "ok" or ra[1] is rb[1]), f"{op}: {ra} vs {rb}"
        return ra, rb

    # ------------------------------------------------------------------ rules
    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES), form=st.sampled_from(FORMS))
    def match(self, tokens, ns, form):
        ma = self.py.match_prefix(as_form(tokens, form), ns)
        mb = self.nat.match_prefix(as_form(tokens, form), ns)
        assert (ma.device_len, ma.host_len) == (mb.device_len, mb.host_len)
        self.remember([ma.last_device_node, ma.last_node], [mb.last_device_node, mb.last_node])
        self.remember(self.py.host_only_path(ma), self.nat.host_only_path(mb))
        assert ids_of(self.py.path_to(ma.last_node)) == ids_of(self.nat.path_to(mb.last_node))
        key = token_key(tokens, P)
        assert self.py.probe_key(key, ns) == self.nat.probe_key(key, ns)

    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES))
    def probe(self, tokens, ns):
        key = token_key(tokens, P)
        assert self.py.probe_key(key, ns) == self.nat.probe_key(key, ns)
        pa, pb = self.py.probe_path(key, ns), self.nat.probe_path(key, ns)
        assert ids_of(pa) == ids_of(pb)
        self.remember(pa, pb)

    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES), form=st.sampled_from(FORMS))
    def insert(self, tokens, ns, form):
        ids = self.pages(len(tokens) // P)
        ra = self.py.insert(as_form(tokens, form), ids.clone(), ns)
        rb = self.nat.insert(as_form(tokens, form), ids.clone(), ns)
        assert ra.num_cached_tokens == rb.num_cached_tokens
        self.remember([ra.last_node], [rb.last_node])

    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES))
    def insert_host(self, tokens, ns):
        ids = self.pages(len(tokens) // P) + 5_000
        ra = outcome(self.py.insert_host, tokens, ids.clone(), ns)
        rb = outcome(self.nat.insert_host, tokens, ids.clone(), ns)
        assert ra[0] == rb[0]
        if ra[0] == "ok":
            assert ra[1].num_cached_tokens == rb[1].num_cached_tokens
            self.remember([ra[1].last_node], [rb[1].last_node])

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100))
    def lock(self, i):
        ra, _ = self.both("lock", i)
        if ra[0] == "ok":
            self.locked.append(self.pick(i))

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        a, b = self.locked.pop(i % len(self.locked))
        self.py.unlock(a)
        self.nat.unlock(b)

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100))
    def unlock_unlocked(self, i):
        if self.pick(i)[0].lock_ref == 0:  # both must refuse (roots: both accept, a no-op)
            self.both("unlock", i)

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), op=st.sampled_from(["host_lock", "host_unlock"]))
    def host_locks(self, i, op):
        self.both(op, i)

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), priority=st.integers(-2, 3) | st.sampled_from([None, 1.5, 2**63]))
    def raise_priority(self, i, priority):
        if self.pick(i)[1] in self.live():
            self.both("raise_priority", i, priority)

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100))
    def node_hashes(self, i):
        if self.pick(i)[1] in self.live():
            ra, rb = self.both("node_hashes", i)
            assert ra == rb

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), status=st.sampled_from(list(IOStatus)))
    def io_status(self, i, status):
        if self.pick(i)[1] in self.live():
            self.both("set_io_status", i, status)

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), op=st.sampled_from(["attach_host", "attach_device"]))
    def attach(self, i, op):
        a, b = self.pick(i)
        if b not in self.live():
            return
        base = 20_000 if op == "attach_host" else 0
        ids = self.pages(a.num_tokens // P) + base
        self.both(op, i, ids)

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), op=st.sampled_from(["detach_host", "detach_device"]))
    def detach(self, i, op):
        if self.pick(i)[1] not in self.live():
            return
        ra, rb = self.both(op, i)
        if ra[0] == "ok":
            assert ra[1].tolist() == rb[1].tolist()

    @rule(num_tokens=st.integers(0, 14), hook=st.sampled_from([None, "accept", "mixed"]))
    def evict_device(self, num_tokens, hook):
        ra = self.py.evict_device(num_tokens, backup=self._hook(self.py, "py", hook))
        rb = self.nat.evict_device(num_tokens, backup=self._hook(self.nat, "nat", hook))
        assert ra.page_ids.tolist() == rb.page_ids.tolist()
        assert ra.page_ids.dtype == rb.page_ids.dtype == torch.int64
        assert (ra.num_evicted_tokens, ra.num_backup_tokens) == (
            rb.num_evicted_tokens,
            rb.num_backup_tokens,
        )

    def _hook(self, tree, side, kind):
        """Write-back: start a backup (host copy + IO status) and accept, or decline by id."""
        if kind is None:
            return None

        def backup(node):
            if kind == "mixed" and node.id % 3 == 0:
                return False
            n = node.num_tokens // P
            start = self.next_host[side]
            self.next_host[side] += n
            tree.attach_host(node, torch.arange(start, start + n, dtype=torch.int64))
            tree.set_io_status(node, IOStatus.BACKING_UP)
            return True

        return backup

    @rule(num_tokens=st.integers(0, 14), drop=st.booleans())
    def evict_host(self, num_tokens, drop):
        ra = self.py.evict_host(num_tokens, drop_device_resident=drop)
        rb = self.nat.evict_host(num_tokens, drop_device_resident=drop)
        assert ra.page_ids.tolist() == rb.page_ids.tolist()
        assert ra.num_evicted_tokens == rb.num_evicted_tokens

    @rule()
    def evict_all_takeable_host(self):
        """host_takeable_tokens is exact: evict_host takes all of it and nothing more."""
        takeable = self.py.host_takeable_tokens
        ra = self.py.evict_host(takeable + 2 * P)
        rb = self.nat.evict_host(takeable + 2 * P)
        assert ra.page_ids.tolist() == rb.page_ids.tolist()
        assert ra.num_evicted_tokens == rb.num_evicted_tokens == takeable
        assert self.py.host_takeable_tokens == self.nat.host_takeable_tokens == 0

    @precondition(lambda self: self.pairs)
    @rule(
        i=st.integers(0, 100),
        extra=st.none()
        | st.lists(st.integers(0, 99), max_size=3).map(lambda x: torch.tensor(x, dtype=torch.int64))
        | st.sampled_from([torch.tensor([1], dtype=torch.int32), [1], torch.zeros(1, 1).long()]),
    )
    def device_indices_of(self, i, extra):
        a, b = self.pick(i)
        if b not in self.live():
            return
        ra, rb = self.both("device_indices_of", i, extra)
        if ra[0] == "ok":
            assert ra[1].tolist() == rb[1].tolist()

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), min_hits=st.integers(-1, 3) | st.none())
    def path_missing_host(self, i, min_hits):
        a, b = self.pick(i)
        ra, rb = self.both("path_missing_host", i, min_hits)
        if ra[0] == "ok":
            assert [n.id for n in ra[1]] == [n.id for n in rb[1]]
            self.remember(ra[1], rb[1])

    @rule(num_tokens=st.integers(-3, 3) | st.floats(0, 2) | st.none())
    def bad_counts(self, num_tokens):
        for fn in ("evict_device", "evict_host"):
            ra = outcome(getattr(self.py, fn), num_tokens)
            rb = outcome(getattr(self.nat, fn), num_tokens)
            assert ra[0] == rb[0]
            if ra[0] == "raise":
                assert ra[1] is rb[1]
            else:
                assert ra[1].page_ids.tolist() == rb[1].page_ids.tolist()

    def live(self) -> list:
        # (the roots there are: root(ns) would make one, on this tree only)
        return list(self.nat.nodes()) + [self.nat.root(ns) for ns in self.nat.namespaces()]

    # ------------------------------------------------------------- invariant
    @invariant()
    def same_state(self):
        self.py.check_integrity()
        self.nat.check_integrity()
        assert self.splits["py"] == self.splits["nat"]
        assert sizes(self.py) == sizes(self.nat)
        assert self.py.host_takeable_tokens == host_takeable_by_definition(self.py)
        assert snapshot(self.py) == snapshot(self.nat)
        assert self.py.namespaces() == self.nat.namespaces()
        assert self.py.take_events() == self.nat.take_events()


class PythonVsNativeLFU(PythonVsNative):
    eviction = "lfu"


# One machine per further policy: the same rules, each policy's own heap keys.
POLICY_MACHINES = {"lru": PythonVsNative, "lfu": PythonVsNativeLFU} | {
    name: type(f"PythonVsNative{name.upper()}", (PythonVsNative,), {"eviction": name})
    for name in ("fifo", "mru", "filo", "priority", "slru")
}


class HybridPythonVsNative(PythonVsNative):
    """The same rules over hybrid trees, plus the component calls; every component's
    data and stamps, counters and results must agree too."""

    specs: tuple = ()

    def __init__(self) -> None:
        super().__init__()
        self.py = factory.make_tree("python", P, self.eviction, self._recorder("py"), self.specs)
        self.nat = factory.make_tree("native", P, self.eviction, self._recorder("nat"), self.specs)
        self.py.enable_events()
        self.nat.enable_events()
        self.next_component = 50_000

    def component_ids(self, num_pages: int, c: int, holes: int) -> torch.Tensor:
        """Ids along a key for component ``c``: every page given but each ``holes``-th."""
        width = self.specs[c].width
        ids = torch.arange(self.next_component, self.next_component + num_pages * width)
        self.next_component += num_pages * width
        ids = ids.view(num_pages, width)
        if holes:
            ids[::holes] = -1
        return ids.reshape(-1)

    def given(self, num_pages: int, mask: int, holes: int) -> list:
        return [self.component_ids(num_pages, c, holes) if mask >> c & 1 else None
                for c in range(len(self.specs))]

    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES), mask=st.integers(0, 7),
          holes=st.sampled_from([0, 0, 2, 3]), host=st.booleans())
    def insert_components(self, tokens, ns, mask, holes, host):
        num_pages = len(tokens) // P
        given = self.given(num_pages, mask, holes)
        key = token_key(tokens, P)
        tier = "host" if host else "device"
        gaps = [(self.py.component_gaps(key, c, tier, ns), self.nat.component_gaps(key, c, tier, ns))
                for c in range(len(self.specs))]
        for a, b in gaps:
            assert a.tolist() == b.tolist()
        ids = self.pages(num_pages) + (60_000 if host else 0)
        op = "insert_host" if host else "insert"
        ra = outcome(getattr(self.py, op), tokens, ids.clone(), ns,
                     components=[None if g is None else g.clone() for g in given])
        rb = outcome(getattr(self.nat, op), tokens, ids.clone(), ns,
                     components=[None if g is None else g.clone() for g in given])
        assert ra[0] == rb[0] and (ra[0] == "ok" or ra[1] is rb[1]), (ra, rb)
        if ra[0] == "ok":
            assert ra[1].num_cached_tokens == rb[1].num_cached_tokens
            assert ra[1].unused_pages.tolist() == rb[1].unused_pages.tolist()
            self.remember([ra[1].last_node], [rb[1].last_node])

    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES))
    def match_components(self, tokens, ns):
        key = token_key(tokens, P)
        assert self.py.probe_hit_key(key, ns) == self.nat.probe_hit_key(key, ns)
        ma, mb = self.py.match_key(key, ns), self.nat.match_key(key, ns)
        assert (ma.device_len, ma.host_len, ma.full_len) == (mb.device_len, mb.host_len, mb.full_len)
        self.remember([ma.last_device_node, ma.last_node], [mb.last_device_node, mb.last_node])

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), c=st.integers(0, 2), host=st.booleans(),
          op=st.sampled_from(["attach", "detach", "table"]))
    def component_call(self, i, c, host, op):
        a, b = self.pick(i)
        if b not in self.live():
            return
        c %= len(self.specs)
        tier = "host" if host else "device"
        if op == "attach":
            spec = self.specs[c]
            n = a.num_tokens // P * spec.width if spec.is_window else spec.width
            ids = self.component_ids(1, 0, 0)[:0]  # advance nothing; fresh ids below
            ids = torch.arange(self.next_component, self.next_component + n)
            self.next_component += n
            ra, rb = self.both("attach_component", i, c, tier, ids)
        elif op == "detach":
            ra, rb = self.both("detach_component", i, c, tier)
            if ra[0] == "ok":
                assert ra[1].tolist() == rb[1].tolist()
        else:
            ra, rb = self.both("component_table", i, c, tier)
            if ra[0] == "ok":
                assert ra[1].tolist() == rb[1].tolist()

    @precondition(lambda self: self.pairs)
    @rule(i=st.integers(0, 100), call=st.integers(0, 10**6),
          bad=st.sampled_from(["component", "tier", "count", "namespace"]))
    def bad_component_call(self, i, call, bad):
        """A component call with a bad component, tier, count or namespace (issue 45,
        case 5): both trees raise the same exception type (or give the same result:
        a huge count evicts everything, a probe of a namespace with no root gives 0)."""
        a, b = self.pick(i)
        key = token_key([0, 0, 1, 1], P)
        values = {"component": [-1, len(self.specs), True, 1.0, None, 2**64],
                  "tier": ["disk", None, 0, "Device"],
                  "count": [-1, -(2**64), True, 1.5, "3", None, 2**64, 2**63],
                  "namespace": [[], 5, "\ud800", b"a", ("a",)]}[bad]
        value = values[call % len(values)]
        ok_c, ok_tier, ok_num, ok_ns = 0, "device", 1, None
        if bad == "component":
            ok_c = value
        elif bad == "tier":
            ok_tier = value
        elif bad == "count":
            ok_num = value
        else:
            ok_ns = value
        calls = [
            lambda t, n: t.num_component_pages(ok_c, ok_tier),
            lambda t, n: t.component_table(n, ok_c, ok_tier),
            lambda t, n: t.component_gaps(key, ok_c, ok_tier, ok_ns),
            lambda t, n: t.detach_component(n, ok_c, ok_tier),
            lambda t, n: t.attach_component(n, ok_c, ok_tier, torch.tensor([-5])),
            lambda t, n: t.evict_component(ok_c, ok_tier, ok_num),
            lambda t, n: t.probe_hit_key(key, ok_ns),
            lambda t, n: t.path_missing_host(n, ok_num),
        ]
        fn = calls[(call // len(values)) % len(calls)]
        ra, rb = outcome(fn, self.py, a), outcome(fn, self.nat, b)
        assert ra[0] == rb[0] and (ra[0] == "ok" or ra[1] is rb[1]), f"{bad}={value!r}: {ra} vs {rb}"
        if ra[0] == "ok" and hasattr(ra[1], "page_ids"):
            assert ra[1].page_ids.tolist() == rb[1].page_ids.tolist()
        elif ra[0] == "ok" and isinstance(ra[1], int):
            assert ra[1] == rb[1]

    @rule(c=st.integers(0, 2), host=st.booleans(), num=st.integers(0, 8))
    def evict_component(self, c, host, num):
        c %= len(self.specs)
        tier = "host" if host else "device"
        ra = self.py.evict_component(c, tier, num)
        rb = self.nat.evict_component(c, tier, num)
        assert ra.page_ids.tolist() == rb.page_ids.tolist()
        assert ra.num_evicted_tokens == rb.num_evicted_tokens == 0

    @rule()
    def evict_all_takeable_host(self):
        """Host eviction takes exactly the takeable full tokens and component pages."""
        takeable = self.py.host_takeable_tokens
        pages = self.py.host_component_takeable_pages
        ra = self.py.evict_host(takeable + P * pages + 2 * P)
        rb = self.nat.evict_host(takeable + P * pages + 2 * P)
        assert ra.page_ids.tolist() == rb.page_ids.tolist()
        assert ra.num_evicted_tokens == rb.num_evicted_tokens == takeable
        assert len(ra.page_ids) == takeable // P + pages
        assert self.nat.host_takeable_tokens == self.nat.host_component_takeable_pages == 0

    @invariant()
    def same_components(self):
        for tier in ("device", "host"):
            for c in range(len(self.specs)):
                assert self.py.num_component_pages(c, tier) == self.nat.num_component_pages(c, tier)
        assert (self.py.device_component_evictable_pages, self.py.host_component_takeable_pages) == (
            self.nat.device_component_evictable_pages, self.nat.host_component_takeable_pages)


WINDOW = ComponentSpec("window", window_tokens=3)  # 1 page
WIDE_WINDOW = ComponentSpec("window", window_tokens=6, width=2)  # 3 pages, 2 ids each
STATE = ComponentSpec("state")
HYBRID_MACHINES = {
    f"{name}-{policy}": type(f"Hybrid_{name}_{policy}", (HybridPythonVsNative,),
                             {"eviction": policy, "specs": specs})
    for name, specs, policy in (
        ("window", (WINDOW,), "lru"),
        ("state", (STATE,), "lfu"),
        ("window+state", (WIDE_WINDOW, STATE), "lru"),
        ("two-windows+state", (WINDOW, STATE, WIDE_WINDOW), "priority"),
        ("window+state", (WIDE_WINDOW, STATE), "slru"),
    )
}


@pytest.mark.parametrize("machine", list(HYBRID_MACHINES.values()), ids=list(HYBRID_MACHINES))
def test_native_matches_python_with_components(machine):
    machine.TestCase.settings = settings(
        max_examples=50,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()


@pytest.mark.parametrize("machine", list(POLICY_MACHINES.values()), ids=list(POLICY_MACHINES))
def test_native_matches_python(machine):
    machine.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()


def test_long_random_run_identical_including_heap_compaction(monkeypatch):
    """Thousands of steps: heaps get compacted (seq order rebuilt from nodes() order)."""
    compactions = []
    python_compact = RadixTree._compact
    monkeypatch.setattr(
        RadixTree, "_compact", lambda self: compactions.append(1) or python_compact(self)
    )
    rng = np.random.default_rng(7)
    # Re-matching a pool of prompts pushes fresh heap entries; with rare evictions the
    # stale ones pile up until the heaps are compacted.
    pool = [rng.integers(0, 3, size=int(rng.integers(4, 40)), dtype=np.int32) for _ in range(40)]
    trees = [RadixTree(4), native.NativeRadixTree(4)]
    next_page = 0
    locked: list[tuple] = []
    for step in range(6000):
        if rng.random() < 0.8:
            tokens = pool[int(rng.integers(0, len(pool)))]
        else:
            tokens = rng.integers(0, 3, size=int(rng.integers(0, 40)), dtype=np.int32)
        op = rng.integers(0, 100)
        if step % 1500 == 1499 or op >= 98:
            n = 200 if step % 1500 == 1499 else int(rng.integers(0, 8))
            a, b = (t.evict_device(n) for t in trees)
            assert a.page_ids.tolist() == b.page_ids.tolist(), f"step {step}"
        elif op < 70:
            results = [t.match_prefix(tokens) for t in trees]
            a, b = results
            assert (a.device_len, a.host_len, a.last_node.id) == (
                b.device_len,
                b.host_len,
                b.last_node.id,
            )
            if op < 2 and len(locked) < 8:
                for t, m in zip(trees, results, strict=True):
                    t.lock(m.last_device_node)
                locked.append((a.last_device_node, b.last_device_node))
        elif op < 97:
            ids = torch.arange(next_page, next_page + len(tokens) // 4, dtype=torch.int64)
            next_page += len(ids)
            a, b = (t.insert(tokens, ids) for t in trees)
            assert (a.num_cached_tokens, a.last_node.id) == (b.num_cached_tokens, b.last_node.id)
        elif locked:
            pa, pb = locked.pop(int(rng.integers(0, len(locked))))
            trees[0].unlock(pa)
            trees[1].unlock(pb)
        if step % 500 == 0:
            for t in trees:
                t.check_integrity()
            assert snapshot(trees[0]) == snapshot(trees[1])
    assert sizes(trees[0]) == sizes(trees[1])
    assert snapshot(trees[0]) == snapshot(trees[1])
    assert compactions, "the run never compacted a heap: make it longer"


# ------------------------------------------------------------ native contracts
def test_proxy_identity_and_stale_handles():
    tree = native.NativeRadixTree(2)
    a = tree.insert([1, 1, 2, 2], torch.tensor([0, 1])).last_node
    assert tree.match_prefix([1, 1, 2, 2]).last_node is a
    assert next(iter(tree.nodes())) is a and a.parent is tree.root()
    prefix = tree.match_prefix([1, 1]).last_node  # split: a keeps its identity as the suffix
    assert a.parent is prefix and prefix.children == {token_key([2, 2], 2): a}
    assert a.tokens().tolist() == [2, 2] and a.num_pages(2) == 1
    tree.evict_device(4)  # a is removed: readable like a removed Python node, but stale
    assert (a.parent, a.on_device, a.on_host, a.key) == (None, False, False, token_key([2, 2], 2))
    for op in (tree.lock, tree.unlock, tree.host_lock, tree.device_indices_of, tree.path_to):
        with pytest.raises(ValueError, match="stale"):
            op(a)
    other = native.NativeRadixTree(2)
    with pytest.raises(ValueError, match="another tree"):
        other.lock(tree.root())
    with pytest.raises(TypeError):
        tree.lock("node")
    tree.check_integrity()


def test_proxy_cache_is_pruned_but_held_proxies_stay_identical_and_readable():
    tree = native.NativeRadixTree(1)
    keep = tree.insert([7], torch.tensor([0])).last_node
    tree.lock(keep)
    removed = tree.insert([9], torch.tensor([1])).last_node
    tree.evict_device(1)
    for i in range(3000):  # every other node is inserted, then evicted
        tree.insert([8, i], torch.tensor([1, 2 + i]))
        tree.evict_device(2)
    assert len(tree._proxies) < 2100 and tree._impl.num_detached() < 2100
    assert tree.match_prefix([7]).last_node is keep
    assert removed.parent is None and removed.tokens().tolist() == [9]
    tree.check_integrity()


def test_inputs_are_read_in_place_and_bad_ones_rejected():
    tree = native.NativeRadixTree(2)
    tokens = np.array([1, 1, 2, 2, 3], dtype=np.int32)
    tokens.flags.writeable = False  # read-only arrays: no copy, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree.insert(tokens, torch.tensor([0, 1]))
        assert tree.match_prefix(tokens[::-1][::-1]).device_len == 4
    strided = np.array([1, 9, 1, 9, 2, 9, 2, 9], dtype=np.int64)[::2]
    assert tree.match_prefix(strided).device_len == 4
    assert tree.match_prefix(torch.tensor([1, 1, 2, 2], dtype=torch.int64)).device_len == 4
    assert tree.match_prefix(np.array([1, 1, 2, 2], dtype=">i4")).device_len == 4
    assert tree.match_key(token_key([1, 1, 2, 2], 2)).device_len == 4
    for bad, exc in (
        (torch.tensor([[1, 1]], dtype=torch.int32), ValueError),
        (np.array([1, -1], dtype=np.int32), ValueError),
        (np.array([1, 2**31], dtype=np.int64), ValueError),
        (torch.tensor([1, -5], dtype=torch.int64), ValueError),
    ):
        with pytest.raises(exc):
            tree.match_prefix(bad)
    with pytest.raises(ValueError, match="whole pages"):
        tree.match_key(b"\x01\x00\x00\x00")
    with pytest.raises(TypeError):
        tree.insert([3, 3], torch.tensor([5], dtype=torch.int32))
    with pytest.raises(TypeError):
        tree.set_io_status(tree.root(), 1)
    tree.check_integrity()


def test_hook_errors_propagate_without_crashing():
    tree = native.NativeRadixTree(2)
    tree.insert([1, 1, 2, 2], torch.tensor([0, 1]))
    tree.match_prefix([1, 1])  # split: [1,1] -> [2,2]

    def boom(node):
        raise KeyError("hook failed")

    tree.attach_host(tree.match_prefix([1, 1, 2, 2]).last_node, torch.tensor([9]))
    tree.evict_device(2)  # the child goes host-only; its parent needs the backup hook
    with pytest.raises(KeyError):
        tree.evict_device(2, backup=boom)

    tree.check_integrity()

    def reenter(node):
        tree.evict_device(100)  # refused: re-entrant eviction from inside an eviction
        return False

    with pytest.raises(RuntimeError, match="evict_device: called from inside the backup hook"):
        tree.evict_device(2, backup=reenter)
    tree.check_integrity()


def _tree_with_self_referencing_hook() -> weakref.ref:
    seen = []
    tree = native.NativeRadixTree(2)
    tree.on_split = lambda p, s: seen.append((p, s))
    node = tree.insert([1, 1, 2, 2], torch.tensor([0, 1])).last_node
    m = tree.match_prefix([1, 1])
    assert seen == [(m.last_node, node)]
    tree.on_split = lambda p, s: tree.num_nodes  # a cycle through the callback
    return weakref.ref(tree)


def test_on_split_can_be_set_later_and_tree_is_collected():
    ref = _tree_with_self_referencing_hook()
    gc.collect()
    assert ref() is None


def test_memory_bytes_grows_with_cached_tokens():
    tree = native.NativeRadixTree(16)
    empty = tree.memory_bytes()
    tokens = np.arange(16 * 64, dtype=np.int32)
    tree.insert(tokens, torch.arange(64))
    assert tree.memory_bytes() >= empty + tokens.nbytes + 64 * 8
    tree.check_integrity()


def test_make_tree_kinds_and_single_fallback_warning(monkeypatch):
    assert isinstance(factory.make_tree("native", 2), native.NativeRadixTree)
    assert isinstance(factory.make_tree("auto", 2), native.NativeRadixTree)
    assert isinstance(factory.make_tree("python", 2), RadixTree)
    for tree in (factory.make_tree("native", 2), factory.make_tree("python", 2)):
        assert isinstance(tree, RadixTreeLike)
    with pytest.raises(ValueError, match="kind"):
        factory.make_tree("cuda", 2)
    failed = jit._LoadResult(None, "no C++ compiler ('c++' not found on PATH; set CXX)", 0.0)
    monkeypatch.setattr(jit, "_load", lambda: failed)
    factory._warn_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler") as record:
        assert isinstance(factory.make_tree("auto", 2), RadixTree)
        assert isinstance(factory.make_tree("auto", 2), RadixTree)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler"):
        factory.make_tree("native", 2)
    factory._warn_fallback.cache_clear()
