"""The cache's storage: the tree, the page free lists, the KV pools and the transfer engine.

:func:`build_tiers` makes them from a :class:`~hicache.config.CacheConfig`, after
checking that the pools fit the machine (``check_cache_memory``: before any pool
or free list exists). A cache without KV tensors (``allocate_kv=False``) gets no
pools and an immediate (bookkeeping) transfer engine; so does one without a host
tier, since nothing is ever transferred.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from hicache.config import CacheConfig
from hicache.memory import DevicePool, HostPool, PageAllocator, check_cache_memory
from hicache.transfer import TransferEngine
from hicache.tree import make_tree as make_radix_tree

if TYPE_CHECKING:  # annotations only
    from hicache.tree.protocol import RadixTreeLike


class Tiers(NamedTuple):
    tree: RadixTreeLike  # RadixTree or NativeRadixTree
    device_allocator: PageAllocator
    host_allocator: PageAllocator
    device_pool: DevicePool | None  # None: bookkeeping only
    host_pool: HostPool | None  # None: bookkeeping only, or no host tier
    transfers: TransferEngine


def build_tiers(config: CacheConfig) -> Tiers:
    check_cache_memory(config)  # before any pool or page allocator is built
    tree = make_tree(config)
    device_allocator = PageAllocator(config.num_device_pages, "device pages")
    host_allocator = PageAllocator(config.num_host_pages, "host pages")
    device_pool = host_pool = None
    executor = "immediate"
    if config.allocate_kv:
        device_pool = DevicePool(config.kv, config.num_device_pages, config.device)
        if config.has_host_tier:
            host_pool = HostPool(
                config.kv, config.num_host_pages, reserve_nbytes=config.host_reserve_nbytes
            )
            executor = config.executor  # (a copying executor demands a host pool)
    transfers = TransferEngine(device_pool, host_pool, executor)
    return Tiers(tree, device_allocator, host_allocator, device_pool, host_pool, transfers)


def make_tree(config: CacheConfig) -> RadixTreeLike:
    """The radix tree ``config.tree`` names: the Python reference tree or the native one."""
    return make_radix_tree(config.tree, config.page_size, config.eviction,
                           components=config.kv.component_specs)
