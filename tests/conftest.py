from __future__ import annotations

import pytest
import torch

from hicache.tree import RadixTree

TREE_KINDS = ["python"] + (["native"] if __import__("hicache.native").native.native_available() else [])


@pytest.fixture(params=TREE_KINDS)
def make_tree(request):
    """Factory for a tree of the parametrized implementation: ``make_tree(page_size, eviction)``."""

    def factory(page_size: int = 2, eviction: str = "lru", **kwargs):
        if request.param == "python":
            return RadixTree(page_size, eviction, **kwargs)
        from hicache.native import NativeRadixTree

        return NativeRadixTree(page_size, eviction, **kwargs)

    return factory


def pages(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)
