"""The connector's halves on the device vLLM's KV lives on: CPU tensors here, CUDA on a GPU.

The same scenarios run on both devices through the same code: vLLM's split K/V layout
``(2, num_blocks, block_size, H, D)`` (what vLLM's CUDA attention backends register),
driven by the stand-in for vLLM of ``test_vllm_connector.py`` (``MiniVllm``). On CUDA
the worker picks the CUDA executor itself (``executor="auto"``): a load stream and a
backup stream, a pinned host pool, loads that land layer by layer with one event per
layer, saves ordered after the forward by a compute fence. On the CPU the same
scenarios run on the thread executor. Every block a load filled is checked by content
(``loaded_ok``: each page's value is derived from its tokens and layer).

Copies are held in flight on purpose to make the races real: on the CPU by delaying
the copier (``Hook``), on CUDA by queueing a spin on the executor's stream
(``stall_stream``) before the copy; each test asserts the copy was still in flight
where it matters, so a hold that ended early fails the test instead of passing it.
Failures are injected where each executor reports them: the CPU copier, or the CUDA
executor's submission (reported through the transfer like any CUDA error).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from cuda_streams import DEVICES, stall_stream
from minivllm import MiniVllm, P, block_of, page_value, seq

HOLD_S = 0.3  # how long a held CUDA copy stays queued; the host steps take milliseconds


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


class Faults:
    """Holds and fails the worker's copies on either device."""

    def __init__(self, m: MiniVllm, device: str) -> None:
        self.m = m
        self.device = device
        self.save_hold_s = 0.0
        self.load_hold_s = 0.0
        self.fail_loads = 0
        self.fail_saves = 0
        if device == "cuda":
            ex = m.worker.transfers.executor
            submit_load, submit_backup = ex._submit_load, ex._submit_backup

            def load(transfer, state, compute):
                if self.fail_loads:
                    self.fail_loads -= 1
                    raise RuntimeError("injected load failure")
                if self.load_hold_s:
                    stall_stream(ex._load_stream, self.load_hold_s)
                submit_load(transfer, state, compute)

            def backup(transfer, state, compute):
                if self.fail_saves:
                    self.fail_saves -= 1
                    raise RuntimeError("injected save failure")
                if self.save_hold_s:
                    stall_stream(ex._backup_stream, self.save_hold_s)
                submit_backup(transfer, state, compute)

            ex._submit_load, ex._submit_backup = load, backup

    def hold_saves(self, seconds: float) -> None:
        """Keep the next saves in flight: ``seconds`` per layer on CPU, six times that
        per save on CUDA (0.05 s: ``HOLD_S``)."""
        if self.device == "cuda":
            self.save_hold_s = seconds * HOLD_S / 0.05
        else:
            self.m.hook.save_delay_s = seconds

    def hold_loads(self) -> None:
        if self.device == "cuda":
            self.load_hold_s = HOLD_S

    def fail_next_load(self) -> None:
        if self.device == "cuda":
            self.fail_loads = 1
        else:
            self.m.hook.fail_loads = 1

    def fail_next_save(self) -> None:
        if self.device == "cuda":
            self.fail_saves = 1
        else:
            self.m.hook.fail_saves = 1


@pytest.fixture
def make_vllm(device):
    made = []

    def factory(**kwargs) -> tuple[MiniVllm, Faults]:
        kwargs.setdefault("layout", "split")
        kwargs.setdefault("executor", "auto" if device == "cuda" else "thread")
        m = MiniVllm(device=device, **kwargs)
        made.append(m)
        return m, Faults(m, device)

    yield factory
    for m in made:
        m.close()


def layer_ok(m: MiniVllm, rid: str, layer: int) -> bool:
    """Every block the connector loaded for ``rid`` holds its page's KV in ``layer``
    (read on the current stream: on CUDA, ordered only by wait_layer's event)."""
    r = m.reqs[rid]
    kv = list(m.kv.values())[layer]
    for page in range(r["own"] // P, (r["own"] + r["ext"]) // P):
        for plane in block_of(kv, r["blocks"][page], m.num_blocks):
            if not bool(torch.all(plane == page_value(r["tokens"], page, layer))):
                return False
    return True


def save_and_drop(m: MiniVllm, rid: str, tokens: list[int]) -> None:
    """A request computed, saved to host pages, finished; vLLM freed its blocks."""
    m.add(rid, tokens)
    m.step()
    m.finish(rid)
    m.step()
    m.quiesce()


def test_worker_uses_the_device_executor_and_a_pinned_pool_on_cuda(make_vllm, device):
    m, _ = make_vllm()
    w = m.worker
    assert w.layout.planes_per_layer == 2 and w.layout.device.type == device
    if device == "cuda":
        assert w.transfers.executor_name == "cuda"
        assert w.host_pool.pinned and w.host_pool.buffer.is_pinned()
    else:
        assert w.transfers.executor_name == "thread"
    m.check()


def test_layer_by_layer_load_is_usable_after_each_layers_wait(make_vllm, device):
    """wait_for_layer_load(layer) makes that layer's loaded blocks readable: on CUDA the
    compute stream waits on the layer's event while the host goes on (the load is held
    in flight, so a missing wait would read empty blocks)."""
    m, faults = make_vllm()
    a = seq(12) + [5]
    save_and_drop(m, "a", a)
    faults.hold_loads()
    seen, waits_s = [], []
    wait_layer = m.worker.wait_layer

    def checked(name: str) -> None:
        if not m.worker.loading:
            return wait_layer(name)
        start = time.perf_counter()
        wait_layer(name)
        waits_s.append(time.perf_counter() - start)
        seen.append(layer_ok(m, "b", m.worker._layer_index[name]))

    m.worker.wait_layer = checked
    assert m.add("b", a) == 12
    plan = m.step()
    assert [len(op.block_ids) for op in plan.loads] == [3]
    assert seen == [True] * len(m.kv)
    if device == "cuda":  # the host never waited for the held copy
        assert max(waits_s) < HOLD_S / 2, waits_s
    assert m.loaded_ok("b") and not m.last_errors
    assert m.worker.counters.load_blocks == 3
    m.finish("b")
    m.step()
    m.quiesce()


def test_save_lands_before_a_preempted_requests_blocks_are_reused(make_vllm, device):
    """vLLM hands a preempted request's blocks to another request at once: the forward
    that overwrites them must wait for the save still reading them."""
    m, faults = make_vllm()
    faults.hold_saves(0.05)
    a = seq(12) + [5]
    m.add("a", a)
    m.step()
    assert m.worker.num_in_flight == 1, "the save was not held in flight"
    m.preempt("a")
    b = seq(12, 300) + [5]
    m.add("b", b)  # takes a's blocks
    assert m.reqs["b"]["blocks"][:3] == m.plans[0].saves[0].block_ids
    m.step()
    faults.hold_saves(0)
    m.quiesce()
    m.finish("a")  # aborted while preempted
    m.finish("b")
    m.add("c", a)  # a's pages, from host memory: a's KV, not b's
    m.step()
    assert m.reqs["c"]["ext"] == 12 and m.loaded_ok("c") and not m.last_errors
    m.finish("c")
    m.step()
    m.quiesce()


def test_finished_requests_blocks_reused_at_once_wait_for_its_save(make_vllm, device):
    """A finished request's blocks are free at once; the forward that overwrites one of
    them (another request's) waits for the save still reading it."""
    m, faults = make_vllm()
    faults.hold_saves(0.05)
    a = seq(8) + [3]
    m.add("a", a)
    m.step()
    assert m.worker.num_in_flight == 1
    blocks = list(m.reqs["a"]["blocks"])
    m.finish("a")
    assert set(blocks) <= set(m.free)
    m.free = blocks + [b for b in m.free if b not in blocks]  # handed out first
    m.add("x", seq(8, 300) + [3])
    m.step()  # x's forward overwrites a's blocks only after a's save landed
    faults.hold_saves(0)
    m.finish("x")
    m.quiesce()
    assert m.add("b", a) == 8
    m.step()
    assert m.loaded_ok("b")
    m.finish("b")
    m.step()
    m.quiesce()


def test_load_waits_for_the_save_still_writing_its_host_pages(make_vllm, device):
    """On CUDA the save (backup stream) and the load (load stream) are on two streams:
    the worker must order them itself."""
    m, faults = make_vllm()
    faults.hold_saves(0.05)
    a = seq(8)
    m.add("a", a + [1])
    m.step()
    assert m.worker.num_in_flight == 1
    m.finish("a")
    assert m.add("b", a + seq(4, 70)) == 8  # same step: the save is still in flight
    m.step()
    assert m.loaded_ok("b") and not m.last_errors
    faults.hold_saves(0)
    m.finish("b")
    m.step()
    m.quiesce()


def test_failed_load_is_reported_and_its_requests_saves_dropped(make_vllm, device):
    m, faults = make_vllm()
    a = seq(8)
    save_and_drop(m, "a", a + [9])
    faults.fail_next_load()
    b = a + seq(8, 40) + [1]
    assert m.add("b", b) == 8
    plan = m.step()
    assert m.last_errors == set(m.reqs["b"]["blocks"][:2])
    assert not m.loaded_ok("b")
    assert m.worker.counters.load_failed_blocks == 2
    # b's new blocks were computed on top of the failed load: not saved, pages bad
    assert len(plan.saves) == 1 and m.worker.counters.save_failed_blocks == 2
    m.finish("b")
    m.step()
    m.quiesce()
    assert m.add("c", b) == 8  # the good pages only; the rest computed and saved again
    m.step()
    assert m.loaded_ok("c") and not m.last_errors
    m.finish("c")
    m.step()
    m.quiesce()
    assert m.add("d", b) == 16
    m.step()
    assert m.loaded_ok("d") and not m.last_errors
    m.finish("d")
    m.step()
    m.quiesce()


def test_failed_save_pages_are_never_loaded(make_vllm, device):
    m, faults = make_vllm()
    m.report_bad = False  # the worker alone must refuse them
    faults.fail_next_save()
    a = seq(8) + [5]
    save_and_drop(m, "a", a)
    assert m.add("b", a) == 8  # the scheduler was not told: it promises them
    m.step()
    assert m.last_errors == set(m.reqs["b"]["blocks"][:2])
    m.finish("b")
    m.step()
    m.quiesce()


def test_third_tier_serves_a_fresh_worker(make_vllm, device, tmp_path):
    storage = f"file:{tmp_path}"
    m, _ = make_vllm(storage=storage)
    a = seq(12) + [4]
    save_and_drop(m, "a", a)
    assert m.worker.counters.storage_write_bytes == 3 * m.worker.host_pool.page_nbytes
    fresh, _ = make_vllm(storage=storage)
    assert fresh.add("b", a) == 12
    plan = fresh.step()
    assert [len(op.storage_keys) for op in plan.loads] == [3]
    assert fresh.loaded_ok("b") and not fresh.last_errors
    fresh.finish("b")
    fresh.step()
    fresh.quiesce()


def test_many_requests_with_preemptions_and_saves_in_flight(make_vllm, device):
    """Random arrivals, finishes and preemptions while saves are held in flight: every
    load is checked by content, both halves stay consistent, nothing leaks."""
    rng = np.random.default_rng(0)
    m, faults = make_vllm(num_blocks=24, num_host_pages=6, tree="auto")
    prefixes = [seq(8, 1000 * i) for i in range(4)]
    live: list[str] = []
    for i in range(30):
        faults.hold_saves(0.01 if rng.random() < 0.5 else 0)
        if live and rng.random() < 0.3:
            rid = live.pop(int(rng.integers(len(live))))
            if rng.random() < 0.5:
                m.preempt(rid)
            m.finish(rid)
        tokens = prefixes[int(rng.integers(4))] + [int(t) for t in rng.integers(1, 999, 5)]
        if len(m.free) < -(-len(tokens) // P):
            m.step()
            continue
        rid = f"r{i}"
        m.add(rid, tokens)
        live.append(rid)
        m.step()
        assert m.loaded_ok(rid) and not m.last_errors
        m.check()
    faults.hold_saves(0)
    for rid in live:
        m.finish(rid)
    m.step()
    m.step()
    m.quiesce()
    assert len(m.free) == 24
    assert m.sched.stats()["host_hit_tokens"] > 0


def test_a_layout_the_device_executor_cannot_copy_is_refused_by_name(make_vllm, device):
    """vLLM's CPU layout (K and V fused in one plane per block) is copied by the CPU
    copier; the CUDA executor copies the split K/V layout only, and says so."""
    if device == "cuda":
        with pytest.raises(ValueError, match="the CUDA executor copies the split K/V layout"):
            make_vllm(layout="fused")
        return
    m, _ = make_vllm(layout="fused")
    save_and_drop(m, "a", seq(8) + [1])
    assert m.add("b", seq(8) + [1]) == 8
    m.step()
    assert m.loaded_ok("b")
    m.finish("b")
    m.step()
    m.quiesce()
