"""Fixtures every test folder may use; where the rest of the test support lives.

Shared modules in ``tests/`` (importable from every folder: pytest puts ``tests/`` on
``sys.path`` for this conftest), by subject:

* ``kv_layouts``: tree kinds and lifecycles, the page size, KV layouts, page ids;
* ``leak_checks``: quiescence checks (``assert_no_leaks``) and driving transfers home;
* ``serving``: one request through a cache, bookkeeping only or with KV by formula;
* ``tree_observation``: what the differential tests compare between two trees;
* ``cuda_streams``: the devices a test runs on, holding a copy in flight on a stream;
* ``optional_vllm``: whether vLLM is usable (``HICACHE_REQUIRE_VLLM``).

A folder's own support sits in that folder: ``cache/manual_executor.py``,
``storage/engine_processes.py``, ``integrations/vllm_processes.py`` (and the vLLM
drivers beside it), ``cli/cli_runs.py``, fixtures in the folder's ``conftest.py``.
``helpers.py`` re-exports the names test modules imported from it before this split.
"""

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

