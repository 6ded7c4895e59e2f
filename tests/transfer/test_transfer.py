from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from hicache.config import KVConfig
from hicache.memory import DevicePool, HostPool, PageCopier
from hicache.transfer import ManualFence, TransferEngine, TransferKind


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_pools(dtype="float16", page_size=3, heads=2, head_dim=5, layers=3,
               device_pages=8, host_pages=8, seed=0):
    """Pools whose device pages hold distinct random bytes and whose host pages are zero."""
    kv = KVConfig(layers, heads, head_dim, dtype, page_size)
    device = DevicePool(kv, device_pages)
    host = HostPool(kv, host_pages, pin_memory=False)
    host.buffer.view(torch.uint8).fill_(0)
    gen = torch.Generator().manual_seed(seed)
    for buf in device.k_buffers + device.v_buffers:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape,
                                                  generator=gen, dtype=torch.uint8))
    return device, host


def snapshot(pool: DevicePool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).clone() for b in pool.k_buffers + pool.v_buffers]


def device_page_bytes(pool: DevicePool, page: int) -> torch.Tensor:
    return torch.stack([b[page].reshape(-1).view(torch.uint8)
                        for b in pool.k_buffers + pool.v_buffers])


def finish(engine: TransferEngine, handle):
    if engine.executor_name == "manual":
        assert engine.executor.complete(handle)
    assert handle.wait(timeout=10)
    return handle


@pytest.mark.parametrize("executor", ["thread", "sync", "manual"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(dtype="float16"),
        dict(dtype="bfloat16"),
        dict(dtype="float32"),
        dict(dtype="bfloat16", page_size=1, heads=1, head_dim=3),  # 6-byte rows
        dict(dtype="float32", page_size=7, heads=3, head_dim=1, layers=1),
    ],
)
def test_round_trip_device_host_device_is_bitwise(executor, shape):
    device, host = make_pools(**shape)
    before = snapshot(device)
    with TransferEngine(device, host, executor) as engine:
        backup = finish(engine, engine.backup(ids(7, 0, 3, 4), ids(2, 5, 6, 0)))
        load = finish(engine, engine.load(ids(2, 5, 6, 0), ids(1, 2, 5, 6)))
        assert engine.poll() == [backup, load] and engine.poll() == []
        assert engine.num_in_flight == 0
    assert backup.error is None and load.error is None
    assert backup.layers_done == load.layers_done == shape.get("layers", 3)
    assert backup.nbytes == 4 * device.kv.page_nbytes and backup.seconds >= 0
    for src, dst in ((7, 1), (0, 2), (3, 5), (4, 6)):
        assert torch.equal(device_page_bytes(device, dst),
                           torch.stack([b[src].reshape(-1) for b in before]))
    for untouched in (0, 3, 4, 7):
        assert torch.equal(device_page_bytes(device, untouched),
                           torch.stack([b[untouched].reshape(-1) for b in before]))


def test_manual_load_completes_layer_by_layer():
    device, host = make_pools()
    host.buffer.view(torch.uint8).fill_(9)
    engine = TransferEngine(device, host, "manual")
    handle = engine.load(ids(0, 1), ids(4, 6))
    assert handle.kind is TransferKind.LOAD and engine.executor.pending() == [handle]
    assert not handle.done() and handle.layers_done == 0
    assert not handle.wait_layer(0), "nothing arrived yet"
    assert not device.k_buffers[0][4].view(torch.uint8).eq(9).all(), "copied before completion"

    engine.executor.complete_layer(handle)
    assert handle.layers_done == 1 and handle.wait_layer(0) and not handle.wait_layer(1)
    assert device.k_buffers[0][[4, 6]].view(torch.uint8).eq(9).all()
    assert device.v_buffers[0][[4, 6]].view(torch.uint8).eq(9).all()
    assert not device.k_buffers[1][4].view(torch.uint8).eq(9).all(), "layer 1 copied early"
    assert engine.poll() == [] and engine.num_in_flight == 1 and not handle.wait()

    engine.executor.complete_layer(handle)
    engine.executor.complete_layer(handle)
    assert handle.done() and handle.wait_layer(2) and engine.executor.pending() == []
    assert engine.poll() == [handle] and engine.num_in_flight == 0
    with pytest.raises(ValueError, match="pending transfer"):
        engine.executor.complete_layer(handle)
    with pytest.raises(ValueError, match="layer"):
        handle.wait_layer(3)


def test_manual_completion_order_is_poll_order():
    device, host = make_pools()
    engine = TransferEngine(device, host, "manual")
    first = engine.backup(ids(0), ids(0))
    second = engine.load(ids(1), ids(1))
    third = engine.backup(ids(2), ids(2))
    engine.executor.complete(third)
    engine.executor.complete(first)
    assert engine.poll() == [third, first]
    engine.executor.complete(second)
    assert engine.poll() == [second] and engine.poll() == []


def test_manual_reuse_before_completion_is_visible_as_corruption():
    """The copy happens at completion: overwriting the source first corrupts the load."""
    device, host = make_pools()
    host.buffer[3].fill_(1)
    engine = TransferEngine(device, host, "manual")
    handle = engine.load(ids(3), ids(0))
    host.buffer[3].fill_(2)  # a bug: the host page was reused while the load was in flight
    engine.executor.complete(handle)
    assert device.k_buffers[0][0].eq(2).all()


def test_failed_manual_transfer_reports_error_and_stops_copying():
    device, host = make_pools()
    host.buffer.fill_(5)
    host_before = host.buffer.clone()
    engine = TransferEngine(device, host, "manual")
    handle = engine.load(ids(0, 1), ids(2, 3))
    engine.executor.complete_layer(handle)
    after_layer0 = snapshot(device)
    engine.executor.fail(handle, OSError("link down"))
    assert handle.done() and handle.wait() and isinstance(handle.error, OSError)
    assert handle.layers_done == 1 and handle.wait_layer(0) and not handle.wait_layer(1)
    assert engine.poll() == [handle]
    assert all(torch.equal(a, b) for a, b in zip(after_layer0, snapshot(device), strict=True))
    assert torch.equal(host.buffer, host_before), "the source pool must be untouched"


def test_failed_copy_on_thread_executor_leaves_source_untouched(monkeypatch):
    device, host = make_pools()
    before = snapshot(device)

    def broken(self, *args):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(PageCopier, "backup", broken)
    with TransferEngine(device, host, "thread") as engine:
        handle = engine.backup(ids(0, 1), ids(0, 1))
        assert handle.wait(timeout=10)
        assert isinstance(handle.error, RuntimeError) and "injected" in str(handle.error)
        assert engine.poll() == [handle]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device), strict=True))
    assert not host.buffer.view(torch.uint8).any()


def test_sync_executor_copies_in_the_submitting_thread_before_returning():
    device, host = make_pools()
    copiers = []

    class Recording(PageCopier):
        def backup(self, *args):
            copiers.append(threading.current_thread())
            super().backup(*args)

    engine = TransferEngine(device, host, "sync", copier=Recording(device, host))
    handle = engine.backup(ids(4), ids(6))
    assert handle.done() and handle.error is None and handle.layers_done == 3
    assert copiers == [threading.current_thread()]  # one call: every layer at once
    assert torch.equal(host.buffer[6, 1, 0].view(torch.uint8),
                       device.k_buffers[1][4].view(torch.uint8))
    assert engine.num_in_flight == 1  # finished, not yet reported
    assert engine.poll() == [handle] and engine.num_in_flight == 0
    engine.close()


def test_sync_executor_reports_a_failed_copy(monkeypatch):
    device, host = make_pools()

    def broken(self, *args):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(PageCopier, "load", broken)
    engine = TransferEngine(device, host, "sync")
    before = snapshot(device)
    handle = engine.load(ids(0), ids(1))
    assert handle.done() and isinstance(handle.error, RuntimeError)
    assert handle.layers_done == 0 and not handle.wait_layer(0)
    assert engine.poll() == [handle]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device), strict=True))


def test_sync_backup_waits_for_a_fence_another_thread_passes():
    device, host = make_pools()
    engine = TransferEngine(device, host, "sync")
    fence = ManualFence()
    timer = threading.Timer(0.05, fence.set)
    timer.start()
    handle = engine.backup(ids(2), ids(3), after=fence)
    timer.join()
    assert fence.is_set() and handle.done() and handle.error is None
    assert torch.equal(host.buffer[3, 2, 1].view(torch.uint8),
                       device.v_buffers[2][2].view(torch.uint8))


def test_manual_fence_blocks_backup_until_set():
    device, host = make_pools()
    engine = TransferEngine(device, host, "manual")
    fence = ManualFence()
    handle = engine.backup(ids(5), ids(1), after=fence)
    assert not engine.executor.complete(handle) and not engine.executor.complete_layer(handle)
    assert handle.layers_done == 0 and not host.buffer.view(torch.uint8).any()
    fence.set()
    assert engine.executor.complete(handle) and handle.done()
    assert torch.equal(host.buffer[1, 0, 0].view(torch.uint8),
                       device.k_buffers[0][5].view(torch.uint8))
    assert engine.compute_fence().is_set()


def test_thread_backup_waits_for_its_fence():
    device, host = make_pools()
    with TransferEngine(device, host, "thread") as engine:
        fence = ManualFence()
        handle = engine.backup(ids(2), ids(3), after=fence)
        assert not handle.wait(timeout=0.05) and handle.layers_done == 0
        assert not host.buffer.view(torch.uint8).any()
        fence.set()
        assert handle.wait(timeout=10) and handle.error is None
        assert torch.equal(host.buffer[3, 2, 1].view(torch.uint8),
                           device.v_buffers[2][2].view(torch.uint8))


def test_thread_executor_concurrent_backups_and_loads_from_several_threads():
    num_threads, pages_per_thread, rounds = 4, 6, 10
    num_pages = num_threads * pages_per_thread
    device, host = make_pools(layers=4, device_pages=2 * num_pages, host_pages=num_pages)
    before = snapshot(device)
    errors = []
    with TransferEngine(device, host, "thread") as engine:

        def worker(t: int) -> None:
            gen = torch.Generator().manual_seed(t)
            own_host = ids(*range(t * pages_per_thread, (t + 1) * pages_per_thread))
            src = own_host.clone()  # device pages 0 .. num_pages-1 are the originals
            for r in range(rounds):
                perm = own_host[torch.randperm(pages_per_thread, generator=gen)]
                engine.backup(src, perm).wait(timeout=30)
                # Load back into this thread's scratch device pages, in a shuffled order.
                scratch = perm + num_pages
                handle = engine.load(perm, scratch)
                for layer in range(4):
                    assert handle.wait_layer(layer)
                if not handle.wait(timeout=30) or handle.error is not None:
                    errors.append((t, r, handle.error))
                for s, d in zip(src.tolist(), scratch.tolist(), strict=True):
                    want = torch.stack([b[s].reshape(-1) for b in before])
                    if not torch.equal(device_page_bytes(device, d), want):
                        errors.append((t, r, s, d))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done = engine.poll()
    assert errors == []
    assert len(done) == 2 * num_threads * rounds and len({id(h) for h in done}) == len(done)
    assert all(h.error is None for h in done)


@pytest.mark.parametrize(
    "host_pages, device_pages, error, message",
    [
        (ids(0, 1), ids(0), ValueError, "equal lengths, got 2 host and 1 device"),
        (ids(8), ids(0), ValueError, r"host_pages: expected ids in \[0, 8\), got min 8"),
        (ids(0), ids(-1), ValueError, "device_pages: expected ids in"),
        (torch.tensor([0], dtype=torch.int32), ids(0), TypeError, "int64, got torch.int32"),
        ([0], ids(0), TypeError, "got list"),
        (ids(0).view(1, 1), ids(0), ValueError, "1-D"),
    ],
)
def test_bad_page_ids(host_pages, device_pages, error, message):
    device, host = make_pools()
    engine = TransferEngine(device, host, "manual")
    with pytest.raises(error, match=message):
        engine.load(host_pages, device_pages)
    with pytest.raises(error, match=message):
        engine.backup(device_pages, host_pages)
    assert engine.num_in_flight == 0 and engine.executor.pending() == []


@pytest.mark.parametrize(
    "host_pages, device_pages, error, message",
    [
        (torch.tensor([0], dtype=torch.int32), ids(0), TypeError, "int64, got torch.int32"),
        ([0], ids(0), TypeError, "host_pages: expected an int64 torch.Tensor, got list"),
        (ids(0).view(1, 1), ids(0), ValueError, "host_pages: expected a 1-D tensor"),
        (ids(0), ids(0, 1).view(1, 2), ValueError, "device_pages: expected a 1-D tensor"),
    ],
)
def test_bookkeeping_transfers_refuse_malformed_page_ids_like_real_ones(
    host_pages, device_pages, error, message
):
    """Without pools there is no range to check, but the form of the ids is checked
    with the same error types and messages (the immediate engine once accepted int32
    ids and called a 2-D tensor a TypeError)."""
    engine = TransferEngine(None, None, "immediate")
    with pytest.raises(error, match=message):
        engine.load(host_pages, device_pages)
    with pytest.raises(error, match=message):
        engine.backup(device_pages, host_pages)
    assert engine.num_in_flight == 0 and engine.poll() == []


def test_a_transfer_checks_the_layer_it_is_asked_to_wait_for():
    device, host = make_pools(layers=3)
    engine = TransferEngine(device, host, "manual")
    transfer = engine.load(ids(0), ids(0))
    assert repr(transfer) == "Transfer(load, 1 pages, 0/3 layers, in flight)"
    for bad, error, message in [
        (True, TypeError, "layer: expected int, got bool"),
        (0.0, TypeError, "layer: expected int, got float"),
        (-1, ValueError, "layer: expected >= 0, got -1"),
        (3, ValueError, "layer: expected 0 <= layer < 3, got 3"),
    ]:
        with pytest.raises(error, match=message):
            transfer.wait_layer(bad)
    assert engine.executor.complete(transfer) and transfer.wait_layer(np.int64(2))


def test_bad_engine_arguments():
    device, host = make_pools()
    with pytest.raises(ValueError, match="executor: expected 'auto'"):
        TransferEngine(device, host, "dma")
    with pytest.raises(ValueError, match="expected both pools"):
        TransferEngine(device, None, "thread")
    other_host = HostPool(KVConfig(1, 2, 5, "float16", 3), 2, pin_memory=False)
    with pytest.raises(ValueError, match="same KVConfig"):
        TransferEngine(device, other_host, "manual")
    with pytest.raises(TypeError, match="fence"):
        TransferEngine(device, host, "manual").backup(ids(0), ids(0), after=object())
    with pytest.raises(ValueError, match="expected a CUDA device"):
        TransferEngine(device, host, "cuda")


def test_auto_executor_on_cpu_is_thread():
    device, host = make_pools()
    with TransferEngine(device, host) as engine:
        assert engine.executor_name == "thread"


def test_immediate_executor_is_bookkeeping_only():
    engine = TransferEngine(None, None, "immediate")
    a = engine.load(ids(1, 2), ids(3, 4))
    b = engine.backup(ids(0), ids(9))
    assert a.done() and a.wait() and a.wait_layer(0) and a.error is None
    assert engine.num_in_flight == 2 and engine.poll() == [a, b] and engine.num_in_flight == 0
    with pytest.raises(ValueError, match="equal lengths"):
        engine.load(ids(1), ids())
    start = time.perf_counter()
    host_pages, device_pages = ids(1, 2, 3), ids(4, 5, 6)
    for _ in range(2000):
        engine.load(host_pages, device_pages)
    assert len(engine.poll()) == 2000
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 1e-3, f"immediate transfers must be cheap, took {per_call * 1e6:.0f} us"


def test_empty_transfer_completes():
    device, host = make_pools()
    with TransferEngine(device, host, "thread") as engine:
        handle = engine.backup(ids(), ids())
        assert handle.wait(timeout=10) and handle.error is None and handle.nbytes == 0


class _GatedCopier:
    """Wraps a copier: loads into ``gate_page`` wait for ``gate``; records who copied what."""

    def __init__(self, inner: PageCopier, gate_page: int) -> None:
        self.inner = inner
        self.gate_page = gate_page
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[str, int, int]] = []  # (thread name, first device page, layer)

    def load(self, host_ids, device_ids, first, last):
        if int(device_ids[0]) == self.gate_page:
            self.entered.set()
            assert self.gate.wait(timeout=10), "test gate never opened"
        self.calls.append((threading.current_thread().name, int(device_ids[0]), first))
        self.inner.load(host_ids, device_ids, first, last)

    def backup(self, device_ids, host_ids, first, last):
        self.inner.backup(device_ids, host_ids, first, last)


def _gated_engine(layers=3):
    device, host = make_pools(layers=layers)
    engine = TransferEngine(device, host, "thread")
    copier = _GatedCopier(engine.executor._copier, gate_page=7)
    engine.executor._copier = copier
    backup = engine.backup(ids(0, 1, 2), ids(0, 1, 2))
    assert backup.wait(timeout=10) and backup.error is None
    assert engine.poll() == [backup]
    return device, engine, copier


def test_waiting_caller_copies_a_load_the_busy_worker_has_not_started():
    device, engine, copier = _gated_engine()
    with engine:
        stuck = engine.load(ids(0), ids(7))  # the load worker blocks inside this one
        assert copier.entered.wait(timeout=10)
        handle = engine.load(ids(1, 2), ids(4, 5))
        assert handle.wait() and handle.error is None  # no timeout: the caller copies
        assert not stuck.done()
        me = threading.current_thread().name
        assert [c for c in copier.calls if c[1] == 4] == [(me, 4, 0), (me, 4, 1), (me, 4, 2)]
        assert torch.equal(device_page_bytes(device, 4), device_page_bytes(device, 1))
        assert torch.equal(device_page_bytes(device, 5), device_page_bytes(device, 2))
        assert engine.poll() == [handle]
        copier.gate.set()
        assert stuck.wait(timeout=10) and stuck.error is None
        assert engine.poll() == [stuck]


def test_wait_layer_copies_only_the_layers_it_needs_and_the_worker_finishes():
    device, engine, copier = _gated_engine()
    with engine:
        stuck = engine.load(ids(0), ids(7))
        assert copier.entered.wait(timeout=10)
        handle = engine.load(ids(1), ids(4))
        assert handle.wait_layer(0) and handle.layers_done == 1 and not handle.done()
        assert not handle.wait(timeout=0.05), "a wait with a timeout must not copy"
        assert handle.layers_done == 1
        copier.gate.set()
        assert handle.wait(timeout=10) and handle.error is None and stuck.wait(timeout=10)
        workers = {c[0] for c in copier.calls if c[1] == 4 and c[2] > 0}
        assert workers == {"hicache-load"}
        assert torch.equal(device_page_bytes(device, 4), device_page_bytes(device, 1))


def test_waiting_caller_does_not_copy_a_backup_before_its_fence():
    device, host = make_pools()
    with TransferEngine(device, host, "thread") as engine:
        fence = ManualFence()
        handle = engine.backup(ids(2), ids(3), after=fence)
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        time.sleep(0.05)
        assert handle.layers_done == 0 and not host.buffer.view(torch.uint8).any()
        fence.set()
        waiter.join(timeout=10)
        assert not waiter.is_alive() and handle.done() and handle.error is None
        assert torch.equal(host.buffer[3, 1, 0].view(torch.uint8),
                           device.k_buffers[1][2].view(torch.uint8))


def test_failed_layer_copied_by_a_waiting_caller_is_reported():
    device, host = make_pools()
    with TransferEngine(device, host, "thread") as engine:
        copier = engine.executor._copier
        real_load = copier.load

        def fail_layer_1(host_ids, device_ids, first, last):
            if first == 1:
                raise OSError("injected layer-1 failure")
            real_load(host_ids, device_ids, first, last)

        copier.load = fail_layer_1
        handle = engine.load(ids(0), ids(4))
        assert handle.wait() and isinstance(handle.error, OSError)
        assert handle.layers_done == 1 and handle.wait_layer(0) and not handle.wait_layer(1)
        assert engine.poll() == [handle]


def _apply_copies(dst: np.ndarray, src: np.ndarray, copies) -> None:
    """What cudaMemcpy2DAsync does, on flat byte arrays."""
    for c in copies:
        for row in range(c.height):
            d = c.dst_offset + row * c.dst_pitch
            s = c.src_offset + row * c.src_pitch
            dst[d : d + c.width] = src[s : s + c.width]


def test_cuda_load_plan_lands_each_layer_with_its_own_copies():
    """The CUDA load's copy plan (logic only, on CPU): layer l's copies read only layer l
    of the host pages and write only layer l's staging region, and together they bring
    exactly that layer of every page: so the event recorded after them is truthful."""
    from hicache.transfer import host_runs, layer_load_plan

    num_pages, num_layers, layer_nbytes = 12, 3, 8
    page_nbytes = num_layers * layer_nbytes
    rng = np.random.default_rng(0)
    host = rng.integers(0, 255, (num_pages, num_layers, layer_nbytes), dtype=np.uint8)
    host_ids = torch.tensor([3, 4, 5, 6, 9, 0, 1, 11], dtype=torch.int64)
    runs = host_runs(host_ids, chunk_pages=5)  # 3,4 | 5,6 (chunk edge) | 9 | 0,1 | 11
    assert runs == [(3, 2, 0), (5, 2, 2), (9, 1, 4), (0, 2, 5), (11, 1, 7)]
    plan = layer_load_plan(runs, num_layers, layer_nbytes, page_nbytes)
    n = host_ids.numel()
    stage = np.zeros(num_layers * n * layer_nbytes, dtype=np.uint8)
    for layer, copies in enumerate(plan):
        before = stage.copy()
        _apply_copies(stage, host.reshape(-1), copies)
        region = slice(layer * n * layer_nbytes, (layer + 1) * n * layer_nbytes)
        changed = np.flatnonzero(before != stage)
        assert changed.size == 0 or (changed.min() >= region.start and changed.max() < region.stop)
        for c in copies:  # reads stay inside layer `layer` of each page
            for row in range(c.height):
                off = (c.src_offset + row * c.src_pitch) % page_nbytes
                assert layer * layer_nbytes <= off and off + c.width <= (layer + 1) * layer_nbytes
        got = stage[region].reshape(n, layer_nbytes)
        assert np.array_equal(got, host[host_ids.numpy(), layer])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
def test_thread_executor_pins_its_threads_to_the_cpus_given():
    device, host = make_pools()
    own = os.sched_getaffinity(0)
    cpu = max(own)
    with TransferEngine(device, host, "thread", copy_cpus=[cpu]) as engine:
        threads = engine.executor._threads
        assert [os.sched_getaffinity(t.native_id) for t in threads] == [{cpu}, {cpu}]
        assert engine.executor.cpus == {cpu}
        handle = finish(engine, engine.backup(ids(1), ids(2)))
        assert handle.error is None
        assert torch.equal(host.buffer[2, 0, 0].view(torch.uint8),
                           device.k_buffers[0][1].view(torch.uint8))
    assert os.sched_getaffinity(0) == own  # the caller stays where it was


def test_thread_executor_rejects_cpus_it_cannot_run_on():
    device, host = make_pools()
    before = threading.active_count()
    with pytest.raises(ValueError, match="cpus: expected CPUs this process may run on, got \\[4095\\]"):
        TransferEngine(device, host, "thread", copy_cpus=[4095])
    assert threading.active_count() == before  # its threads stopped
    with pytest.raises(ValueError, match="cpus: expected one or more CPU ids >= 0, got \\[-1\\]"):
        TransferEngine(device, host, "thread", copy_cpus=[-1])
    with pytest.raises(ValueError, match="cpus: expected one or more CPU ids >= 0, got \\[\\]"):
        TransferEngine(device, host, "thread", copy_cpus=[])
    with pytest.raises(TypeError, match="cpus: expected a collection of CPU ids, got str"):
        TransferEngine(device, host, "thread", copy_cpus="0")
    with pytest.raises(TypeError, match="cpus: expected int CPU ids, got \\[1.5\\]"):
        TransferEngine(device, host, "thread", copy_cpus=[1.5])
    with pytest.raises(ValueError, match="copy_cpus: pins the thread executor's threads, got "
                                         "executor 'sync'"):
        TransferEngine(device, host, "sync", copy_cpus=[0])
