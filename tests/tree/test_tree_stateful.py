"""Hypothesis state machine: the tree against a reference model of cached prefixes.

The model is a set of cached whole-page prefixes plus the page id that holds
each prefix's last page. Evicted page ids tell the model which prefixes left.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_layouts import TREE_KINDS

from hicache.tree import RadixTree

P = 2
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)


def make(kind: str):
    if kind == "python":
        return RadixTree(P)
    from hicache.tree.native import NativeRadixTree

    return NativeRadixTree(P)


class TreeVsModel(RuleBasedStateMachine):
    kind = "python"

    def __init__(self) -> None:
        super().__init__()
        self.tree = make(self.kind)
        self.cached: dict[tuple, int] = {}  # whole-page prefix -> page id of its last page
        self.locks: list[tuple[object, tuple]] = []  # (node, prefix) per lock taken
        self.next_page = 0

    def model_match(self, tokens: list[int]) -> int:
        n = 0
        while n + P <= len(tokens) and tuple(tokens[: n + P]) in self.cached:
            n += P
        return n

    def locked_prefixes(self) -> set[tuple]:
        out = set()
        for _, prefix in self.locks:
            for n in range(P, len(prefix) + 1, P):
                out.add(prefix[:n])
        return out

    @rule(tokens=seqs)
    def insert(self, tokens):
        num_pages = len(tokens) // P
        ids = torch.arange(self.next_page, self.next_page + num_pages, dtype=torch.int64)
        self.next_page += num_pages
        expected = self.model_match(tokens)
        res = self.tree.insert(tokens, ids)
        assert res.num_cached_tokens == expected
        for k in range(expected // P, num_pages):
            self.cached[tuple(tokens[: (k + 1) * P])] = int(ids[k])

    @rule(tokens=seqs)
    def match(self, tokens):
        m = self.tree.match_prefix(tokens)
        assert m.device_len == self.model_match(tokens)
        assert m.host_len == 0
        got = self.tree.device_indices_of(m.last_device_node).tolist()
        want = [self.cached[tuple(tokens[: (k + 1) * P])] for k in range(m.device_len // P)]
        assert got == want

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
        locked = self.locked_prefixes()
        evictable = len(self.cached) - len(locked)
        res = self.tree.evict_device(num_tokens)
        freed = set(res.page_ids.tolist())
        assert len(freed) == len(res.page_ids), "a page was returned twice"
        want_pages = min(-(-num_tokens // P), evictable)
        assert len(freed) == want_pages, "evicted more or less than asked"
        assert res.num_evicted_tokens == want_pages * P
        gone = [p for p, page in self.cached.items() if page in freed]
        assert len(gone) == len(freed), "evicted a page the model does not know"
        assert not locked.intersection(gone), "evicted a locked prefix"
        for p in gone:
            del self.cached[p]
        # what is left is still prefix-closed (leaves go first)
        for p in self.cached:
            assert len(p) == P or p[:-P] in self.cached

    @invariant()
    def integrity(self):
        self.tree.check_integrity()
        assert self.tree.device_tokens == P * len(self.cached)
        assert self.tree.device_protected_tokens == P * len(self.locked_prefixes())


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_matches_reference_model(kind):
    machine = type(f"TreeVsModel_{kind}", (TreeVsModel,), {"kind": kind})
    settings_ = settings(
        max_examples=60, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase.settings = settings_
    machine.TestCase().runTest()
