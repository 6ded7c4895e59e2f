"""hicache: a hierarchical GPU/CPU KV-cache manager for LLM inference."""

from hicache.cache import CacheStats, HiCache, LoadError, PrefixHandle, ResetResult
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, PrefetchPolicy, WritePolicy
from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored
from hicache.logs import configure_from_env as _configure_logging
from hicache.memory import PageAllocator
from hicache.sim.engine import Engine
from hicache.sim.model import Model, preset
from hicache.tree import IOStatus, RadixTree

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheStats",
    "Engine",
    "EvictionPolicy",
    "HiCache",
    "IOStatus",
    "KVConfig",
    "LoadError",
    "Model",
    "PageAllocator",
    "PrefetchPolicy",
    "PrefixHandle",
    "RadixTree",
    "ResetResult",
    "WritePolicy",
    "preset",
]
__version__ = "0.1.0"

_configure_logging()  # the `hicache` logger: silent unless HICACHE_LOG_LEVEL or the app says
