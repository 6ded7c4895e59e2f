"""The vLLM connector's halves driven directly, without vLLM: plans, copies, races.

A small stand-in for vLLM (``MiniVllm``) allocates blocks, asks the scheduler
half for hits, runs the worker half through each step in vLLM's order and
"computes" a block by filling it with a value that identifies its page (a hash of
the tokens up to the page's end) and layer. Every loaded block is checked against
that value: stale or foreign KV cannot pass.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from minivllm import D, H, L, MiniVllm, P, block_of, make_kv, seq

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.scheduler.half import ScheduledRequest, SchedulerHalf
from hicache.integrations.vllm.worker.layout import BlockCopier, BlockLayout, block_planes
from hicache.memory import HostPool
from hicache.memory import copier as copier_module
from hicache.tree import token_key


@pytest.fixture
def make_vllm():
    made = []

    def factory(**kwargs) -> MiniVllm:
        m = MiniVllm(**kwargs)
        made.append(m)
        return m

    yield factory
    for m in made:
        m.close()


# ----------------------------------------------------------------- config
def test_config_rejects_bad_fields_by_name():
    with pytest.raises(ValueError, match="unknown field.*host_gigabytes"):
        ConnectorConfig.from_extra({"host_gigabytes": 4})
    with pytest.raises(ValueError, match="at most one of host_gb or host_tokens"):
        ConnectorConfig.from_extra({"host_gb": 1, "host_tokens": 64})
    with pytest.raises(ValueError, match="host_gb: expected > 0, got -1"):
        ConnectorConfig.from_extra({"host_gb": -1})
    with pytest.raises(TypeError, match="host_tokens: expected an int"):
        ConnectorConfig.from_extra({"host_tokens": "64"})
    with pytest.raises(ValueError, match="storage: expected 'file:DIR'"):
        ConnectorConfig.from_extra({"storage": "s3://bucket"})
    with pytest.raises(ValueError, match="write_policy: expected one of \\['write_through', "
                       "'write_through_selective', 'write_back'\\], got 'write_behind'"):
        ConnectorConfig.from_extra({"write_policy": "write_behind"})
    with pytest.raises(ValueError, match="storage_options: given without storage"):
        ConnectorConfig.from_extra({"storage_options": {"fsync": True}})
    with pytest.raises(ValueError, match="executor: expected one of"):
        ConnectorConfig.from_extra({"executor": "gpu"})
    for bad in (["1"], [True], "1", 1):
        with pytest.raises(TypeError, match="copy_cpus: expected a list of int CPU ids"):
            ConnectorConfig.from_extra({"copy_cpus": bad})
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="copy_cpus: expected one or more CPU ids >= 0"):
            ConnectorConfig.from_extra({"copy_cpus": bad})
    with pytest.raises(ValueError, match="copy_cpus: .*expected executor 'auto' or 'thread', "
                                         "got 'sync'"):
        ConnectorConfig.from_extra({"copy_cpus": [1], "executor": "sync"})
    with pytest.raises(ValueError, match="holds no whole block"):
        ConnectorConfig(host_tokens=3).num_host_pages(4, 1024)


def test_config_sizes_in_tokens_and_gb():
    assert ConnectorConfig(host_tokens=100).num_host_pages(32, 1 << 20) == 3
    # GB of 10**9 bytes, as CacheConfig.host_gb: HICACHE_HOST_GB means one size to both
    assert ConnectorConfig(host_gb=1).num_host_pages(32, 1 << 20) == 10**9 // (1 << 20) == 953
    assert ConnectorConfig().num_host_pages(32, 10**9) == 4  # default 4 GB
    assert ConnectorConfig(host_reserve_gb=2).host_reserve_nbytes == 2 * 10**9


# ----------------------------------------------------------------- layout
@pytest.mark.parametrize("layout", ["fused", "split"])
@pytest.mark.parametrize("native", [False, None])
def test_block_copier_round_trip(layout, native):
    kv = make_kv(layout, 8)
    for t in kv.values():
        t.copy_(torch.randn(t.shape))
    lay = BlockLayout(kv, 8, P)
    assert lay.planes_per_layer == (1 if layout == "fused" else 2)
    assert lay.page_nbytes == L * 2 * H * D * P * 4
    pool = HostPool(lay.host_kv_config(), 4, pin_memory=False, reserve_nbytes=0)
    copier = BlockCopier(lay, pool, native=native)
    before = {n: t.clone() for n, t in kv.items()}
    copier.backup(torch.tensor([5, 1]), torch.tensor([2, 0]), 0, L)
    copier.load(torch.tensor([2, 0]), torch.tensor([6, 7]), 0, 1)  # layer 0 only
    copier.load(torch.tensor([2, 0]), torch.tensor([6, 7]), 1, 2)
    for name, t in kv.items():
        for src, dst in ((5, 6), (1, 7)):
            for a, b in zip(block_of(before[name], src, 8), block_of(t, dst, 8), strict=True):
                assert torch.equal(a, b)
        for other in (0, 2, 3, 4):
            for a, b in zip(block_of(before[name], other, 8), block_of(t, other, 8), strict=True):
                assert torch.equal(a, b)


def test_worker_copies_on_one_native_thread(make_vllm, monkeypatch):
    """The worker's copies never fan out to more threads than the copy thread itself:
    vLLM's compute threads own the cores (and the copy thread shares one of them)."""
    m = make_vllm()
    copier = m.hook.inner
    if copier.lib is None:
        pytest.skip("native row copier unavailable")
    assert copier.max_threads == 1
    calls = []

    class Recording:
        def __init__(self, lib):
            self.lib = lib

        def hc_copy_rows(self, *args):
            calls.append(args[9])  # num_threads
            return self.lib.hc_copy_rows(*args)

    copier.lib = Recording(copier.lib)
    monkeypatch.setattr(copier_module, "_NATIVE_THREAD_MIN_NBYTES", 0)  # every copy "large"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = torch.arange(4)
        copier.backup(ids, ids, 0, L)
        copier.load(ids, ids, 0, L)
    finally:
        torch.set_num_threads(before)
    assert calls and set(calls) == {1}
    with pytest.raises(ValueError, match="max_threads"):
        BlockCopier(copier._layout, m.worker.host_pool, max_threads=0)


def _thread_cpus(worker) -> list[set[int]]:
    return [os.sched_getaffinity(t.native_id) for t in worker.transfers.executor._threads]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
@pytest.mark.parametrize("spare", [False, True])
def test_auto_executor_on_cpu_copies_beside_or_between_forwards(make_vllm, monkeypatch, spare):
    """Where the model runner's thread is bound to some cores (vLLM binds its compute
    threads), the copy threads run on the others while the forward runs: a save is
    still in flight after wait_for_save, and lands without the model runner's help.
    With no core free, a save is copied in wait_for_save itself (the model runner's
    thread, while vLLM's compute threads are idle): nothing is in flight after a step.
    Either way a block reused at the next step holds its page."""
    import hicache.integrations.vllm.worker.executor_choice as choice_module

    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setattr(choice_module, "spare_cpus",
                        lambda: frozenset({cpu} if spare else ()))
    m = make_vllm(executor="auto")
    if spare:
        assert m.worker.transfers.executor_name == "thread"
        assert _thread_cpus(m.worker) == [{cpu}, {cpu}]
        m.hook.save_delay_s = 0.05
    else:
        assert m.worker.transfers.executor_name == "sync"
    a = seq(8) + [1]
    m.add("a", a)
    m.step()
    assert m.worker.num_in_flight == (1 if spare else 0)
    m.worker.drain()
    assert m.worker.counters.save_blocks == 2
    m.finish("a")
    m.step()
    assert m.add("b", a) == 8
    m.step()
    assert m.loaded_ok("b") and not m.last_errors
    m.finish("b")
    m.step()
    m.quiesce()


@pytest.mark.parametrize("reserved", [None, "1"])
def test_a_cpu_worker_warns_once_that_its_thread_count_is_vllms_choice(make_vllm, monkeypatch,
                                                                       caplog, reserved):
    """vLLM's CPU backend keeps one more core off its worker when a KV connector is
    configured, unless VLLM_CPU_NUM_OF_RESERVED_CPU pins it: the worker says how many
    threads it computes on and why vLLM alone may differ; nothing when it is pinned."""
    from hicache.integrations.vllm.worker.executor_choice import thread_count_warning

    if reserved is None:
        monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", reserved)
    with caplog.at_level("WARNING", logger="hicache.integrations.vllm.worker"):
        m = make_vllm(executor="sync")
    said = [r.getMessage() for r in caplog.records if "thread(s) here" in r.getMessage()]
    if reserved is None:
        assert said == [thread_count_warning("cpu", torch.get_num_threads(), {})]
        assert f"vLLM computes on {torch.get_num_threads()} thread(s)" in said[0]
        assert "set VLLM_CPU_NUM_OF_RESERVED_CPU" in said[0]
    else:
        assert said == []
    assert thread_count_warning("cuda", 8, {}) is None
    m.check()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
def test_copy_cpus_pin_the_copy_threads_and_a_refused_set_is_an_error(make_vllm, monkeypatch):
    import hicache.integrations.vllm.worker.executor_choice as choice_module

    cpu = max(os.sched_getaffinity(0))
    m = make_vllm(executor="thread", copy_cpus=[cpu])
    assert _thread_cpus(m.worker) == [{cpu}, {cpu}]
    m.check()
    # No such CPU: named, not ignored.
    with pytest.raises(ValueError, match=r"cpus: expected CPUs this process may run on, got \[4095\]"):
        make_vllm(executor="auto", copy_cpus=[4095])
    # Spare cores found but outside this process's cpuset: auto falls back to "sync".
    monkeypatch.setattr(choice_module, "spare_cpus", lambda: frozenset({4095}))
    m2 = make_vllm(executor="auto")
    assert m2.worker.transfers.executor_name == "sync"
    m2.check()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity and 2 CPUs")
def test_storage_threads_leave_the_model_runners_core(make_vllm, tmp_path):
    """vLLM binds the model runner's thread to one core before the connector starts its
    threads; the third tier's threads run on every CPU instead (no spare core here),
    not behind that thread (which, in vLLM, spins there between steps)."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        m = make_vllm(storage=f"file:{tmp_path}", executor="sync")
    finally:
        os.sched_setaffinity(0, allowed)
    threads = m.worker.storage._threads
    assert [os.sched_getaffinity(t.native_id) for t in threads] == [allowed, allowed]
    m.check()


def test_worker_host_pool_is_mapped_in_at_start(make_vllm, monkeypatch):
    """Prefaulted at construction: the first save into a page pays no page fault then."""
    import hicache.integrations.vllm.worker.half as worker_module

    made = []

    def recording(*args, **kwargs):
        made.append(kwargs)
        return HostPool(*args, **kwargs)

    monkeypatch.setattr(worker_module, "HostPool", recording)
    m = make_vllm(executor="auto")
    assert [kw.get("prefault") for kw in made] == [True]
    assert not m.worker.host_pool.buffer.view(torch.uint8).any()
    m.check()


def test_block_planes_rejects_unknown_layouts():
    with pytest.raises(ValueError, match="expected \\(num_blocks=8"):
        block_planes(torch.zeros(4, 8, 2), 8)
    with pytest.raises(ValueError, match="contiguous"):
        block_planes(torch.zeros(8, 4, 4).transpose(1, 2), 8)


# ------------------------------------------------------------ scenarios
@pytest.mark.parametrize("executor", ["thread", "auto"])
def test_saved_blocks_come_back_after_vllm_dropped_them(make_vllm, executor):
    m = make_vllm(executor=executor)
    a = seq(14)  # 3 whole blocks + 2 tokens
    assert m.add("a", a) == 0
    plan = m.step()
    assert [len(s.block_ids) for s in plan.saves] == [3]
    m.finish("a")  # its blocks are free at once
    assert "a" not in m.reqs and len(m.free) == 16
    m.step()
    m.check()
    assert m.sched.stats()["host_pages_used"] == 3
    b = a[:12] + seq(6, 100)
    assert m.add("b", b) == 12  # three blocks from host memory
    plan = m.step()
    assert [len(op.block_ids) for op in plan.loads] == [3]
    assert m.loaded_ok("b") and not m.last_errors
    # b's fourth block is new: saved; its first three were cached and are not saved again
    assert [op.block_ids for op in plan.saves] == [[m.reqs["b"]["blocks"][3]]]
    m.finish("b")
    m.step()
    m.quiesce()
    assert m.sched.stats()["host_pages_used"] == 4
    assert m.worker.take_stats()["load_blocks"] == 3


def test_lookup_leaves_a_token_to_compute_and_is_side_effect_free(make_vllm):
    m = make_vllm()
    a = seq(12)
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    nodes = {n.id: (n.hit_count, n.last_access) for n in m.sched.tree.nodes()}
    assert m.sched.num_matched_tokens("x", a, 0) == 8  # 12 tokens: the last block recomputes
    assert m.sched.num_matched_tokens("x", a + [99], 0) == 12
    assert m.sched.num_matched_tokens("x", a + [99], 12) == 0  # vLLM has it all
    assert {n.id: (n.hit_count, n.last_access) for n in m.sched.tree.nodes()} == nodes
    m.sched.request_finished("x")
    m.quiesce()
    assert m.sched.num_live_requests == 0


def test_a_requests_tree_key_is_built_once_per_page(make_vllm, monkeypatch):
    """vLLM hands a request's same token sequence every step and appends to it: the
    key of its leading pages is converted once, then only the new pages'. Another
    sequence object under the same request id may hold other tokens: built again."""
    import hicache.integrations.vllm.scheduler.requests as requests_module

    converted = []

    def counting(tokens, page_size):
        converted.append(len(tokens))
        return token_key(tokens, page_size)

    monkeypatch.setattr(requests_module, "token_key", counting)
    m = make_vllm(num_host_pages=8)
    a = seq(2 * P) + [1]
    m.add("a", a)  # the lookup converts the 2 whole pages; the step's save reuses them
    m.step()
    assert converted == [2 * P]
    a += seq(P - 1, 50)  # decoded into the same list: 3 whole pages
    m.pending.append(ScheduledRequest("a", a, None, False, 2 * P + 1, P - 1))
    m.step()
    assert converted == [2 * P, P] and m.sched.stats()["saved_tokens"] == 3 * P
    assert m.sched.num_matched_tokens("a", seq(2 * P, 100) + [1], 0) == 0  # other tokens
    assert converted == [2 * P, P, 2 * P]
    m.finish("a")
    m.step()
    m.quiesce()


def test_host_eviction_is_lru_and_exact(make_vllm):
    m = make_vllm(num_host_pages=4)
    for rid, start in (("a", 1), ("b", 100), ("c", 200)):
        m.add(rid, seq(8, start) + [7])  # two whole blocks each
        m.step()
        m.finish(rid)
        m.step()
        m.check()
    s = m.sched.stats()
    assert s["host_pages_used"] == 4 and s["host_evicted_tokens"] == 2 * P
    assert m.sched.num_matched_tokens("q", seq(8, 1) + [7], 0) == 0  # a: evicted first
    assert m.sched.num_matched_tokens("q", seq(8, 100) + [7], 0) == 8
    assert m.sched.num_matched_tokens("q", seq(8, 200) + [7], 0) == 8
    m.sched.request_finished("q")
    m.quiesce()


def test_save_skipped_when_every_host_page_is_pinned_by_this_step(make_vllm):
    m = make_vllm(num_host_pages=2)
    m.add("a", seq(8) + [1])
    m.step()
    m.finish("a")
    m.step()
    # b loads both host pages (pinned this step) and computes two more blocks: no room
    m.add("b", seq(8) + seq(9, 50))
    plan = m.step()
    assert m.loaded_ok("b")
    assert plan.saves == []
    assert m.sched.stats()["save_skipped_tokens"] == 2 * P
    m.finish("b")
    m.step()
    m.quiesce()


@pytest.mark.parametrize("tree", ["python", "auto"])
def test_save_never_evicts_the_prefix_it_extends(make_vllm, tree):
    """A request served by vLLM's own cache (no hicache load pins its prefix) computes
    blocks past the host tier's copy of that prefix while the host tier is full: making
    room must not evict the prefix the save extends (its host pages would be lost:
    the bench's crash with a small host tier), so the save is skipped instead."""
    m = make_vllm(num_host_pages=2, tree=tree)
    a = seq(8) + [1]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    assert m.sched.stats()["host_pages_used"] == 2
    b = seq(8) + seq(8, 50) + [3]
    assert m.add("b", b, own=8) == 0  # vLLM's own cache serves the two blocks hicache has
    plan = m.step()
    assert plan.saves == []
    s = m.sched.stats()
    assert s["save_skipped_tokens"] == 2 * P and s["host_evicted_tokens"] == 0
    assert s["host_cached_tokens"] == 2 * P  # a's pages stay, with their KV
    m.check()
    assert m.sched.num_matched_tokens("q", a, 0) == 8
    m.sched.request_finished("q")
    m.finish("b")
    m.step()
    m.quiesce()


@pytest.mark.parametrize("tree", ["python", "auto"])
def test_save_diverging_inside_a_pinned_node_splits_it_cleanly(make_vllm, tree):
    """The pinned prefix node is split by the save's insert: the pin follows both halves
    and is released with the step (check_integrity compares locks with pins)."""
    m = make_vllm(num_host_pages=5, tree=tree)
    a = seq(8) + [1]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    b = seq(4) + seq(12, 50) + [3]  # shares a's first block only
    assert m.add("b", b, own=4) == 0
    plan = m.step()
    assert [len(s.host_pages) for s in plan.saves] == [3]
    m.check()
    assert m.sched.stats()["host_pages_used"] == 5
    m.finish("b")
    m.step()
    m.quiesce()
    assert m.add("b2", b) == 16 and m.add("a2", a) == 8
    m.step()
    assert m.loaded_ok("b2") and m.loaded_ok("a2")
    for rid in ("a2", "b2"):
        m.finish(rid)
    m.step()
    m.quiesce()


@pytest.mark.parametrize("tree", ["python", "auto"])
def test_save_evicts_other_pages_but_not_its_prefix(make_vllm, tree):
    """With room to make elsewhere, the save extending a cached prefix evicts another
    request's pages, keeps its prefix, and the whole request loads back intact."""
    m = make_vllm(num_host_pages=4, tree=tree)
    a, c = seq(8) + [1], seq(8, 300) + [2]
    for rid, toks in (("a", a), ("c", c)):
        m.add(rid, toks)
        m.step()
        m.finish(rid)
        m.step()
    # a's prefix is now the least recently used: an unpinned save would evict it first
    b = seq(8) + seq(8, 50) + [3]
    assert m.add("b", b, own=8) == 0
    plan = m.step()
    assert [len(s.host_pages) for s in plan.saves] == [2]
    s = m.sched.stats()
    assert s["host_evicted_tokens"] == 2 * P and s["save_skipped_tokens"] == 0
    m.finish("b")
    m.step()
    m.quiesce()
    assert m.sched.num_matched_tokens("q", c, 0) == 0  # c's pages made the room
    m.sched.request_finished("q")
    assert m.add("b2", b) == 16
    m.step()
    assert m.loaded_ok("b2")
    m.finish("b2")
    m.step()
    m.quiesce()


def test_save_in_flight_when_blocks_are_reused_after_preemption(make_vllm):
    """A preempted request's blocks go to another request at once: the forward that
    overwrites them must wait for the save still reading them."""
    m = make_vllm()
    m.hook.save_delay_s = 0.05  # per layer: the save is still copying at the next step
    a = seq(12, 1) + [5]
    m.add("a", a)
    m.step()
    assert m.worker.num_in_flight == 1
    m.preempt("a")
    b = seq(12, 300) + [5]
    m.add("b", b)  # takes a's blocks
    assert m.reqs["b"]["blocks"][:3] == m.plans[0].saves[0].block_ids
    m.step()
    m.hook.save_delay_s = 0.0
    m.quiesce()
    m.finish("a")  # aborted while preempted
    m.finish("b")
    m.add("c", a)  # a's pages, from host memory: a's KV, not b's
    m.step()
    assert m.reqs["c"]["ext"] == 12 and m.loaded_ok("c")
    m.finish("c")
    m.step()
    m.quiesce()


def test_finished_requests_blocks_reused_at_once_wait_for_its_save(make_vllm):
    """A finished request's blocks are free at once; the next forward that writes one
    of them waits for the save still reading it."""
    m = make_vllm()
    m.hook.save_delay_s = 0.05
    a = seq(8) + [3]
    m.add("a", a)
    m.step()
    blocks = list(m.reqs["a"]["blocks"])
    m.finish("a")
    assert set(blocks) <= set(m.free)
    m.free = blocks + [b for b in m.free if b not in blocks]  # handed out first
    m.add("b", seq(8, 300) + [3])
    assert m.reqs["b"]["blocks"][:2] == blocks[:2]
    saves_before = m.hook.saves_done
    m.step()  # b's forward overwrites a's blocks only after a's save landed
    assert m.hook.saves_done >= saves_before + 1
    m.hook.save_delay_s = 0.0
    m.finish("b")
    m.add("c", a)
    m.step()
    assert m.reqs["c"]["ext"] == 8 and m.loaded_ok("c")
    m.finish("c")
    m.step()
    m.quiesce()


def test_request_without_saves_frees_at_once(make_vllm):
    m = make_vllm()
    m.add("a", [1, 2, 3])  # no whole block
    m.step()
    m.finish("a")
    assert len(m.free) == 16
    m.quiesce()


@pytest.mark.parametrize("executor", ["thread", "auto"])
def test_failed_load_is_reported_and_its_saves_dropped(make_vllm, executor):
    m = make_vllm(executor=executor)
    a = seq(8)
    m.add("a", a + [9])
    m.step()
    m.finish("a")
    m.step()
    m.hook.fail_loads = 1
    b = a + seq(8, 40) + [1]
    assert m.add("b", b) == 8
    plan = m.step()
    loaded = m.reqs["b"]["blocks"][:2]
    assert m.last_errors == set(loaded)
    assert not m.loaded_ok("b")
    # b's new blocks were computed on top of garbage: not saved, their pages marked bad
    assert len(plan.saves) == 1 and m.worker.counters.save_failed_blocks == 2
    m.finish("b")
    m.step()
    m.quiesce()
    # The scheduler was told: a later request is promised only the good pages, and its
    # own computation of the others is saved into the bad pages again
    assert m.add("c", b) == 8
    plan = m.step()
    assert m.loaded_ok("c") and not m.last_errors
    assert [op.block_ids for op in plan.saves] == [m.reqs["c"]["blocks"][2:4]]
    m.finish("c")
    m.step()
    m.quiesce()
    assert m.add("d", b) == 16
    m.step()
    assert m.loaded_ok("d") and not m.last_errors
    m.finish("d")
    m.step()
    m.quiesce()


@pytest.mark.parametrize("executor", ["thread", "auto"])
def test_failed_save_pages_are_never_loaded(make_vllm, executor):
    m = make_vllm(executor=executor)
    m.report_bad = False  # the worker alone: it must not serve the pages
    m.hook.fail_saves = 1
    a = seq(8) + [5]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    m.quiesce()
    assert m.add("b", a) == 8  # the scheduler was not told: it promises them
    m.step()
    assert m.last_errors == set(m.reqs["b"]["blocks"][:2])
    m.finish("b")
    m.step()
    m.quiesce()


def test_bad_pages_are_not_promised_and_are_saved_again(make_vllm):
    m = make_vllm()
    m.hook.fail_saves = 1
    a = seq(12) + [5]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    m.quiesce()
    bad = set(m.plans[0].saves[0].host_pages)
    assert m.sched._bad == bad
    assert m.sched.num_matched_tokens("b", a, 0) == 0  # bad from the first page on
    m.sched.request_finished("b")
    assert m.add("b", a) == 0
    plan = m.step()  # b computes the blocks again: saved into the same host pages
    assert [set(op.host_pages) for op in plan.saves] == [bad]
    m.finish("b")
    m.step()
    m.quiesce()
    assert not m.sched._bad and not m.worker._bad_pages
    assert m.add("c", a) == 12
    m.step()
    assert m.loaded_ok("c") and not m.last_errors
    m.finish("c")
    m.step()
    m.quiesce()


def test_empty_steps_move_nothing(make_vllm):
    m = make_vllm()
    m.add("a", [1, 2])
    plan = m.step()
    assert plan.is_empty()
    for _ in range(3):
        assert m.step().is_empty()
    assert m.worker.take_stats() is None
    m.finish("a")
    m.quiesce()


def test_reset_drops_every_host_page(make_vllm):
    m = make_vllm()
    m.add("a", seq(8) + [1])
    m.step()
    m.finish("a")
    m.step()
    assert m.sched.reset() is True
    m.quiesce()
    assert m.sched.stats()["host_pages_used"] == 0
    assert m.sched.num_matched_tokens("q", seq(8) + [1], 0) == 0
    m.sched.request_finished("q")


@pytest.mark.parametrize("layout", ["fused", "split"])
@pytest.mark.parametrize("executor", ["thread", "auto"])
def test_third_tier_serves_a_fresh_process(make_vllm, tmp_path, layout, executor):
    storage = f"file:{tmp_path}"
    m = make_vllm(storage=storage, layout=layout, executor=executor)
    a = seq(12) + [4]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    m.quiesce()
    assert m.worker.counters.storage_write_bytes == 3 * m.worker.host_pool.page_nbytes
    fresh = make_vllm(storage=storage, layout=layout, executor=executor)  # new host tier
    assert fresh.add("b", a) == 12
    plan = fresh.step()
    assert [len(op.storage_keys) for op in plan.loads] == [3]
    assert fresh.loaded_ok("b") and not fresh.last_errors
    assert fresh.sched.stats()["storage_hit_tokens"] == 12
    fresh.finish("b")
    fresh.step()
    fresh.quiesce()


def test_per_request_loads_never_report_block_errors(make_vllm):
    """Hybrid models load per request: a failed load fails its request when the step
    ends (take_finished_loads), never as block errors, even when vLLM asks for those
    before the step's end (speculative decoding defers wait_for_save): with several
    KV groups vLLM raises on block errors."""
    from hicache.integrations.vllm.common.plan import LoadOp, StepPlan

    w = make_vllm().worker
    w.per_request_loads = True
    plan = StepPlan(loads=[LoadOp("r", [], [], failed_block_ids=[0, 1])])
    w.begin_step(plan)
    w.start_loads(plan)
    assert w.load_errors() == set()  # asked first
    w.end_step(plan)
    assert w.take_finished_loads() == (set(), {"r"})
    assert w.load_errors() == set()


def test_a_step_saving_a_gap_and_new_pages_writes_the_new_ones_to_storage(make_vllm, tmp_path):
    """A fresh host tier, vLLM's own hit of 2 pages and a third-tier hit of 2 more: the
    2 pages of vLLM's hit are copied into the host tier from vLLM's blocks (the tier
    holds them already: no key), and the request's 2 new pages are saved with keys, in
    the same step. Only the new pages are written to storage, and they are."""
    storage = f"file:{tmp_path}"
    first = make_vllm(storage=storage, executor="sync")
    prompt = seq(16)
    first.add("a", prompt + [1])
    first.step()
    first.finish("a")
    first.step()
    first.quiesce()
    m = make_vllm(storage=storage, executor="sync")
    longer = prompt + seq(8, 100) + [1]
    assert m.add("b", longer, own=8) == 8  # pages 2 and 3 from storage
    plan = m.step()
    assert [len(op.storage_keys) for op in plan.saves] == [0, 2]  # the gap, the new pages
    m.quiesce()
    assert m.loaded_ok("b") and not m.last_errors
    page = m.worker.host_pool.page_nbytes
    assert m.worker.counters.storage_errors == 0
    assert m.worker.counters.storage_write_bytes == 2 * page
    m.finish("b")
    m.step()
    m.quiesce()
    fresh = make_vllm(storage=storage, executor="sync")  # every page from storage now
    assert fresh.add("c", longer) == 24
    fresh.step()
    assert fresh.loaded_ok("c") and not fresh.last_errors
    fresh.finish("c")
    fresh.step()
    fresh.quiesce()


@pytest.mark.parametrize("tree", ["python", "auto"])
def test_third_tier_hit_is_promised_only_with_host_room(make_vllm, tmp_path, tree):
    """Storage pages are promised only when host pages can be found to read them into:
    with every host page pinned by this step's other load, the hit is not promised (a
    broken promise is a load error, which vLLM's default policy turns into a failed
    request); once the pins are released it is promised and served."""
    m = make_vllm(num_host_pages=2, storage=f"file:{tmp_path}", tree=tree)
    a, c = seq(8) + [1], seq(8, 300) + [2]
    for rid, toks in (("a", a), ("c", c)):
        m.add(rid, toks)
        m.step()
        m.finish(rid)
        m.step()
        m.quiesce()
    # host: c's two pages; a only in storage
    assert m.add("x", c) == 8  # pins both host pages for this step
    assert m.add("y", a) == 0  # no host page left to read a's pages into
    m.step()
    assert m.loaded_ok("x") and not m.last_errors
    assert m.sched.stats()["load_failed_tokens"] == 0
    for rid in ("x", "y"):
        m.finish(rid)
    m.step()
    m.quiesce()
    assert m.add("z", a) == 8  # now c's pages can make room
    m.step()
    assert m.loaded_ok("z") and not m.last_errors
    m.finish("z")
    m.step()
    m.quiesce()


def test_third_tier_read_failure_is_a_load_error(make_vllm, tmp_path):
    storage = f"file:{tmp_path}"
    m = make_vllm(storage=storage)
    a = seq(12) + [4]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    m.quiesce()
    fresh = make_vllm(storage=storage)
    assert fresh.add("b", a) == 12
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    for f in files:  # every page is corrupted after exists() said yes
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    fresh.step()
    assert fresh.last_errors == set(fresh.reqs["b"]["blocks"][:3])
    assert fresh.worker.counters.storage_errors == 1
    fresh.finish("b")
    fresh.step()
    fresh.quiesce()


class _Gate:
    """Wraps a storage backend: ``get_into`` / ``set`` block while the gate is closed."""

    def __init__(self, backend, *, reads: bool, writes: bool) -> None:
        self.inner, self.reads, self.writes = backend, reads, writes
        self.open = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_into(self, keys, views):
        if self.reads:
            self.open.wait(30)
        return self.inner.get_into(keys, views)

    def set(self, keys, views):
        if self.writes:
            self.open.wait(30)
        return self.inner.set(keys, views)


def _stored(make_vllm, tmp_path, tokens) -> str:
    storage = f"file:{tmp_path}"
    m = make_vllm(storage=storage)
    m.add("a", tokens)
    m.step()
    m.finish("a")
    m.step()
    m.quiesce()
    return storage


def test_hung_storage_read_times_out_as_a_load_error(make_vllm, tmp_path):
    """A third-tier read waits at most storage_timeout_s inside vLLM's step; its blocks
    are recomputed, its host pages stay out of use until the read ends, then the next
    request computing those blocks saves them again and is served."""
    a = seq(12) + [4]
    storage = _stored(make_vllm, tmp_path, a)
    m = make_vllm(storage=storage, storage_timeout_s=0.2)
    gate = _Gate(m.worker.storage.backend, reads=True, writes=False)
    m.worker.storage.backend = gate
    assert m.add("b", a) == 12
    start = time.monotonic()
    m.step()
    assert time.monotonic() - start < 5
    assert m.last_errors == set(m.reqs["b"]["blocks"][:3])
    assert m.worker.counters.storage_timeouts == 1
    quarantined = set(m.plans[-1].loads[0].host_pages)
    assert m.worker._quarantine == quarantined and m.worker.num_in_flight == 1
    m.finish("b")
    m.step()
    gate.open.set()  # the store answers at last: the pages come back into use
    m.quiesce()
    assert not m.worker._quarantine and m.worker.num_in_flight == 0
    assert m.sched.num_matched_tokens("c", a, 0) == 0  # bad pages are not promised
    m.sched.request_finished("c")
    assert _run_one(m, "c", a) == 0  # computed again, saved into the same pages
    assert _run_one(m, "d", a) == 12


def _run_one(m, rid: str, tokens: list[int]) -> int:
    """One request from admission to the end, copies landed; returns the tokens hicache
    loaded for it, every one checked."""
    ext = m.add(rid, tokens)
    m.step()
    assert m.loaded_ok(rid) and not m.last_errors
    m.finish(rid)
    m.step()
    m.quiesce()
    return ext


def test_save_into_the_pages_of_a_hung_read_is_dropped(make_vllm, tmp_path):
    """While a timed-out storage read may still write its host pages, a save into them
    (the blocks computed again) is dropped, also with nothing else in flight; once the
    read ended, the next save repairs them."""
    a = seq(12) + [4]
    storage = _stored(make_vllm, tmp_path, a)
    m = make_vllm(storage=storage, storage_timeout_s=0.2, executor="sync")
    gate = _Gate(m.worker.storage.backend, reads=True, writes=False)
    m.worker.storage.backend = gate
    assert m.add("b", a) == 12
    m.step()  # the read times out: b's blocks are recomputed
    pages = set(m.plans[-1].loads[0].host_pages)
    m.finish("b")
    m.step()
    assert m.worker._quarantine == pages and not m.worker._saves
    assert m.add("c", a) == 0  # bad pages are not promised; c computes them again
    plan = m.step()
    assert {p for op in plan.saves for p in op.host_pages} >= pages  # planned, and
    assert m.worker._bad_pages >= pages  # dropped: the hung read may still write them
    m.finish("c")
    gate.open.set()
    m.step()
    m.quiesce()
    assert not m.worker._quarantine
    assert _run_one(m, "d", a) == 0  # computed, saved once more: no read writes them now
    assert _run_one(m, "e", a) == 12


def test_hung_storage_lookup_promises_nothing_and_does_not_hang_the_scheduler(
        make_vllm, tmp_path):
    """The scheduler's exists() on a hung store: the lookup waits at most
    storage_timeout_s and promises nothing; while that call still hangs no other is
    made; once it ended, lookups promise storage pages again."""
    a = seq(12) + [4]
    storage = _stored(make_vllm, tmp_path, a)
    m = make_vllm(storage=storage, storage_timeout_s=0.2)
    probe = m.sched._probe
    inner, gate, calls = probe.backend, threading.Event(), []

    class Hung:
        def exists(self, keys):
            calls.append(len(keys))
            gate.wait(30)
            return inner.exists(keys)

    probe.backend = Hung()
    start = time.monotonic()
    assert m.sched.num_matched_tokens("x", a, 0) == 0
    assert m.sched.num_matched_tokens("y", a, 0) == 0  # no second call while it hangs
    assert time.monotonic() - start < 2 and calls == [3] and probe.num_timeouts == 1
    gate.set()
    deadline = time.monotonic() + 10
    while not probe._hung.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.sched.num_matched_tokens("z", a, 0) == 12
    for rid in ("x", "y", "z"):
        m.sched.request_finished(rid)
    m.check()


def test_host_hit_load_does_not_wait_for_storage_writes(make_vllm, tmp_path):
    """A load from host pages waits for copies writing them, not for the third-tier
    writes reading them (a hung store must not stall a host hit)."""
    m = make_vllm(storage=f"file:{tmp_path}", storage_timeout_s=0.2)
    gate = _Gate(m.worker.storage.backend, reads=False, writes=True)
    m.worker.storage.backend = gate
    a = seq(12) + [4]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.step()
    for rec in list(m.worker._saves):
        if rec.handle is not None:
            rec.handle.wait()
    m.worker._poll()
    assert any(rec.job is not None for rec in m.worker._saves)  # storage write hangs
    assert m.add("b", a) == 12
    start = time.monotonic()
    m.step()
    assert time.monotonic() - start < 5
    assert m.loaded_ok("b") and not m.last_errors
    gate.open.set()
    m.finish("b")
    m.step()
    m.quiesce()


def test_closing_over_a_hung_store_waits_at_most_its_timeout(tmp_path, caplog):
    """vLLM's shutdown closes the worker half: a third-tier write that hangs is waited
    for at most ``timeout_s``, named, and left behind (the threads still stop)."""
    m = MiniVllm(storage=f"file:{tmp_path}")
    gate = _Gate(m.worker.storage.backend, reads=False, writes=True)
    m.worker.storage.backend = gate
    m.add("a", seq(8) + [1])
    m.step()
    m.finish("a")
    m.step()
    threading.Timer(1.0, gate.open.set).start()  # then the tier's threads can stop
    with caplog.at_level("WARNING", logger="hicache.integrations.vllm.worker"):
        m.worker.close(timeout_s=0.05)
    assert "hicache worker: closing with 1 copies still in flight" in caplog.text
    assert not any(t.is_alive() for t in m.worker.storage._threads)
    m.sched.close()


def test_storage_read_cancels_queued_writes_of_its_pages(make_vllm, tmp_path):
    """Host pages reused for a storage read while their old content still waits to be
    written behind: the queued write is cancelled, the read does not wait for it."""
    a = seq(12) + [4]
    storage = _stored(make_vllm, tmp_path, a)
    m = make_vllm(storage=storage, num_host_pages=4, storage_timeout_s=5.0)
    gate = _Gate(m.worker.storage.backend, reads=False, writes=True)
    m.worker.storage.backend = gate
    x1 = seq(4, 900) + [1]
    m.add("x1", x1)  # 1 page: its storage write starts and hangs in the gate
    m.step()
    m.finish("x1")
    m.step()
    m.add("x2", seq(12, 500) + [4])  # 3 pages: their write queues behind x1's
    m.step()
    m.finish("x2")
    m.step()
    assert m.add("t", x1) == 4  # x1's page is the most recently used now
    m.step()
    m.finish("t")
    m.step()
    for rec in list(m.worker._saves):
        if rec.handle is not None:
            rec.handle.wait()
    m.worker._poll()
    assert sum(rec.job is not None for rec in m.worker._saves) == 2
    start = time.monotonic()
    assert m.add("b", a) == 12  # read from storage into x2's pages
    m.step()
    assert time.monotonic() - start < 4
    assert m.loaded_ok("b") and not m.last_errors
    gate.open.set()
    m.finish("b")
    m.step()
    m.quiesce()
    assert m.worker.counters.storage_write_bytes == m.worker.host_pool.page_nbytes  # x1's


@pytest.mark.parametrize("executor", ["thread", "auto"])
def test_many_requests_with_preemptions_keep_both_halves_consistent(make_vllm, executor):
    rng = np.random.default_rng(0)
    m = make_vllm(num_blocks=24, num_host_pages=6, tree="auto", executor=executor)
    prefixes = [seq(8, 1000 * i) for i in range(4)]
    live: list[str] = []
    for i in range(40):
        if live and rng.random() < 0.3:
            rid = live.pop(int(rng.integers(len(live))))
            if rng.random() < 0.5:
                m.preempt(rid)
                m.finish(rid)
            else:
                m.finish(rid)
        tokens = prefixes[int(rng.integers(4))] + list(rng.integers(1, 999, int(rng.integers(1, 9))))
        need = -(-len(tokens) // P)
        if len(m.free) < need:
            m.step()
            continue
        rid = f"r{i}"
        m.add(rid, [int(t) for t in tokens])
        live.append(rid)
        m.step()
        assert m.loaded_ok(rid)
        m.check()
    for rid in live:
        m.finish(rid)
    m.step()
    m.step()
    m.quiesce()
    assert len(m.free) == 24
    assert m.sched.stats()["host_hit_tokens"] > 0


def test_save_waits_for_the_storage_write_reading_its_host_page(make_vllm, tmp_path):
    """The scheduler may evict a page whose third-tier write is still reading it and give
    it to the next save: the worker lets the write finish before the save overwrites it."""
    storage = f"file:{tmp_path}"
    m = make_vllm(num_host_pages=2, storage=storage)
    backend = m.worker.storage.backend
    slow_set = backend.set

    def set_slowly(keys, values):
        time.sleep(0.2)
        return slow_set(keys, values)

    backend.set = set_slowly
    m.hook.save_delay_s = 0.02  # a's save still copying when b's save is planned
    a = seq(8) + [1]
    m.add("a", a)
    m.step()
    m.finish("a")
    m.add("b", seq(8, 500) + [1])  # evicts a's two host pages and saves into them
    m.step()
    m.finish("b")
    m.step()
    m.quiesce()
    fresh = make_vllm(storage=storage)
    assert fresh.add("c", a) == 8  # a's pages, from storage: a's KV, not b's
    fresh.step()
    assert fresh.loaded_ok("c")
    fresh.finish("c")
    fresh.step()
    fresh.quiesce()


def test_tensor_parallel_storage_hit_needs_every_ranks_shard(tmp_path):
    """With tensor parallelism each rank stores its shard of a page under its own keys: a
    lookup promises a page from storage only when every rank's shard is there."""
    from hicache.integrations.vllm.common.keys import rank_salt, salt_keys
    from hicache.storage import make_storage

    nbytes = L * 2 * H * D * P * 4
    spec = f"file:{tmp_path}"
    sched = SchedulerHalf(ConnectorConfig(tree="python", storage=spec, prefetch_policy="sync"), block_size=P,
                          num_host_pages=8, storage_backend=make_storage(spec, page_nbytes=nbytes),
                          storage_identity=("test-layout", "tiny"), tp_size=2)
    tokens = seq(12) + [1]
    keys = sched._keys(sched._state("probe", tokens, None), 3)
    sched.request_finished("probe")
    writer = make_storage(spec, page_nbytes=nbytes)
    shard = [torch.zeros(L, 2, P, H, D) for _ in keys]
    writer.set(salt_keys(keys, rank_salt(0, 2)), shard)
    assert sched.num_matched_tokens("a", tokens, 0) == 0  # rank 1's shard is missing
    sched.request_finished("a")
    writer.set(salt_keys(keys, rank_salt(1, 2)), shard)
    assert sched.num_matched_tokens("b", tokens, 0) == 12
    sched.request_finished("b")
    sched.check_integrity()


def test_scheduler_rejects_a_load_it_never_promised():
    sched = SchedulerHalf(ConnectorConfig(tree="python"), block_size=P, num_host_pages=4)
    with pytest.raises(ValueError, match="promised none"):
        sched.after_alloc("x", seq(9), [0, 1, 2], 4)


def test_thread_safety_of_concurrent_saves_is_not_needed():
    # The worker is driven by one thread (vLLM's model runner); its copies run on
    # hicache's executor threads. Nothing here may be called from two threads.
    assert threading.current_thread() is threading.main_thread()


def test_load_waits_for_the_save_of_its_host_pages(make_vllm):
    """A page's save (one executor thread) may still be copying when the next step
    loads it (another thread): the load must not read it before the save landed."""
    m = make_vllm()
    m.hook.save_delay_s = 0.05
    a = seq(8)
    m.add("a", a + [1])
    m.step()
    assert m.worker.num_in_flight == 1
    m.finish("a")  # a keeps its blocks until the save landed: b gets other blocks
    assert m.add("b", a + seq(4, 70)) == 8  # same step: the save is still in flight
    m.step()
    assert m.loaded_ok("b") and not m.last_errors
    m.hook.save_delay_s = 0.0
    m.finish("b")
    m.step()
    m.quiesce()


def test_finished_request_saves_blocks_its_last_steps_completed(make_vllm):
    """With async scheduling the last sampled tokens are unknown when the last steps are
    planned: the blocks they complete are saved when the request finishes."""
    m = make_vllm()
    prompt = seq(6)
    m.add("a", prompt)
    m.step()  # 6 tokens: one whole block saved
    full = prompt + [77, 78, 79]  # three tokens decoded; the planner never saw them
    m.reqs["a"]["tokens"] = full
    m.sched._reqs["a"].token_ids = full
    for page in range(2):
        m.fill(full, m.reqs["a"]["blocks"][page], page)
    m.finish("a", num_computed=8)  # KV of 8 tokens computed: 2 blocks
    plan = m.step()
    assert [op.block_ids for op in plan.early_saves] == [[m.plans[0].saves[0].block_ids[0] + 1]]
    m.quiesce()
    assert m.add("b", full + [1]) == 8
    m.step()
    assert m.loaded_ok("b")
    m.finish("b")
    m.step()
    m.quiesce()


def test_blocks_computed_over_wrong_kv_are_followed_through_a_step(make_vllm):
    """Which blocks hold wrong KV after a forward, from vLLM's block tables and what each
    request computed (P = 4 tokens a block)."""
    w = make_vllm().worker
    w._tables = {"a": [1, 2, 3], "b": [1, 5, 6], "c": [7, 8]}
    # Block 1 failed to load. a recomputes it from token 0 (vLLM's recompute, listed
    # after b); b reads it in the same forward and computes tokens 6..11 (its block 5
    # partly filled before); c computes alone from 0.
    w._poison({1})
    w._follow_computes([("b", 6, 12), ("a", 0, 9), ("c", 0, 8)])
    assert w._poisoned == set()  # a rewrote 1 over right KV; b then read right KV
    assert w.take_poisoned_blocks() == set()  # nothing wrong left to report
    # Block 5 was wrong before this step: b's tokens 6..7 read it (attention), so what b
    # writes is wrong too, block 5 included; a, computing over block 1 only, is right.
    w._poison({5})
    w._follow_computes([("b", 6, 12), ("a", 4, 9)])
    assert w._poisoned == {5, 6}
    assert w.take_poisoned_blocks() == {5, 6}


def test_a_request_that_computed_over_wrong_kv_saves_nothing_more(make_vllm):
    """Issue 36: a request that computed over a failed load is tainted from the first
    block it wrote then: vLLM 0.32 under async scheduling recomputes it from inputs that
    may not be its tokens, so what it writes is never taken for right KV (never saved),
    until it finishes or is resumed; earlier blocks, and other requests, are judged by
    what they read (P = 4 tokens a block)."""
    w = make_vllm().worker
    w._tables = {"a": [1, 2, 3, 4], "b": [9]}
    w._poison({2})  # a's load of block 2 failed; a computed tokens 8..9 over it
    w._follow_computes([("a", 8, 10)])
    assert w._poisoned == {2, 3} and w._poisoned.tainted == {"a": 2}  # from block 3 on
    # vLLM rolled a back to token 4: its recompute rewrites block 2 (tokens 4..7, which
    # it had before the failure) over right KV, and blocks 3 and 4, from where it read
    # wrong KV on, are never taken for right KV (nor is what others compute over them).
    w._follow_computes([("a", 4, 14), ("b", 0, 3)])
    assert w._poisoned == {3, 4} and w.take_poisoned_blocks() == {3, 4}
    w.finished({"a"})  # gone: its blocks are handed out again, rewritten by others
    assert w._poisoned.tainted == {}
    w._tables["c"] = [3, 4]
    w._follow_computes([("c", 0, 8)])
    assert w._poisoned == set()
    # resumed from preemption (its table replaced): computed again from its tokens
    w._poison({9})
    w._follow_computes([("b", 3, 4)])
    assert w._poisoned.tainted == {"b": 0}
    from hicache.integrations.vllm.common.plan import StepPlan

    w.begin_step(StepPlan(blocks=[("b", [7], True)]))
    w._follow_computes([("b", 0, 4)])
    assert w._poisoned.tainted == {} and 7 not in w._poisoned


@pytest.mark.parametrize("tree", ["python", "auto"])
def test_vllms_own_hits_keep_the_host_copy_recent(make_vllm, tree):
    """A prefix vLLM keeps hot is hit in vLLM's cache, never in the host tier: the host
    tier's LRU still sees those hits, and evicts a colder prefix first."""
    m = make_vllm(num_host_pages=4, tree=tree)
    a, b = seq(8) + [1], seq(8, 100) + [1]
    for rid, tokens in (("a", a), ("b", b)):  # a, then b: a is the older
        m.add(rid, tokens)
        m.step()
        m.finish(rid)
        m.step()
    assert m.sched.stats()["host_pages_used"] == 4
    assert m.add("x", a[:8] + [5], own=8) == 0  # vLLM's own cache serves a's blocks
    m.step()
    m.finish("x")
    m.add("c", seq(4, 700) + [1])  # one more page: the LRU leaf goes, b's, not a's
    m.step()
    m.finish("c")
    m.step()
    m.quiesce()
    for rid, tokens, hit in (("qa", a, 8), ("qb", b, 4)):
        assert m.sched.num_matched_tokens(rid, tokens, 0) == hit
        m.sched.request_finished(rid)


@pytest.mark.parametrize("tree", ["python", "auto"])
def test_save_that_cannot_fit_evicts_nothing(make_vllm, tree):
    """A save needing more host pages than eviction can free evicts nothing (vLLM's
    prepare_store rule). The save extends A -> A' (vLLM's own cache served both), so
    it pins A', the deepest node of its prefix: A stays unpinned but host eviction
    cannot take it while its child A' keeps a host copy. Only C's 2 pages can go, and
    a 3-page save must be skipped without evicting them."""
    m = make_vllm(num_host_pages=5, tree=tree)
    a, a2, c = seq(8) + [1], seq(8) + seq(4, 50) + [5], seq(8, 300) + [2]
    for rid, toks, own in (("a", a, 0), ("a2", a2, 8), ("c", c, 0)):
        m.add(rid, toks, own=own)
        m.step()
        m.finish(rid)
        m.step()
    m.quiesce()
    assert m.sched.stats()["host_pages_used"] == 5  # A (2), A' (1), C (2)
    b = seq(8) + seq(4, 50) + seq(12, 700) + [4]  # A, A', then 3 new blocks
    assert m.add("b", b, own=12) == 0
    plan = m.step()
    assert plan.saves == []
    s = m.sched.stats()
    assert s["host_evicted_tokens"] == 0 and s["save_skipped_tokens"] == 3 * P
    assert m.sched.num_matched_tokens("q", c, 0) == 8  # C's pages stayed
    m.sched.request_finished("q")
    m.check()
    m.finish("b")
    m.step()
    m.quiesce()
