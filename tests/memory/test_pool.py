from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from hicache.checks import check_page_ids
from hicache.config import KVConfig
from hicache.memory import DevicePool, HostPool, PageCopier, load_native_copier

NATIVE_MODES = [
    pytest.param(True, marks=pytest.mark.skipif(load_native_copier() is None, reason="no C compiler")),
    False,
]


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def kv_config(dtype="float16", page_size=3, heads=2, head_dim=5, layers=2) -> KVConfig:
    return KVConfig(layers, heads, head_dim, dtype, page_size)


def random_rows(kv: KVConfig, num_pages: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages * kv.page_size, kv.num_kv_heads, kv.head_dim)
    return torch.randn(shape, generator=gen).to(kv.torch_dtype)


def test_device_pool_shapes_and_bytes():
    kv = kv_config()
    pool = DevicePool(kv, 4)
    assert len(pool.k_buffers) == len(pool.v_buffers) == 2
    k, v = pool.layer(1)
    assert k.shape == v.shape == (4, 3, 2, 5) and k.dtype == torch.float16
    assert pool.nbytes == 4 * kv.page_nbytes
    assert pool.device == torch.device("cpu")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_device_pool_write_read_round_trip(dtype):
    kv = kv_config(dtype)
    pool = DevicePool(kv, 6)
    k, v = random_rows(kv, 2, 1), random_rows(kv, 2, 2)
    pool.write_pages(1, ids(4, 0), k, v)
    k2, v2 = pool.read_pages(1, ids(4, 0))
    assert torch.equal(k.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), v2.view(torch.uint8))
    # Page 4 holds the first page_size rows; other layers and pages are untouched.
    assert torch.equal(pool.k_buffers[1][4].view(torch.uint8), k[:3].view(torch.uint8))
    assert not pool.k_buffers[0].view(torch.uint8).any()
    assert not pool.k_buffers[1][[1, 2, 3, 5]].view(torch.uint8).any()


def test_device_pool_rejects_bad_inputs():
    kv = kv_config()
    pool = DevicePool(kv, 4)
    k = random_rows(kv, 1, 0)
    with pytest.raises(ValueError, match="expected shape"):
        pool.write_pages(0, ids(1, 2), k, k)
    with pytest.raises(TypeError, match="dtype"):
        pool.write_pages(0, ids(1), k.float(), k.float())
    with pytest.raises(ValueError, match=r"\[0, 4\), got min 4"):
        pool.write_pages(0, ids(4), k, k)
    with pytest.raises(ValueError, match="layer"):
        pool.read_pages(2, ids(0))
    with pytest.raises(ValueError, match="expected >= 1, got 0"):
        DevicePool(kv, 0)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ([1, 2], TypeError, "expected an int64 torch.Tensor, got list"),
        (torch.tensor([1], dtype=torch.int32), TypeError, "int64, got torch.int32"),
        (torch.zeros(1, 1, dtype=torch.int64), ValueError, "1-D tensor, got shape"),
        (ids(-1), ValueError, "got min -1"),
    ],
)
def test_check_page_ids(bad, error, message):
    with pytest.raises(error, match=message):
        check_page_ids("page_ids", bad, 4)


def test_host_pool_layout_page_first():
    kv = kv_config(layers=3)
    pool = HostPool(kv, 5, pin_memory=False)
    assert pool.buffer.shape == (5, 3, 2, 3, 2, 5)
    assert pool.nbytes == 5 * kv.page_nbytes and not pool.pinned
    assert pool.page(2).is_contiguous() and pool.page(2).data_ptr() == pool.buffer[2].data_ptr()
    pool.buffer.fill_(0)
    pool.buffer[3].fill_(7)
    assert torch.equal(pool.pages(ids(3, 1)), pool.buffer[[3, 1]])


def test_host_pool_prefault_maps_every_page_at_construction():
    """A fresh allocation this large is mapped page by page on first write (glibc serves
    it with mmap); prefault=True writes it all at construction instead."""
    psutil = pytest.importorskip("psutil")
    kv = KVConfig(num_layers=1, num_kv_heads=1, head_dim=1024, dtype="float32", page_size=1024)
    num_pages = 12  # 12 x 8 MiB (K and V) = 96 MiB, above glibc's largest mmap threshold
    proc = psutil.Process()
    before = proc.memory_info().rss
    lazy = HostPool(kv, num_pages, pin_memory=False)
    grown_lazy = proc.memory_info().rss - before
    before = proc.memory_info().rss
    eager = HostPool(kv, num_pages, pin_memory=False, prefault=True)
    grown_eager = proc.memory_info().rss - before
    assert grown_lazy < 16 << 20, grown_lazy
    assert grown_eager >= eager.nbytes - (1 << 20), grown_eager
    assert not eager.buffer.view(torch.uint8).any()
    del lazy
    with pytest.raises(TypeError, match="prefault: expected bool, got str"):
        HostPool(kv, 1, pin_memory=False, prefault="yes")


def test_host_pool_page_bytes_round_trip():
    kv = kv_config("bfloat16")
    pool = HostPool(kv, 3, pin_memory=False)
    pool.buffer.fill_(0)
    data = torch.arange(kv.page_nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    pool.write_page_bytes(1, bytes(data.numpy()))
    assert torch.equal(pool.read_page_bytes(1), data)
    pool.write_page_bytes(2, pool.read_page_bytes(1))
    assert torch.equal(pool.buffer[2], pool.buffer[1])
    assert not pool.buffer[0].view(torch.uint8).any()
    copy = pool.read_page_bytes(1)
    pool.buffer[1].fill_(0)
    assert torch.equal(copy, data), "read_page_bytes must return a copy, not a view"
    with pytest.raises(ValueError, match=f"expected {kv.page_nbytes} bytes, got 3"):
        pool.write_page_bytes(0, b"abc")
    with pytest.raises(ValueError, match="page id"):
        pool.read_page_bytes(3)


def test_host_pool_refuses_more_than_available(monkeypatch):
    import hicache.memory.pools as pool_module

    fake = collections.namedtuple("vmem", "available")(10 << 30)
    monkeypatch.setattr(pool_module.psutil, "virtual_memory", lambda: fake)
    kv = kv_config()
    num_pages = (9 << 30) // kv.page_nbytes
    with pytest.raises(ValueError) as info:
        HostPool(kv, num_pages, reserve_nbytes=2 << 30)
    message = str(info.value)
    assert str(num_pages * kv.page_nbytes) in message  # the request
    assert str(8 << 30) in message and str(10 << 30) in message  # usable, available
    assert "host_reserve_nbytes" in message and "host_tokens" in message
    HostPool(kv, 4, reserve_nbytes=2 << 30, pin_memory=False)  # small requests still fit


@pytest.mark.parametrize("native", NATIVE_MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_page_copier_round_trip_is_bitwise(native, dtype):
    kv = kv_config(dtype, page_size=3, heads=1, head_dim=5, layers=3)
    device, host = DevicePool(kv, 7), HostPool(kv, 5, pin_memory=False)
    host.buffer.view(torch.uint8).fill_(0)
    for layer in range(3):
        device.write_pages(layer, ids(*range(7)), random_rows(kv, 7, layer),
                           random_rows(kv, 7, 10 + layer))
    before = [(k.clone(), v.clone()) for k, v in zip(device.k_buffers, device.v_buffers, strict=True)]
    copier = PageCopier(device, host, native=native)
    copier.backup(ids(6, 0, 3), ids(4, 1, 2), 0, 3)
    for layer in range(3):
        assert torch.equal(host.buffer[4, layer, 0].view(torch.uint8),
                           before[layer][0][6].view(torch.uint8))
        assert torch.equal(host.buffer[2, layer, 1].view(torch.uint8),
                           before[layer][1][3].view(torch.uint8))
    assert not host.buffer[[0, 3]].view(torch.uint8).any()
    copier.load(ids(4, 1, 2), ids(1, 2, 5), 0, 3)
    for layer in range(3):
        k, v = device.layer(layer)
        assert torch.equal(k[[1, 2, 5]].view(torch.uint8),
                           before[layer][0][[6, 0, 3]].view(torch.uint8))
        assert torch.equal(v[[1, 2, 5]].view(torch.uint8),
                           before[layer][1][[6, 0, 3]].view(torch.uint8))
        assert torch.equal(k[[0, 3, 4, 6]], before[layer][0][[0, 3, 4, 6]])


@pytest.mark.parametrize("native", NATIVE_MODES)
def test_page_copier_odd_row_bytes_use_narrow_words(native):
    # 3 tokens x 1 head x 5 dims x 1 byte: rows of 15 bytes, only a uint8 view fits.
    kv = KVConfig(2, 1, 5, "float8_e5m2", 3)
    device, host = DevicePool(kv, 4), HostPool(kv, 4, pin_memory=False)
    device.k_buffers[1].view(torch.uint8).copy_(
        torch.arange(4 * 15, dtype=torch.uint8).view(4, 3, 1, 5))
    copier = PageCopier(device, host, native=native)
    copier.backup(ids(2), ids(3), 0, 2)
    copier.load(ids(3), ids(0), 1, 2)
    assert torch.equal(device.k_buffers[1][0].view(torch.uint8),
                       device.k_buffers[1][2].view(torch.uint8))


@pytest.mark.parametrize("native", NATIVE_MODES)
@pytest.mark.parametrize(
    "dtype, page_size, heads, head_dim",
    [
        ("float32", 16, 2, 8),  # 1 KiB rows: whole 64-byte blocks, 16-byte aligned
        ("float32", 3, 2, 5),  # 120-byte rows: a 56-byte tail, some rows not 16-byte aligned
        ("float8_e5m2", 3, 1, 5),  # 15-byte rows: shorter than one streaming block
    ],
)
def test_streaming_stores_copy_the_same_bytes(native, dtype, page_size, heads, head_dim):
    kv = KVConfig(3, heads, head_dim, dtype, page_size)
    results = []
    for streaming_min_nbytes in (0, 1 << 40):  # every transfer streams / none does
        device, host = DevicePool(kv, 9), HostPool(kv, 6, pin_memory=False)
        host.buffer.view(torch.uint8).fill_(0)
        gen = torch.Generator().manual_seed(1)
        for buf in device.k_buffers + device.v_buffers:
            flat = buf.view(torch.uint8)
            flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
        copier = PageCopier(device, host, native=native, streaming_min_nbytes=streaming_min_nbytes)
        copier.backup(ids(8, 0, 3, 5), ids(4, 1, 2, 5), 0, 3)
        copier.load(ids(4, 1, 2, 5), ids(1, 2, 6, 7), 1, 3)
        results.append((host.buffer.view(torch.uint8).clone(),
                        [b.view(torch.uint8).clone() for b in device.k_buffers + device.v_buffers]))
        for layer in (1, 2):
            for buf in (device.k_buffers[layer], device.v_buffers[layer]):
                assert torch.equal(buf[[1, 2, 6, 7]].view(torch.uint8),
                                   buf[[8, 0, 3, 5]].view(torch.uint8))
    (host_a, dev_a), (host_b, dev_b) = results
    assert torch.equal(host_a, host_b)
    assert all(torch.equal(a, b) for a, b in zip(dev_a, dev_b, strict=True))


def test_page_copier_rejects_a_bad_streaming_threshold():
    kv = kv_config()
    device, host = DevicePool(kv, 2), HostPool(kv, 2, pin_memory=False)
    with pytest.raises(TypeError, match="streaming_min_nbytes: expected int, got float"):
        PageCopier(device, host, streaming_min_nbytes=1.0)
    with pytest.raises(ValueError, match="streaming_min_nbytes: expected >= 0, got -1"):
        PageCopier(device, host, streaming_min_nbytes=-1)


def test_layer_and_page_indices_are_checked_like_every_int():
    kv = kv_config(layers=2)
    device, host = DevicePool(kv, 3), HostPool(kv, 3, pin_memory=False)
    for bad, error, message in [
        (True, TypeError, "expected int, got bool"),
        ("1", TypeError, "expected int, got str"),
        (-1, ValueError, "expected >= 0, got -1"),
    ]:
        with pytest.raises(error, match=f"layer: {message}"):
            device.layer(bad)
        with pytest.raises(error, match=f"page id: {message}"):
            host.page(bad)
    with pytest.raises(ValueError, match="layer: expected 0 <= layer < 2, got 2"):
        device.read_pages(2, ids(0))
    with pytest.raises(ValueError, match="page id: expected 0 <= id < 3, got 3"):
        host.read_page_bytes(3)
    # numpy integers (what indexing an array gives) are ints like any other
    assert device.layer(np.int64(1))[0] is device.k_buffers[1]
    assert host.page(np.int64(2)).data_ptr() == host.buffer[2].data_ptr()
    with pytest.raises(TypeError, match="reserve_nbytes: expected int, got float"):
        HostPool(kv, 3, pin_memory=False, reserve_nbytes=1.0)
    with pytest.raises(ValueError, match="reserve_nbytes: expected >= 0, got -1"):
        HostPool(kv, 3, pin_memory=False, reserve_nbytes=-1)
