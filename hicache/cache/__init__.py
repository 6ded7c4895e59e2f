"""The cache: HiCache's public lifecycle over the tree, the pools, the transfers and storage."""

from hicache.cache.control import ResetResult
from hicache.cache.facade import CacheStats, HiCache, _Transfer
from hicache.cache.handle import LoadError, PrefixHandle

__all__ = ["CacheStats", "HiCache", "LoadError", "PrefixHandle", "ResetResult", "_Transfer"]
