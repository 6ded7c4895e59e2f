from __future__ import annotations

import pytest
import torch

from hicache.tree import RadixTree
from hicache.tree.native import native_available

TREE_KINDS = ["python"] + (["native"] if native_available() else [])


@pytest.fixture(params=TREE_KINDS)
def make_tree(request):
    """Factory for a tree of the parametrized implementation: ``make_tree(page_size, eviction)``."""

    def factory(page_size: int = 2, eviction: str = "lru", **kwargs):
        if request.param == "python":
            return RadixTree(page_size, eviction, **kwargs)
        from hicache.tree.native import NativeRadixTree

        return NativeRadixTree(page_size, eviction, **kwargs)

    return factory


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and spinning OpenMP workers on a busy
    2-core machine made the model tests ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    """The tiny reference model, seeded (weights drawn once per module)."""
    from hicache.sim.model import Model, preset

    return Model(preset("tiny"), seed=0)


def assert_no_leaks(cache) -> None:
    """At quiescence: invariants hold, nothing in flight or held, every page accounted for."""
    from hicache.tree import IOStatus

    cache.check_integrity()
    P = cache.page_size
    s = cache.stats()
    assert s["transfers_in_flight"] == 0 and s["live_requests"] == 0
    assert s["device_pages_used"] == s["device_cached_tokens"] // P, "device pages leaked"
    assert s["host_pages_used"] == s["host_cached_tokens"] // P, "host pages leaked"
    for node in cache.tree.nodes():
        assert node.lock_ref == 0 and node.host_lock_ref == 0, f"lock leaked on {node}"
        assert node.io_status is IOStatus.NONE, f"IO left in flight on {node}"
    assert cache.tree.device_protected_tokens == 0 and cache.tree.host_protected_tokens == 0


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)
