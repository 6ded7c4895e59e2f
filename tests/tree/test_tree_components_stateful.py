"""Hypothesis state machine: a hybrid tree against a reference model of what it holds.

The model knows, for every cached whole-page prefix, the page id of its last page
(full attention), the window component's id for that page, and the state
component's checkpoint after it; it derives what an insert keeps (the window's
pages before each hit end, the checkpoint at each hit end: the key's end, the end
its new leaf hangs from, and every branch point) and what a match serves (the
longest prefix with a checkpoint at its end and every window page before it),
and checks eviction against it: page ids it knows, nothing locked, component data
never without its full page, at least what was asked when that much was unlocked.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_layouts import TREE_KINDS

from hicache.components import ComponentSpec
from hicache.tree import make_tree

P = 2
W_PAGES = 2
SPECS = (ComponentSpec("window", window_tokens=2 * P), ComponentSpec("state"))  # w = 2 pages
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=12)
mostly = st.sampled_from([True, True, True, False])  # give a component's pages, mostly


class HybridVsModel(RuleBasedStateMachine):
    kind = "python"

    def __init__(self) -> None:
        super().__init__()
        self.tree = make_tree(self.kind, P, "lru", components=SPECS)
        self.full: dict[tuple, int] = {}  # prefix -> page id of its last page
        self.window: dict[tuple, int] = {}  # prefix -> window id of its last page
        self.state: dict[tuple, int] = {}  # prefix -> checkpoint after it
        self.locks: list[tuple[object, tuple]] = []
        self.next_id = 0
        self.keys: list[list[int]] = [[]]  # inserted token lists, to extend and match again

    def ids(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next_id, self.next_id + n, dtype=torch.int64)
        self.next_id += n
        return out

    def cached(self, tokens: list[int]) -> int:
        n = 0
        while n + P <= len(tokens) and tuple(tokens[: n + P]) in self.full:
            n += P
        return n

    def branch(self, prefix: tuple) -> bool:
        nexts = {p[len(prefix) : len(prefix) + P] for p in self.full
                 if len(p) == len(prefix) + P and p[: len(prefix)] == prefix}
        return len(nexts) > 1

    def servable(self, tokens: list[int]) -> int:
        full = self.cached(tokens)
        for n in range(full, 0, -P):
            window = all(tuple(tokens[:k]) in self.window for k in range(max(P, n - W_PAGES * P + P), n + 1, P))
            if tuple(tokens[:n]) in self.state and window:
                return n
        return 0

    def locked(self) -> set[tuple]:
        return {prefix[:n] for _, prefix in self.locks for n in range(P, len(prefix) + 1, P)}

    @rule(i=st.integers(0, 100), cut=st.integers(0, 1), add=st.integers(0, 2),
          token=st.integers(0, 2), give_window=mostly, give_state=mostly)
    def extend(self, i, cut, add, token, give_window, give_state):
        """Insert a known key cut by whole pages and extended by ``add`` pages: a next
        turn, a branch."""
        key = self.keys[i % len(self.keys)]
        key = key[: max(0, len(key) // P - cut) * P] + [token] * (add * P)
        self.insert(key, give_window, give_state)

    @rule(i=st.integers(0, 100), cut=st.integers(0, 2), extra=st.integers(0, 2))
    def match_known(self, i, cut, extra):
        key = self.keys[i % len(self.keys)]
        self.match(key[: max(0, len(key) // P - cut) * P] + [extra])

    @rule(tokens=seqs, give_window=mostly, give_state=mostly)
    def insert(self, tokens, give_window, give_state):
        self.keys.append(list(tokens))
        num_pages = len(tokens) // P
        end = num_pages * P
        full_ids = self.ids(num_pages)
        window_ids = self.ids(num_pages) if give_window else None
        state_ids = self.ids(num_pages) if give_state else None
        cached = self.cached(tokens)
        res = self.tree.insert(tokens, full_ids, components=[window_ids, state_ids])
        assert res.num_cached_tokens == cached
        for k in range(cached // P, num_pages):
            self.full[tuple(tokens[: (k + 1) * P])] = int(full_ids[k])
        ends = {n for n in range(P, end, P) if self.branch(tuple(tokens[:n]))}
        if 0 < cached < end:
            ends.add(cached)
        if end:
            ends.add(end)
        taken = set()
        for e in ends:
            for n in range(max(P, e - W_PAGES * P + P), e + 1, P):
                prefix = tuple(tokens[:n])
                if window_ids is not None and prefix not in self.window:
                    self.window[prefix] = int(window_ids[n // P - 1])
                    taken.add(self.window[prefix])
            prefix = tuple(tokens[:e])
            if state_ids is not None and prefix not in self.state:
                self.state[prefix] = int(state_ids[e // P - 1])
                taken.add(self.state[prefix])
        given = set()
        for t in (window_ids, state_ids):
            if t is not None:
                given.update(t.tolist())
        assert set(res.unused_pages.tolist()) == given - taken

    @rule(tokens=seqs)
    def match(self, tokens):
        expected = self.servable(tokens)
        m = self.tree.match_prefix(tokens)
        assert (m.device_len, m.host_len, m.full_len) == (expected, 0, self.cached(tokens))

    @rule(tokens=seqs)
    def lock(self, tokens):
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.last_device_node)
        self.locks.append((m.last_device_node, tuple(tokens[: m.device_len])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.unlock(node)

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        locked = self.locked()
        evictable = sum(p not in locked for d in (self.full, self.window, self.state) for p in d)
        res = self.tree.evict_device(num_tokens)
        freed = res.page_ids.tolist()
        assert len(set(freed)) == len(freed), "a page was returned twice"
        assert len(freed) >= min(-(-num_tokens // P), evictable), "evicted less than it could"
        assert res.num_evicted_tokens == P * len(set(self.full.values()).intersection(freed))
        for store in (self.full, self.window, self.state):
            gone = [p for p, page in store.items() if page in set(freed)]
            assert not locked.intersection(gone), "evicted a locked prefix's data"
            for p in gone:
                del store[p]
        assert len(freed) == evictable - sum(
            p not in locked for d in (self.full, self.window, self.state) for p in d
        ), "freed a page id the model does not know"
        for p in self.full:
            assert len(p) == P or p[:-P] in self.full
        for store in (self.window, self.state):
            assert set(store) <= set(self.full), "component data without its full page"

    @precondition(lambda self: self.tree.num_nodes)
    @rule(i=st.integers(0, 100), c=st.integers(0, 1))
    def drop_component(self, i, c):
        nodes = list(self.tree.nodes())
        node = nodes[i % len(nodes)]
        if node.component_pages(c, "device") is None or node.lock_ref:
            return
        freed = set(self.tree.detach_component(node, c, "device").tolist())
        store = self.window if c == 0 else self.state
        for p in [p for p, page in store.items() if page in freed]:
            del store[p]

    @rule(i=st.integers(0, 100), call=st.integers(0, 7),
          bad=st.sampled_from([("c", -1), ("c", 2), ("c", True), ("c", None),
                               ("tier", "disk"), ("tier", None), ("n", -1), ("n", 1.5),
                               ("n", "2"), ("ns", []), ("ns", 5), ("ns", b"a")]))
    def bad_component_call(self, i, call, bad):
        """A component call with a bad component, tier, count or namespace raises
        TypeError / ValueError and changes nothing (the invariant checks the model)."""
        nodes = list(self.tree.nodes()) or [self.tree.root()]
        node = nodes[i % len(nodes)]
        kind, value = bad
        c = value if kind == "c" else 0
        tier = value if kind == "tier" else "device"
        n = value if kind == "n" else 1
        ns = value if kind == "ns" else None
        key = b"\x00" * 4 * P
        calls = [
            lambda: self.tree.num_component_pages(c, tier),
            lambda: self.tree.component_table(node, c, tier),
            lambda: self.tree.component_gaps(key, c, tier, ns),
            lambda: self.tree.evict_component(c, tier, n),
            lambda: self.tree.detach_component(node, c, tier),
            lambda: self.tree.attach_component(node, c, tier, torch.tensor([-3])),
            lambda: self.tree.insert([0] * P, torch.tensor([10**6]), ns, components=[None, None]),
            lambda: self.tree.path_missing_host(node, n),
        ]
        takes = [{"c", "tier"}, {"c", "tier"}, {"c", "tier", "ns"}, {"c", "tier", "n"},
                 {"c", "tier"}, {"c", "tier"}, {"ns"}, {"n"}][call]
        if kind not in takes:
            return  # (the call does not take that argument)
        if kind == "ns" and call == 2:  # a read: a hashable non-str names no root (no
            try:                         # error), an unhashable one raises TypeError
                calls[call]()
            except TypeError:
                pass
            return
        with pytest.raises((TypeError, ValueError)):
            calls[call]()

    @invariant()
    def integrity(self):
        self.tree.check_integrity()
        assert self.tree.device_tokens == P * len(self.full)
        assert self.tree.num_component_pages(0, "device") == len(self.window)
        assert self.tree.num_component_pages(1, "device") == len(self.state)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_hybrid_tree_matches_reference_model(kind):
    machine = type(f"HybridVsModel_{kind}", (HybridVsModel,), {"kind": kind})
    machine.TestCase.settings = settings(
        max_examples=80, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_hybrid_tree_random_walks_match_reference_model(kind):
    """The same machine driven by seeded random walks: Hypothesis prefers short runs, and
    a missing window page needs a key, its next turn, a dropped component and a match."""
    machine = type(f"HybridWalk_{kind}", (HybridVsModel,), {"kind": kind})
    for seed in range(150):
        rng = random.Random(seed)
        m = machine()

        def toks(rng=rng):
            return [rng.randrange(3) for _ in range(rng.randrange(13))]

        for _ in range(40):
            r = rng.random()
            if r < 0.2:
                m.insert(toks(), rng.random() < 0.75, rng.random() < 0.75)
            elif r < 0.4:
                m.extend(rng.randrange(100), rng.randrange(2), rng.randrange(3), rng.randrange(3),
                         rng.random() < 0.75, rng.random() < 0.75)
            elif r < 0.55:
                m.match_known(rng.randrange(100), rng.randrange(3), rng.randrange(3))
            elif r < 0.65 and m.tree.num_nodes:
                m.drop_component(rng.randrange(100), rng.randrange(2))
            elif r < 0.72:
                m.evict(rng.randrange(13))
            elif r < 0.8:
                m.lock(toks())
            elif r < 0.88 and m.locks:
                m.unlock(rng.randrange(100))
            else:
                m.match(toks())
            m.integrity()
