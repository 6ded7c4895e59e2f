"""The cache state machine (tests/cache/test_cache_stateful.py) over a hybrid KV layout.

Every request also writes its window pages (salted KV of each position) and the
checkpoints it asked for (the state after the inserted length and after the full
match, salted), as a hybrid model's forward does; every read checks, bitwise, the
window pages a hit reads and the checkpoint it starts from; ``kvcheck.verify_cache``
checks every readable component page of every node in both tiers. With interleaved
loads, backups, failures, eviction and decode continuations, on both trees.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from kv_layouts import TREE_KINDS
from test_cache_stateful import CacheMachine, Request

from hicache.components import ComponentSpec
from hicache.config import KVConfig
from hicache.sim import kvcheck

P = 2
SPECS = (ComponentSpec("window", window_tokens=4, width=2), ComponentSpec("state"))
W, S = 0, 1
HYBRID_KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float16", page_size=P,
                     components=SPECS)
WINDOW_PAGES = SPECS[0].window_pages(P)  # 2


class HybridCacheMachine(CacheMachine):
    KV = HYBRID_KV

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


TestHybridCacheMachine = HybridCacheMachine.TestCase
TestHybridCacheMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
if "native" in TREE_KINDS:
    TestNativeHybridCacheMachine = NativeHybridCacheMachine.TestCase
    TestNativeHybridCacheMachine.settings = TestHybridCacheMachine.settings


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
