"""Differential tests: HiCache's C++ lifecycle against its Python lifecycle.

A bookkeeping-only HiCache (``allocate_kv=False``) runs match / alloc / insert /
release in C++ (``lifecycle="native"``). Hypothesis drives it and the Python
lifecycle over the Python tree (the reference) with the same requests, under
every write policy, with and without a host tier, a load threshold, every
eviction policy, priorities, pins and resets, several live requests and two
namespaces, and demands identical results after every step: returned lengths,
keys, pages (same ids, same order) and errors; the whole tree; both free
lists; every counter; and integrity.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_layouts import seq
from optional import skip_unless
from tree_observation import FORMS, as_form, host_takeable_by_definition, snapshot

from hicache.cache import HiCache
from hicache.config import CacheConfig, EvictionPolicy, KVConfig

pytestmark = skip_unless("native")

P = 2
KV = KVConfig(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16", page_size=P)
STEMS = [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 3, 3], [5, 5, 5, 5, 5, 5], [1, 2]]
prompts = st.builds(
    lambda stem, cut, tail: stem[:cut] + tail,
    st.sampled_from(STEMS),
    st.integers(0, 8),
    st.lists(st.integers(0, 3), min_size=0, max_size=5),
)

priorities = st.none() | st.integers(0, 3)  # the priority policy's ranks; None: not given


def outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        return "raise", (type(exc), str(exc))


def pages_list(pages) -> list[int] | None:
    return None if pages is None else pages.tolist()


def expect_alloc(cache: HiCache, num_tokens: int) -> bool:
    """Liveness, exact both ways: alloc succeeds iff free + unlocked device pages cover it.

    Nothing is ever in flight here, so every unlocked device page can be evicted
    (a host copy implies host copies of every ancestor: no unlocked node is stuck).
    """
    need = -(-num_tokens // P)
    if need > cache.device_allocator.num_pages:
        return False
    return need <= cache.device_allocator.num_free_pages + cache.tree.device_evictable_tokens // P


def handle_state(h) -> tuple:
    return (h.device_len, h.host_len, h.prefix_len, h.key, h.num_owned_pages, h._lock_node.id,
            [p.tolist() for p in h._new_pages])


class Lifecycles(RuleBasedStateMachine):
    """The reference (Python lifecycle, Python tree) and the C++ lifecycle, step by step."""

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        device_pages=st.integers(2, 10),
        host_pages=st.sampled_from([None, 3, 8, 40]),
        threshold=st.sampled_from([0, 0, 2 * P]),
        eviction=st.sampled_from([p.value for p in EvictionPolicy]),
    )
    def setup(self, policy, device_pages, host_pages, threshold, eviction):
        def config(**kw):
            return CacheConfig(
                KV, device_tokens=device_pages * P,
                host_tokens=None if host_pages is None else host_pages * P,
                write_policy=policy, load_threshold_tokens=threshold, eviction=eviction,
                allocate_kv=False, kv_events=True, **kw,
            )

        self.ref = HiCache(config(tree="python", lifecycle="python"))
        self.nat = HiCache(config(tree="native", lifecycle="native"))
        assert (self.ref.lifecycle, self.nat.lifecycle) == ("python", "native")
        self.live: list[tuple] = []  # (reference handle, native handle, tokens)

    def pick(self, i: int) -> tuple:
        return self.live[i % len(self.live)]

    @precondition(lambda self: len(self.live) < 4)
    @rule(tokens=prompts, ns=st.sampled_from([None, "b"]), load_back=st.booleans(),
          form=st.sampled_from(FORMS), priority=priorities)
    def match(self, tokens, ns, load_back, form, priority):
        ha = self.ref.match(as_form(tokens, form), ns, load_back=load_back, priority=priority)
        hb = self.nat.match(as_form(tokens, form), ns, load_back=load_back, priority=priority)
        assert handle_state(ha) == handle_state(hb)
        self.live.append((ha, hb, tokens))

    @rule(tokens=prompts, tail=st.lists(st.integers(0, 3), max_size=4),
          ns=st.sampled_from([None, "b"]), keep=st.booleans(), form=st.sampled_from(FORMS),
          priority=priorities)
    def serve(self, tokens, tail, ns, keep, form, priority):
        """One whole request: match, allocate, insert the prompt and its output, release."""
        ha = self.ref.match(as_form(tokens, form), ns)
        hb = self.nat.match(as_form(tokens, form), ns)
        assert handle_state(ha) == handle_state(hb)
        seq = tokens + tail
        want = expect_alloc(self.ref, len(seq) - ha.prefix_len)
        assert want == expect_alloc(self.nat, len(seq) - hb.prefix_len)
        pa = self.ref.alloc(ha, len(seq) - ha.prefix_len)
        pb = self.nat.alloc(hb, len(seq) - hb.prefix_len)
        assert pages_list(pa) == pages_list(pb)
        assert (pa is not None) == want, "alloc disagrees with free + evictable pages"
        if pa is not None:
            assert self.ref.insert(ha, as_form(seq, form), priority=priority) == self.nat.insert(
                hb, as_form(seq, form), priority=priority
            )
        assert handle_state(ha) == handle_state(hb)
        if keep and len(self.live) < 4:
            self.live.append((ha, hb, seq))
        else:
            self.ref.release(ha)
            self.nat.release(hb)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3), extra=st.integers(0, 3 * P))
    def alloc(self, i, extra):
        ha, hb, tokens = self.pick(i)
        want = expect_alloc(self.ref, extra)
        before = self.ref.stats()
        ra, rb = outcome(self.ref.alloc, ha, extra), outcome(self.nat.alloc, hb, extra)
        assert ra[0] == rb[0]
        if ra[0] == "ok":
            assert pages_list(ra[1]) == pages_list(rb[1])
            assert (ra[1] is not None) == want, "alloc disagrees with free + evictable pages"
            if ra[1] is None:  # a refused allocation touches nothing
                assert self.ref.stats() == before
        assert handle_state(ha) == handle_state(hb)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3), tail=st.lists(st.integers(0, 3), max_size=6),
          mode=st.sampled_from(["extend", "extend", "own", "random"]), form=st.sampled_from(FORMS))
    def insert(self, i, tail, mode, form):
        ha, hb, tokens = self.pick(i)
        if mode == "extend":  # the prefix, then what the request computed
            seq = np.frombuffer(ha.key, dtype=np.int32)[: ha.prefix_len].tolist() + tail
        elif mode == "own":  # its whole prompt (the prefix may be shorter)
            seq = tokens + tail
        else:  # may not start with the prefix: both must refuse alike
            seq = tail
        ra = outcome(self.ref.insert, ha, as_form(seq, form))
        rb = outcome(self.nat.insert, hb, as_form(seq, form))
        assert ra == rb
        assert handle_state(ha) == handle_state(hb)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3))
    def load_back(self, i):
        ha, hb, _ = self.pick(i)
        ra, rb = outcome(self.ref.load_back, ha), outcome(self.nat.load_back, hb)
        assert (ra[0], ra[1] is None) == (rb[0], rb[1] is None)
        assert handle_state(ha) == handle_state(hb)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 3))
    def release(self, i):
        ha, hb, _ = self.live.pop(i % len(self.live))
        self.ref.release(ha)
        self.nat.release(hb)

    @rule(storage=st.just(False))
    def reset(self, storage):
        assert self.ref.reset(storage=storage) == self.nat.reset(storage=storage)

    @rule(tokens=prompts, ns=st.sampled_from([None, "b"]), unpin=st.booleans())
    def pin(self, tokens, ns, unpin):
        if unpin:
            assert self.ref.unpin(tokens, ns) == self.nat.unpin(tokens, ns)
        else:
            assert self.ref.pin(tokens, ns) == self.nat.pin(tokens, ns)

    @invariant()
    def identical(self):
        if not hasattr(self, "ref"):
            return
        assert self.ref.stats() == self.nat.stats()
        assert snapshot(self.ref.tree) == snapshot(self.nat.tree)
        # The host-room pre-check of a backup reads this figure: it must be exact.
        takeable = host_takeable_by_definition(self.ref.tree)
        assert self.ref.tree.host_takeable_tokens == self.nat.tree.host_takeable_tokens == takeable
        for name in ("device_allocator", "host_allocator"):
            a, b = getattr(self.ref, name), getattr(self.nat, name)
            assert a.num_free_pages == b.num_free_pages, name
            assert a._free[: a.num_free_pages].tolist() == b._free[: b.num_free_pages].tolist()
        assert self.ref.counters == self.nat.counters
        assert self.ref.take_events() == self.nat.take_events()
        self.ref.check_integrity()
        self.nat.check_integrity()

    def teardown(self):
        if hasattr(self, "ref"):
            for ha, hb, _ in self.live:
                self.ref.release(ha)
                self.nat.release(hb)
            self.identical()
            assert self.nat.device_allocator.num_used_pages == self.nat.tree.device_tokens // P


def test_native_lifecycle_matches_python():
    Lifecycles.TestCase.settings = settings(
        max_examples=150, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    Lifecycles.TestCase().runTest()


@pytest.mark.slow
def test_native_lifecycle_matches_python_long():
    Lifecycles.TestCase.settings = settings(
        max_examples=2000, stateful_step_count=80, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    Lifecycles.TestCase().runTest()


def busy(lifecycle: str) -> tuple[HiCache, dict]:
    """A bookkeeping cache with a host-only prefix, live handles and a released one."""
    tree = "python" if lifecycle == "python" else "native"
    cache = HiCache(CacheConfig(KV, device_tokens=6 * P, host_tokens=16 * P, allocate_kv=False,
                                tree=tree, lifecycle=lifecycle))
    for prompt in (seq(100, 3), seq(200, 3), seq(300, 3)):  # the first ends host-only
        h = cache.match(prompt)
        cache.alloc(h, len(prompt))
        cache.insert(h, prompt)
        cache.release(h)
    owner = cache.match(seq(300, 2) + [7])
    assert cache.alloc(owner, 2 * P) is not None
    hit = cache.match(seq(300, 2))
    released = cache.match([1, 2])
    cache.release(released)
    return cache, {"owner": owner, "hit": hit, "released": released}


def state(cache: HiCache, handles: dict) -> tuple:
    allocs = tuple(
        a._free[: a.num_free_pages].tolist() for a in (cache.device_allocator,
                                                        cache.host_allocator)
    )
    return (cache.stats(), snapshot(cache.tree), allocs,
            {k: handle_state(h) + (h.released,) for k, h in handles.items()})


# (name, call, same message in both): token checks word their details per tree,
# the lifecycle's own checks must read the same.
BAD_CALLS = [
    ("match-float-tokens", lambda c, h: c.match(np.ones(4)), False),
    ("match-negative-token", lambda c, h: c.match([0, -1]), False),
    ("match-negative-np64", lambda c, h: c.match(np.array([0, -1], dtype=np.int64)), False),
    ("match-2d", lambda c, h: c.match(torch.zeros(2, 2, dtype=torch.int64)), False),
    ("match-generator", lambda c, h: c.match(t for t in range(4)), True),
    ("match-int-namespace", lambda c, h: c.match([1, 2], 3), False),
    ("match-load-back-int", lambda c, h: c.match([1, 2], load_back=1), True),
    ("alloc-negative", lambda c, h: c.alloc(h["owner"], -1), True),
    ("alloc-float", lambda c, h: c.alloc(h["owner"], 2.0), True),
    ("alloc-released", lambda c, h: c.alloc(h["released"], 2), True),
    ("insert-diverging", lambda c, h: c.insert(h["hit"], seq(301, 3)), True),
    ("insert-shorter-than-prefix", lambda c, h: c.insert(h["hit"], seq(300, 1)), True),
    ("insert-more-than-owned", lambda c, h: c.insert(h["owner"], seq(300, 6)), True),
    ("insert-no-pages-diverging", lambda c, h: c.insert(h["hit"], seq(400, 2)), True),
    ("insert-float-tokens", lambda c, h: c.insert(h["owner"], np.ones(4)), False),
    ("insert-negative-token", lambda c, h: c.insert(h["owner"], [-1, 0, 1, 2]), False),
    ("insert-negative-t32", lambda c, h: c.insert(
        h["owner"], torch.tensor(seq(300, 2) + [-1, 0], dtype=torch.int32)), False),
    ("insert-released", lambda c, h: c.insert(h["released"], [1, 2]), True),
    ("release-released", lambda c, h: c.release(h["released"]), True),
    ("release-str", lambda c, h: c.release("h"), True),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_same_error_and_nothing_changed(case):
    _, call, same_message = case
    outcomes = []
    for lifecycle in ("python", "native"):
        cache, handles = busy(lifecycle)
        assert cache.lifecycle == lifecycle
        before = state(cache, handles)
        with pytest.raises((ValueError, TypeError)) as info:
            call(cache, handles)
        assert state(cache, handles) == before, f"{lifecycle}: a rejected call changed the cache"
        cache.check_integrity()
        outcomes.append((type(info.value), str(info.value)))
        assert before[0]["host_cached_tokens"] > 0 and before[0]["device_evicted_tokens"] > 0
    (ta, ma), (tb, mb) = outcomes
    assert ta is tb, outcomes
    assert ma == mb if same_message else ma.split(":")[0] == mb.split(":")[0], outcomes


@pytest.mark.parametrize("lifecycle", ["python", "native"])
def test_alloc_beyond_the_device_tier_returns_none_and_evicts_nothing(lifecycle):
    cache, handles = busy(lifecycle)
    before = state(cache, handles)
    assert cache.alloc(handles["owner"], 10**30) is None
    assert cache.alloc(handles["owner"], cache.device_allocator.num_pages * P + 1) is None
    assert state(cache, handles) == before
    cache.check_integrity()


def test_native_handles_leave_no_node_behind():
    """Lock nodes cross as plain handles: evicted ones are freed, none waits for Python."""
    cache = HiCache(CacheConfig(KV, device_tokens=8 * P, host_tokens=8 * P, allocate_kv=False,
                                tree="native"))
    impl = cache.tree._impl
    for i in range(2000):
        prompt = seq(10 * (i % 50), 3)
        h = cache.match(prompt)
        if cache.alloc(h, len(prompt) - h.prefix_len) is not None:
            cache.insert(h, prompt)
        cache.release(h)
    assert cache.stats()["device_evicted_tokens"] > 1000 * P
    assert impl.num_detached() == 0 and len(cache.tree._proxies) == 0
    # Read through Python, a lock node gets a proxy and stays readable after removal.
    h = cache.match(seq(5000, 1))
    cache.alloc(h, P)
    cache.insert(h, seq(5000, 1))
    node = h._lock_node
    cache.release(h)
    for i in range(20):  # evict it (and back it up) many times over
        other = cache.match(seq(7000 + 10 * i, 4))
        cache.alloc(other, 4 * P)
        cache.insert(other, seq(7000 + 10 * i, 4))
        cache.release(other)
    assert node.parent is None and node.num_tokens == P  # removed, still readable
    cache.check_integrity()


def test_lifecycle_config():
    def config(**kw):
        return CacheConfig(KV, device_tokens=4 * P, host_tokens=8 * P, **kw)

    cases = [(dict(allocate_kv=False, tree="native"), "native"),
             (dict(allocate_kv=False, tree="python"), "python"),
             (dict(allocate_kv=False, lifecycle="python"), "python"),
             (dict(tree="native"), "python")]  # KV to move: Python
    for kwargs, expected in cases:
        cache = HiCache(config(**kwargs))
        assert cache.lifecycle == expected, kwargs
        cache.check_integrity()
    with pytest.raises(ValueError, match="lifecycle"):
        config(lifecycle="c++")
    for bad in (dict(), dict(allocate_kv=False, tree="python"),
                dict(allocate_kv=False, storage="file:/tmp/x")):
        with pytest.raises(ValueError, match="allocate_kv=False"):
            config(lifecycle="native", **bad)


def test_counters_are_exact_between_calls():
    """Counters read mid-run include the C++ lifecycle's counts up to that call."""
    cache = HiCache(CacheConfig(KV, device_tokens=4 * P, host_tokens=8 * P, allocate_kv=False,
                                tree="native"))
    h = cache.match(seq(0, 2))
    assert (cache.counters.requests, cache.counters.requested_tokens) == (1, 2 * P)
    cache.alloc(h, 2 * P)
    assert cache.insert(h, seq(0, 2)) == 2 * P
    assert cache.stats()["inserted_tokens"] == 2 * P
    assert cache.stats()["backups"] == 1  # write-through, complete at once
    cache.release(h)
    assert cache.stats()["device_pages_used"] == 2 and cache.stats()["host_pages_used"] == 2
    cache.check_integrity()
