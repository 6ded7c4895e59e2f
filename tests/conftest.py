from __future__ import annotations

import pytest
import torch
from kv_layouts import TREE_KINDS

from hicache.tree import RadixTree


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

