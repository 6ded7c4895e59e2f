"""hicache: a hierarchical GPU/CPU KV-cache manager for LLM inference."""

from hicache.allocator import PageAllocator
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, PrefetchPolicy, WritePolicy

__all__ = [
    "CacheConfig",
    "EvictionPolicy",
    "KVConfig",
    "PageAllocator",
    "PrefetchPolicy",
    "WritePolicy",
]
__version__ = "0.1.0"
