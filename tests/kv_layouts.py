"""The shapes the test folders share: tree implementations, the page size, KV layouts,
and page ids and token sequences built from them.

Importable from every test folder (``from kv_layouts import ...``): pytest puts ``tests/``
on ``sys.path`` for ``tests/conftest.py``.
"""

from __future__ import annotations

import torch
from optional import available

from hicache.config import KVConfig

TREE_KINDS = ["python"] + (["native"] if available("native") else [])
# (tree, lifecycle) pairs: the Python reference, the native tree under the Python
# lifecycle, and the C++ lifecycle.
LIFECYCLES = [("python", "python")] + (
    [("native", "python"), ("native", "native")] if "native" in TREE_KINDS else []
)

P = 2  # tokens per page
# float32, 2 layers, 1 head of 4: small enough to write each token's KV by formula.
KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=P)
# One layer, one head of 2: bookkeeping scenarios, where the KV's size does not matter.
KV_TINY = KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=P)


def pages(*ids: int) -> torch.Tensor:
    """Page ids as the int64 tensor the tree and the pools take."""
    return torch.tensor(ids, dtype=torch.int64)


def seq(first: int, num_pages: int) -> list[int]:
    """``num_pages`` whole pages of distinct tokens ``first, first + 1, ...``."""
    return list(range(first, first + num_pages * P))


def kv_one_float(page_size: int) -> KVConfig:
    """One layer, one head of one float32: bookkeeping scenarios at any page size."""
    return KVConfig(1, 1, 1, "float32", page_size=page_size)
