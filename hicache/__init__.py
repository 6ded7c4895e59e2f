"""hicache: a hierarchical GPU/CPU KV-cache manager for LLM inference."""

from hicache.allocator import PageAllocator
from hicache.cache import CacheStats, HiCache, LoadError, PrefixHandle
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, PrefetchPolicy, WritePolicy
from hicache.control import ResetResult
from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored
from hicache.logs import configure_from_env as _configure_logging
from hicache.tree import IOStatus, RadixTree

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheStats",
    "EvictionPolicy",
    "HiCache",
    "IOStatus",
    "KVConfig",
    "LoadError",
    "PageAllocator",
    "PrefetchPolicy",
    "PrefixHandle",
    "RadixTree",
    "ResetResult",
    "WritePolicy",
]
__version__ = "0.1.0"

_configure_logging()  # the `hicache` logger: silent unless HICACHE_LOG_LEVEL or the app says
