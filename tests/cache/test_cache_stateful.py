"""Hypothesis state machine: random interleavings of requests and transfers on HiCache.

Several requests (two namespaces) are live at once; each rule is one step of one
of them (match, load-back at any point, allocate + compute, insert, decode
continuation: extend + allocate + insert again, abort, possibly mid-load) or of
the transfers (complete a layer of any transfer, in any order across transfers,
fail one, poll) or of memory pressure (evict by allocating). The manual executor
copies a layer only when a rule completes it, so every order of IO against
eviction is reachable. A request writes the KV of each position once, as an
engine does, so a page table that moves under it is caught. After every step:
``check_integrity()``, the KV of every readable page verified with ``kvcheck``,
and every request whose loads have all landed reads exactly its sequence's KV
through its page table. With nothing in flight, ``alloc`` succeeds exactly when
free plus unlocked device pages cover it. At the end everything is driven to
quiescence: zero leaked pages on both tiers, no lock left. Runs on both trees.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kv_layouts import TREE_KINDS
from leak_checks import assert_no_leaks

from hicache.cache import HiCache, LoadError
from hicache.config import CacheConfig, KVConfig
from hicache.sim import kvcheck
from hicache.transfer import TransferKind

P = 2
KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16", page_size=P)
MAX_LIVE = 4
# Shared stems make prefixes collide (hits, splits, loads); the tails make them diverge.
STEMS = [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 3, 3], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5], [1, 2]]
prompts = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 3), min_size=0, max_size=4),
)
namespaces = st.sampled_from([None, "t1"])


class Request:
    def __init__(self, h, tokens: list[int], ns: str | None) -> None:
        self.h = h
        self.tokens = tokens
        self.ns = ns
        self.inserted = False
        # Positions whose KV was written through the page table. Not rewritten while
        # the handle's pages cover them: a page table that moves under the request
        # shows up as wrong KV. A failed load's cut-back frees the pages: reset then.
        self.written = 0

    def kv_len(self) -> int:
        """Leading positions whose KV the request's page table must hold."""
        h = self.h
        if h.prefix_len + h.num_owned_pages * P < self.written:
            self.written = 0  # cut back: recomputed from prefix_len
        return max(self.written, h.prefix_len)

    def is_written(self) -> bool:
        return self.kv_len() >= len(self.tokens)

    def mark_written(self) -> None:
        self.written = len(self.tokens)


def loads_landed(h) -> bool:
    """True when every load ``h`` depends on has landed without error (manual executor)."""
    try:
        for layer in range(KV.num_layers):
            h.wait_layer(layer)
    except LoadError:
        return False
    return True


class CacheMachine(RuleBasedStateMachine):
    TREE = "python"
    KV = KV  # a hybrid layout in tests/cache/test_components_stateful.py

    def __init__(self) -> None:
        super().__init__()
        self.cache: HiCache | None = None
        self.live: list[Request] = []

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        device_pages=st.integers(4, 10),
        host_pages=st.integers(2, 24),
        load_threshold=st.sampled_from([0, 0, 4]),
    )
    def setup(self, policy, device_pages, host_pages, load_threshold):
        cfg = CacheConfig(
            self.KV, device_tokens=device_pages * P, host_tokens=host_pages * P,
            executor="manual",
            host_reserve_nbytes=0, write_policy=policy, load_threshold_tokens=load_threshold,
            tree=self.TREE,
        )
        self.cache = HiCache(cfg)
        self.policy = policy

    @property
    def executor(self):
        return self.cache.transfers.executor

    # ---------------------------------------------------------------- requests
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=prompts, ns=namespaces, load_back=st.booleans())
    def match(self, tokens, ns, load_back):
        h = self.cache.match(tokens, ns, load_back=load_back)
        assert h.prefix_len <= len(tokens) // P * P
        self.live.append(Request(h, tokens, ns))

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=prompts, ns=namespaces)
    def match_and_compute(self, tokens, ns):
        """Match without loading back, then allocate and write the rest at once (an
        engine that recomputes host hits, or whose load was refused)."""
        req = Request(self.cache.match(tokens, ns, load_back=False), tokens, ns)
        self.live.append(req)
        self._compute(req)

    @precondition(lambda self: self.cache is not None)
    @rule(tokens=prompts, ns=namespaces)
    def serve(self, tokens, ns):
        """A whole request while the others stay in flight; completes only its own loads."""
        before = self.executor.pending()
        req = Request(self.cache.match(tokens, ns), tokens, ns)
        for t in self.executor.pending():
            if t not in before:
                assert self.executor.complete(t)
        if self._compute(req):
            self._insert(req)
        self.cache.release(req.h)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def load_back(self, data):
        """At any point: refused while the handle owns pages (they hold later positions)."""
        req = data.draw(st.sampled_from(self.live))
        h = req.h
        owned, prefix, table = h.num_owned_pages, h.prefix_len, h.page_table().clone()
        try:
            self.cache.load_back(h)
        except ValueError as exc:
            assert owned and "load_back" in str(exc), exc
            assert h.prefix_len == prefix and h.page_table().equal(table)
        # (were it accepted with pages owned, the KV check below would catch the
        # positions it maps onto pages written for others)

    @precondition(lambda self: any(r.inserted for r in self.live))
    @rule(data=st.data(), more=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, data, more):
        """Decode continuation: extend an inserted sequence, allocate, write, insert again."""
        req = data.draw(st.sampled_from([r for r in self.live if r.inserted]))
        h = req.h
        if not req.is_written():
            return  # cut back by a failed load: advance recomputes first
        old_len = len(req.tokens)
        tokens = req.tokens + more
        covered = h.prefix_len + h.num_owned_pages * P
        req.tokens = tokens  # (what _alloc asks checkpoints for)
        if covered < len(tokens) and self._alloc(h, len(tokens) - covered, req) is None:
            req.tokens = tokens[:old_len]
            return
        req.inserted = False
        if h.prefix_len + h.num_owned_pages * P < len(tokens):
            req.written = 0  # this alloc applied a failed load: recompute from prefix_len
            return
        self._write(req, old_len, len(tokens))  # only the new positions
        req.mark_written()
        req.inserted = False
        self._insert(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def advance(self, data):
        """The next step of one request: compute the rest, insert it, or finish."""
        req = data.draw(st.sampled_from(self.live))
        if req.inserted:
            self.live.remove(req)
            self.cache.release(req.h)
        elif not self._compute(req):
            return
        else:
            self._insert(req)

    def _marks(self, req: Request | None, h, num_tokens: int) -> list[int]:
        """The checkpoints an alloc asks for (hybrid models' state components)."""
        return []

    def _write(self, req: Request, start: int, end: int) -> None:
        """The model's forward: write positions ``[start, end)`` through the page table."""
        kvcheck.write_kv(self.cache.device_pool, req.h.page_table(), req.tokens, start, end,
                         req.ns)

    def _verify(self, req: Request, end: int) -> None:
        """What a request whose loads landed reads: exactly its sequence's KV up to ``end``."""
        bad = kvcheck.verify_kv(self.cache.device_pool, req.h.page_table(), req.tokens, end,
                                req.ns)
        assert bad == [], f"request {req.tokens} ({req.ns}) reads wrong KV at {bad}"

    def _alloc(self, h, num_tokens: int, req: Request | None = None):
        """``cache.alloc``, checking liveness: with nothing in flight (and no write-back
        backup to wait for), it succeeds exactly when free + unlocked pages cover it."""
        cache = self.cache
        marks = self._marks(req, h, num_tokens)
        need = -(-num_tokens // P)
        if h._components is not None:  # hybrid models: component pages come with them
            need += h._components.extra_pages(need, [m for m in marks if m not in {
                p for cps in h._components.checkpoints.values() for p in cps}])
        exact = not self.executor.pending() and self.policy != "write_back"
        room = (cache.device_allocator.num_free_pages + cache.tree.device_evictable_tokens // P
                + cache.tree.device_component_evictable_pages)
        before = cache.stats()
        prefix = h.prefix_len
        pages = cache.alloc(h, num_tokens, checkpoints=marks)
        if exact and h.prefix_len == prefix:
            assert (pages is not None) == (need <= room), (
                f"alloc of {need} pages: {pages is not None}, but free + evictable = {room}"
            )
        if pages is None and not self.executor.pending() and h.prefix_len == prefix:
            after = cache.stats()
            assert after["device_evicted_tokens"] == before["device_evicted_tokens"], (
                "a refused alloc evicted"
            )
        return pages

    def _compute(self, req: Request) -> bool:
        """Allocate pages for the rest of the sequence and write its KV (the model's forward).

        Each position is written once, as an engine does: no rewrite can hide a page
        table that moved under the request.
        """
        h = req.h
        if req.is_written():
            return True
        covered = h.prefix_len + h.num_owned_pages * P
        missing = len(req.tokens) - covered
        if missing > 0 and self._alloc(h, missing, req) is None:
            return False  # out of device pages: a normal outcome
        if h.prefix_len + h.num_owned_pages * P < len(req.tokens):
            return False  # a failed load cut the prefix back meanwhile: allocate again later
        self._write(req, h.prefix_len, len(req.tokens))
        req.mark_written()
        return True

    def _insert(self, req: Request) -> None:
        h = req.h
        if not loads_landed(h):
            if any(rec.handle.error is not None for rec in h._loads):
                assert not self.cache.finish_loads(h)  # the owner applies its failure
                assert h.load_error is not None
            return  # the model would wait; a later step inserts
        self.cache.poll()
        if not req.is_written():
            return  # cut back by a failure applied just now
        try:
            self.cache.insert(h, req.tokens)
        except LoadError:
            # a failure an earlier call of this request applied, not yet reported:
            # the engine calls finish_loads, then recomputes from prefix_len
            assert not self.cache.finish_loads(h) and h.load_error is not None
            return
        req.inserted = True
        req.mark_written()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        self.cache.release(req.h)

    # --------------------------------------------------------------- transfers
    @precondition(lambda self: self.cache is not None and self.executor.pending())
    @rule(data=st.data())
    def complete_layer(self, data):
        t = data.draw(st.sampled_from(self.executor.pending()))
        assert self.executor.complete_layer(t)

    @precondition(lambda self: self.cache is not None and self.executor.pending())
    @rule(data=st.data())
    def complete_transfer(self, data):
        t = data.draw(st.sampled_from(self.executor.pending()))
        assert self.executor.complete(t)

    @precondition(lambda self: self.cache is not None and self.executor.pending())
    @rule(data=st.data())
    def fail_transfer(self, data):
        t = data.draw(st.sampled_from(self.executor.pending()))
        self.executor.fail(t, RuntimeError("injected"))

    @precondition(lambda self: self.cache is not None)
    @rule()
    def poll(self):
        self.cache.poll()

    @precondition(lambda self: self.cache is not None)
    @rule(num_pages=st.integers(1, 8))
    def pressure(self, num_pages):
        """Another request wants ``num_pages`` device pages: eviction runs."""
        h = self.cache.match([])
        self._alloc(h, num_pages * P)
        self.cache.release(h)

    @precondition(lambda self: self.cache is not None)
    @rule()
    def offload(self):
        """Land every backup in flight, then push all that is unlocked off the device:
        later matches find host-only continuations (loads, load_back)."""
        for t in self.executor.pending():
            if t.kind is TransferKind.BACKUP:
                assert self.executor.complete(t)
        self.cache.poll()
        h = self.cache.match([])
        self.cache.alloc(h, self.cache.device_allocator.num_pages * P)
        self.cache.release(h)

    # --------------------------------------------------------------- checks
    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        self.cache.check_integrity()
        assert kvcheck.verify_cache(self.cache) == []
        for req in self.live:
            if loads_landed(req.h):
                # the whole sequence once written (the page table the model used), else
                # the prefix
                self._verify(req, req.kv_len())

    def _drain(self) -> None:
        """Land every transfer, including retries that applying a failure submits."""
        for _ in range(100):
            self.cache.poll()  # first: a failed transfer is applied (and maybe retried) here
            todo = self.executor.pending()
            if not todo:
                return
            for t in todo:
                assert self.executor.complete(t)
        raise AssertionError("transfers still in flight after 100 rounds")

    def teardown(self):
        cache = self.cache
        if cache is None:
            return
        self._drain()
        for req in self.live:
            cache.release(req.h)
        # A failure applied by the polls above or by release may submit a retry.
        self._drain()
        assert_no_leaks(cache)
        assert kvcheck.verify_cache(cache) == []
        cache.close()


class NativeTreeCacheMachine(CacheMachine):
    TREE = "native"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
if "native" in TREE_KINDS:
    TestNativeTreeCacheMachine = NativeTreeCacheMachine.TestCase
    TestNativeTreeCacheMachine.settings = TestCacheMachine.settings


@pytest.mark.slow
def test_cache_machine_long():
    settings_long = settings(
        max_examples=1000, stateful_step_count=80, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(CacheMachine, settings=settings_long)


class _Pick:
    """Stands in for hypothesis' ``data`` in a directed run: draws the given request."""

    def __init__(self, req: Request) -> None:
        self.req = req

    def draw(self, strategy):
        return self.req


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_machine_directed_load_back_after_alloc(tree):
    """The machine's own rules and checks, in the order that exposed issue 16 item 1:
    a host-only continuation matched without loading, computed, then loaded back.
    (Before the fix the KV check reported the computed positions as wrong KV.)"""
    machine = CacheMachine()
    machine.TREE = tree
    machine.setup(policy="write_through", device_pages=10, host_pages=24, load_threshold=0)
    stem = STEMS[0]
    steps = [
        lambda: machine.serve(stem, None),
        machine.offload,
        lambda: machine.match_and_compute(stem + [1, 1], None),
        lambda: machine.load_back(_Pick(machine.live[-1])),
        lambda: [machine.executor.complete(t) for t in machine.executor.pending()],
        lambda: machine.advance(_Pick(machine.live[-1])),
        lambda: machine.decode(_Pick(machine.live[-1]), [2, 3, 1]),
    ]
    for step in steps:
        step()
        machine.consistent()
    machine.teardown()
