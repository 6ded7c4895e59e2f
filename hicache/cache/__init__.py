"""The cache: HiCache's public lifecycle over the tree, the pools, the transfers and storage."""

from hicache.cache.control import ResetResult
from hicache.cache.facade import HiCache
from hicache.cache.handle import LoadError, PrefixHandle
from hicache.cache.inflight import InFlightIO
from hicache.cache.stats import CacheStats

__all__ = ["CacheStats", "HiCache", "InFlightIO", "LoadError", "PrefixHandle", "ResetResult"]
