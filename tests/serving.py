"""One request through a cache, for the cache, storage and integration tests.

Two ways to serve a request, by how much of the KV they touch (the third, on the manual
executor, is ``tests/cache/manual_executor.py``'s ``serve_manual``):

* :func:`serve`: bookkeeping only (pages and the tree; no KV written or read), usually
  over a :func:`bookkeeping` cache;
* :func:`serve_kv`: KV given by :func:`expected_kv` under ``kv_layouts.KV``, read back
  bitwise; loads waited for with ``h.wait()`` (executors that copy on their own).
"""

from __future__ import annotations

import torch
from kv_layouts import KV, KV_TINY, P

from hicache.cache import HiCache, PrefixHandle
from hicache.config import CacheConfig, KVConfig


def bookkeeping(tree: str, lifecycle: str = "auto", *, kv: KVConfig = KV_TINY,
                device_tokens: int = 16, host_tokens: int | None = 32, **kw) -> HiCache:
    """A cache without KV tensors (``allocate_kv=False``): tree, allocators and lifecycle.

    ``host_tokens=None``: no host tier. A lifecycle other than ``auto`` must be the one
    the cache runs (a parametrized test would otherwise test the other one silently).
    """
    cfg = CacheConfig(kv, device_tokens=device_tokens, host_tokens=host_tokens,
                      allocate_kv=False, tree=tree, lifecycle=lifecycle, **kw)
    cache = HiCache(cfg)
    assert lifecycle == "auto" or cache.lifecycle == lifecycle
    return cache


def serve(cache: HiCache, tokens, ns: str | None = None, *, finish_loads: bool = False,
          may_refuse: bool = False, skip_cached: bool = False) -> bool:
    """One request's bookkeeping: match, allocate past the prefix, insert, release.

    No KV is written or checked. ``finish_loads``: wait for the prefix's loads (and poll)
    before allocating; with KV a load must land before the insert. ``may_refuse``: a
    refused allocation skips the insert and returns False instead of failing.
    ``skip_cached``: a full hit allocates and inserts nothing (an insert would run the
    write policy again). Returns whether the request was cached.
    """
    h = cache.match(tokens, ns)
    if finish_loads:
        assert cache.finish_loads(h)
    num_new = len(tokens) - h.prefix_len
    ok = True
    if num_new or not skip_cached:
        ok = cache.alloc(h, num_new) is not None
        assert ok or may_refuse, f"alloc of {num_new} tokens refused"
        if ok:
            cache.insert(h, tokens)
    cache.release(h)
    return ok


def expected_kv(tokens: list[int], layer: int) -> torch.Tensor:
    """K of each position under :data:`KV`: a function of the token, its position and the
    layer; V is ``-K``."""
    pos = torch.arange(len(tokens), dtype=torch.float32)
    tok = torch.tensor(tokens, dtype=torch.float32)
    base = tok * 1000 + pos * 10 + layer * 1_000_000
    return base[:, None, None] + torch.arange(4, dtype=torch.float32)[None, None, :]


def compute(cache: HiCache, h: PrefixHandle, tokens: list[int]) -> None:
    """Play the model: allocate pages past the prefix and write the KV of those tokens."""
    start = h.prefix_len
    pages = cache.alloc(h, len(tokens) - start)
    assert pages is not None
    table = h.page_table()
    for layer in range(KV.num_layers):
        k = expected_kv(tokens, layer)
        # whole pages from the first computed page on (start is page-aligned)
        first, n_pages = start // P, -(-len(tokens) // P) - start // P
        rows = torch.zeros(n_pages * P, 1, 4)
        rows[: len(tokens) - start] = k[start:]
        cache.device_pool.write_pages(layer, table[first : first + n_pages], rows, -rows)


def read_prefix(cache: HiCache, h: PrefixHandle, tokens: list[int]) -> None:
    """Assert the device pages of h's prefix hold exactly the KV of ``tokens``."""
    table = h.page_table()[: h.prefix_len // P]
    for layer in range(KV.num_layers):
        h.wait_layer(layer)
        k, v = cache.device_pool.read_pages(layer, table)
        want = expected_kv(tokens[: h.prefix_len], layer)
        assert torch.equal(k, want), f"layer {layer}: K differs"
        assert torch.equal(v, -want), f"layer {layer}: V differs"


def serve_kv(cache: HiCache, tokens: list[int], namespace=None) -> PrefixHandle:
    """One request with KV: wait for the prefix, check it bitwise, compute the rest, insert."""
    h = cache.match(tokens, namespace)
    h.wait()
    read_prefix(cache, h, tokens)
    compute(cache, h, tokens)
    cache.insert(h, tokens)
    cache.release(h)
    return h
