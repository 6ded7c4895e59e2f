"""CUDA executor tests: skipped without a GPU (run by bench/gpu_suite.sh)."""

from __future__ import annotations

import pytest
import torch

from hicache.config import KVConfig
from hicache.memory import DevicePool, HostPool
from hicache.transfer import TransferEngine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cuda_round_trip_is_bitwise(dtype):
    kv = KVConfig(3, 2, 5, dtype, 3)
    device, host = DevicePool(kv, 8, device="cuda"), HostPool(kv, 8)
    assert host.pinned and host.buffer.is_pinned()
    for buf in device.k_buffers + device.v_buffers:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape,
                                                  dtype=torch.uint8, device="cuda"))
    before = [b.clone() for b in device.k_buffers + device.v_buffers]
    engine = TransferEngine(device, host)
    assert engine.executor_name == "cuda"
    backup = engine.backup(ids(7, 0, 3), ids(2, 3, 6), after=engine.compute_fence())
    assert backup.wait() and backup.error is None
    load = engine.load(ids(2, 3, 6), ids(1, 4, 5))
    for layer in range(3):
        assert load.wait_layer(layer)
    torch.cuda.current_stream().synchronize()
    for b, ref in zip(device.k_buffers + device.v_buffers, before, strict=True):
        assert torch.equal(b[[1, 4, 5]].view(torch.uint8), ref[[7, 0, 3]].view(torch.uint8))
        assert torch.equal(b[[0, 2, 3, 6, 7]], ref[[0, 2, 3, 6, 7]])
    assert load.wait() and set(engine.poll()) == {backup, load}
    engine.close()


def test_backup_waits_for_compute_that_writes_the_pages():
    kv = KVConfig(2, 8, 128, "float16", 16)
    device, host = DevicePool(kv, 64, device="cuda"), HostPool(kv, 64)
    engine = TransferEngine(device, host)
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(side):
        for _ in range(20):  # keep the compute stream busy before the write lands
            a = a @ a / 64
        device.k_buffers[0][5].fill_(3.0)
        fence = engine.compute_fence()
    handle = engine.backup(ids(5), ids(9), after=fence)
    assert handle.wait() and handle.error is None
    assert host.buffer[9, 0, 0].eq(3.0).all()
    engine.close()


def test_load_layer_events_order_the_compute_stream():
    kv = KVConfig(4, 8, 128, "bfloat16", 16)
    device, host = DevicePool(kv, 256, device="cuda"), HostPool(kv, 256)
    host.buffer.fill_(2)
    engine = TransferEngine(device, host)
    page_ids = torch.randperm(256)[:128]
    handle = engine.load(page_ids, page_ids.flip(0))
    sums = []
    for layer in range(4):
        handle.wait_layer(layer)  # no host sync: the current stream waits on the event
        sums.append(device.k_buffers[layer][page_ids.cuda()].float().sum())
    assert [s.item() for s in sums] == [2.0 * 128 * 16 * 8 * 128] * 4
    assert handle.wait() and handle.error is None
    engine.close()


def _random_fill(pool: DevicePool) -> None:
    for buf in pool.k_buffers + pool.v_buffers:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=raw.device))


def test_backup_and_load_at_once_on_two_streams_are_bitwise():
    """A save and a load in flight together (the transfer bench's "both"), on disjoint
    pages: each lands bitwise, neither waits for the other."""
    kv = KVConfig(4, 8, 128, "bfloat16", 16)
    device, host = DevicePool(kv, 64, device="cuda"), HostPool(kv, 64)
    _random_fill(device)
    host.buffer.view(torch.uint8).copy_(
        torch.randint(0, 256, host.buffer.view(torch.uint8).shape, dtype=torch.uint8))
    before_dev = [b.clone() for b in device.k_buffers + device.v_buffers]
    before_host = host.buffer.clone()
    engine = TransferEngine(device, host)
    perm_dev, perm_host = torch.randperm(64), torch.randperm(64)
    save_dev, load_dev = perm_dev[:32], perm_dev[32:]
    save_host, load_host = perm_host[:32], perm_host[32:]
    backup = engine.backup(save_dev, save_host)
    load = engine.load(load_host, load_dev)
    assert backup.wait() and load.wait() and backup.error is None and load.error is None
    torch.cuda.synchronize()
    for layer in range(kv.num_layers):
        for plane, bufs in ((0, device.k_buffers), (1, device.v_buffers)):
            got_host = host.buffer[save_host, layer, plane]
            want_host = before_dev[plane * kv.num_layers + layer][save_dev].cpu()
            assert torch.equal(got_host.view(torch.uint8), want_host.view(torch.uint8))
            got_dev = bufs[layer][load_dev].cpu()
            want_dev = before_host[load_host, layer, plane]
            assert torch.equal(got_dev.view(torch.uint8), want_dev.view(torch.uint8))
    engine.close()


def test_runs_split_where_pinned_chunks_end(monkeypatch):
    """Consecutive host pages across two pinned registrations are copied as two runs,
    and the round trip is bitwise. (Also the first test of a host pool registered in
    several chunks, as pools over 1 GiB are: a registration error here is HostPool's.)"""
    import hicache.memory.pools as pools

    kv = KVConfig(2, 2, 64, "float16", 8)
    monkeypatch.setattr(pools, "_PIN_CHUNK_NBYTES", 3 * kv.page_nbytes)  # 3 pages a chunk
    device, host = DevicePool(kv, 16, device="cuda"), HostPool(kv, 12)
    assert host.pinned and host.pin_chunk_pages == 3
    _random_fill(device)
    before = [b.clone() for b in device.k_buffers + device.v_buffers]
    engine = TransferEngine(device, host)
    host_ids = ids(1, 2, 3, 4, 5, 6, 7)  # crosses the chunk ends at 3 and 6
    backup = engine.backup(ids(0, 1, 2, 3, 4, 5, 6), host_ids)
    assert backup.wait() and backup.error is None
    load = engine.load(host_ids, ids(9, 10, 11, 12, 13, 14, 15))
    assert load.wait() and load.error is None
    torch.cuda.synchronize()
    for b, ref in zip(device.k_buffers + device.v_buffers, before, strict=True):
        assert torch.equal(b[9:16].view(torch.uint8), ref[0:7].view(torch.uint8))
    engine.close()
