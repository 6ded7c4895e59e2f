"""The cache state machine (tests/cache/test_cache_stateful.py) over a hybrid KV layout.

Every request also writes its window pages (salted KV of each position) and the
checkpoints it asked for (the state after the inserted length and after the full
match, salted), as a hybrid model's forward does; every read checks, bitwise, the
window pages a hit reads and the checkpoint it starts from; ``kvcheck.verify_cache``
checks every readable component page of every node in both tiers. With interleaved
loads, backups, failures, eviction and decode continuations, on both trees.

The hybrid machines also draw (issue 45): host tiers of 2-4 pages (a backup must make
room without evicting its own node's host copy), component budgets below 1 (the budget
never takes what the inserting request reads), prefixes served again with a
checkpoint they lacked (a node's components change after it reached the host tier: a
backup copies just those), bad component indices, checkpoints and namespaces on every
call that takes them (refused, nothing changed), and a bookkeeping-only machine
(``allocate_kv=False``) under every write policy, write-back included.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, invariant, precondition, rule
from kv_layouts import TREE_KINDS
from leak_checks import assert_no_leaks
from test_cache_stateful import STEMS, CacheMachine, Request, namespaces

from hicache.cache import HiCache
from hicache.components import ComponentSpec
from hicache.config import CacheConfig, KVConfig
from hicache.sim import kvcheck

P = 2
SPECS = (ComponentSpec("window", window_tokens=4, width=2), ComponentSpec("state"))
W, S = 0, 1
HYBRID_KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16", page_size=P,
                     components=SPECS)
WINDOW_PAGES = SPECS[0].window_pages(P)  # 2


BAD_COMPONENTS = [-1, 2, True, 1.0, None, "0", 2**64]
BAD_CHECKPOINTS = [{1}, {3}, {-2}, {10**6}, 4, "4", {2.0}, [None], {True}]
BAD_NAMESPACES = [[], 5, b"t1", ("t1",), 1.5]


class HybridCacheMachine(CacheMachine):
    KV = HYBRID_KV
    ALLOCATE_KV = True

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        device_pages=st.integers(4, 10),
        host_pages=st.one_of(st.integers(2, 4), st.integers(2, 24)),
        load_threshold=st.sampled_from([0, 0, 4]),
        device_fraction=st.sampled_from([1.0, 1.0, 0.6, 0.3, 0.1]),
        host_fraction=st.sampled_from([1.0, 1.0, 0.5, 0.25]),
    )
    def setup(self, policy, device_pages, host_pages, load_threshold, device_fraction=1.0,
              host_fraction=1.0):
        extra = {} if self.ALLOCATE_KV else {"allocate_kv": False}
        cfg = CacheConfig(
            self.KV, device_tokens=device_pages * P, host_tokens=host_pages * P,
            executor="manual", host_reserve_nbytes=0, write_policy=policy,
            load_threshold_tokens=load_threshold, tree=self.TREE,
            component_device_fraction=device_fraction, component_host_fraction=host_fraction,
            **extra,
        )
        self.cache = HiCache(cfg)
        self.policy = policy

    @precondition(lambda self: self.cache is not None)
    @rule(stem=st.sampled_from(STEMS), cut=st.integers(1, 5), ns=namespaces)
    def serve_prefix(self, stem, cut, ns):
        """Serve a page-aligned prefix of a stem: a node end (a branch point, or a split)
        gets the checkpoint it lacked, often after the node reached the host tier (its
        backup then copies just the new data)."""
        self.serve(stem[: min(len(stem), cut * P)], ns)

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data())
    def regain_checkpoint(self, data):
        """Serve exactly the path of a node already in host memory that has no checkpoint
        on the device: the insert gives it one, and write-through backs up just that into
        its host copy (host room made without evicting that host copy)."""
        tree = self.cache.tree
        nodes = [n for n in tree.nodes()
                 if n.host_indices is not None and n.component_pages(S, "device") is None]
        if not nodes:
            return
        node = data.draw(st.sampled_from(nodes))
        tokens = [int(t) for n in tree.path_to(node) for t in n.tokens()]
        self.serve(tokens, node.namespace)

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data(), which=st.sampled_from(["component", "checkpoints", "namespace"]))
    def bad_component_call(self, data, which):
        """A component call with a bad component index, checkpoints or namespace is
        refused (TypeError / ValueError) and changes nothing."""
        cache = self.cache
        before = (cache.stats(), cache.device_allocator.num_used_pages,
                  cache.host_allocator.num_used_pages, cache.tree.namespaces())
        live = self.live
        if which == "namespace":
            bad = data.draw(st.sampled_from(BAD_NAMESPACES))
            call = data.draw(st.sampled_from(["match", "pin"]))
            with pytest.raises((TypeError, ValueError)):
                if call == "match":
                    cache.match([0, 1, 2, 3], bad)
                else:
                    cache.pin([0, 1, 2, 3], bad)
        elif not live:
            return
        else:
            h = data.draw(st.sampled_from(live)).h
            if which == "component":
                bad = data.draw(st.sampled_from(BAD_COMPONENTS))
                call = data.draw(st.sampled_from(["window_table", "state_pages"]))
                with pytest.raises((TypeError, ValueError)):
                    getattr(h, call)(bad)
            else:
                bad = data.draw(st.sampled_from(BAD_CHECKPOINTS))
                owned = h.num_owned_pages
                with pytest.raises((TypeError, ValueError)):
                    cache.alloc(h, 2, checkpoints=bad)
                assert h.num_owned_pages == owned
        after = (cache.stats(), cache.device_allocator.num_used_pages,
                 cache.host_allocator.num_used_pages, cache.tree.namespaces())
        assert before == after, f"a refused call changed the cache: {before} -> {after}"

    def _marks(self, req: Request | None, h, num_tokens: int) -> list[int]:
        if req is None:
            return []
        high = h.prefix_len + P * (h.num_owned_pages + -(-num_tokens // P))
        end = len(req.tokens) // P * P
        return [pos for pos in {end, h.full_len} if h.prefix_len < pos <= min(end, high)]

    def _write(self, req: Request, start: int, end: int) -> None:
        super()._write(req, start, end)
        h, pool = req.h, self.cache.device_pool
        kvcheck.write_window(pool, h.window_table(W), req.tokens, start, end, req.ns, W)
        for pos, ids in h.state_pages(S).checkpoints.items():
            if start < pos <= end:
                kvcheck.write_state(pool, ids, req.tokens, pos, req.ns, S)

    def _verify(self, req: Request, end: int) -> None:
        super()._verify(req, end)
        h, pool = req.h, self.cache.device_pool
        table = h.window_table(W)
        # what the first computed token reads: the window before the prefix's end
        lo = max(0, h.prefix_len // P - WINDOW_PAGES) * P
        assert bool((table[lo // P : -(-end // P)] >= 0).all()), "a window page is missing"
        bad = kvcheck.verify_window(pool, table, req.tokens, lo, end, req.ns, W)
        assert bad == [], f"request {req.tokens} ({req.ns}) reads wrong window KV at {bad}"
        state = h.state_pages(S)
        if state.read is not None:
            assert kvcheck.verify_state(pool, state.read, req.tokens, h.prefix_len, req.ns, S), (
                f"request {req.tokens} ({req.ns}) starts from a wrong checkpoint")
        for pos, ids in state.checkpoints.items():
            if pos <= end:
                assert kvcheck.verify_state(pool, ids, req.tokens, pos, req.ns, S)


class NativeHybridCacheMachine(HybridCacheMachine):
    TREE = "native"


class _NoTransfers:
    """A bookkeeping cache's executor as the machine's rules see it: nothing pending."""

    @staticmethod
    def pending() -> list:
        return []


class BookkeepingHybridMachine(HybridCacheMachine):
    """The hybrid machine with ``allocate_kv=False`` (replay, capacity planning): no KV
    to write or check, every transfer complete as it starts, every write policy
    (write-back included: its evictions back up the evicted leaf, often alone)."""

    ALLOCATE_KV = False

    @property
    def executor(self):
        return _NoTransfers()

    def _write(self, req: Request, start: int, end: int) -> None:
        pass  # no KV

    def _verify(self, req: Request, end: int) -> None:
        pass

    @invariant()
    def consistent(self):
        if self.cache is not None:
            self.cache.check_integrity()

    def teardown(self):
        cache = self.cache
        if cache is None:
            return
        for req in self.live:
            cache.release(req.h)
        assert_no_leaks(cache)
        cache.close()


class NativeBookkeepingHybridMachine(BookkeepingHybridMachine):
    TREE = "native"


TestHybridCacheMachine = HybridCacheMachine.TestCase
TestHybridCacheMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBookkeepingHybridMachine = BookkeepingHybridMachine.TestCase
TestBookkeepingHybridMachine.settings = TestHybridCacheMachine.settings
if "native" in TREE_KINDS:
    TestNativeHybridCacheMachine = NativeHybridCacheMachine.TestCase
    TestNativeHybridCacheMachine.settings = TestHybridCacheMachine.settings
    TestNativeBookkeepingHybridMachine = NativeBookkeepingHybridMachine.TestCase
    TestNativeBookkeepingHybridMachine.settings = TestHybridCacheMachine.settings


def test_the_machine_writes_and_checks_component_pages():
    """The checks can fail: a window page of a cached prefix overwritten is caught."""
    machine = HybridCacheMachine()
    machine.setup(policy="write_through", device_pages=40, host_pages=40, load_threshold=0)
    tokens = [0, 1, 2, 3, 0, 1, 2, 3]
    machine.serve(tokens, None)
    machine.consistent()
    node = next(n for n in machine.cache.tree.nodes() if n.component_pages(W, "device") is not None)
    page = int(node.component_pages(W, "device")[0])
    machine.cache.device_pool.k_buffers[0][page] += 1
    with pytest.raises(AssertionError):
        machine.consistent()
    machine.cache.device_pool.k_buffers[0][page] -= 1
    machine.consistent()
    machine.teardown()
