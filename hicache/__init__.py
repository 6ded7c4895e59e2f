"""hicache: a hierarchical GPU/CPU KV-cache manager for LLM inference.

The library is the cache and what it is made of (tree, pools, transfers, storage).
``Engine``, ``Model`` and ``preset`` come from the simulator (:mod:`hicache.sim`), a
harness around the library: they are attributes resolved on first use, so
``import hicache`` loads neither the simulator nor the command line (:mod:`hicache.cli`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.cache import CacheStats, HiCache, LoadError, PrefixHandle, ResetResult
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, PrefetchPolicy, WritePolicy
from hicache.errors import (
    ConfigError,
    ConfigTypeError,
    HiCacheError,
    NativeBuildError,
    StorageError,
)
from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored
from hicache.logs import configure_from_env as _configure_logging
from hicache.memory import PageAllocator
from hicache.tree import IOStatus, RadixTree

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheStats",
    "ConfigError",
    "ConfigTypeError",
    "Engine",
    "EvictionPolicy",
    "HiCache",
    "HiCacheError",
    "IOStatus",
    "KVConfig",
    "LoadError",
    "Model",
    "NativeBuildError",
    "PageAllocator",
    "PrefetchPolicy",
    "PrefixHandle",
    "RadixTree",
    "ResetResult",
    "StorageError",
    "WritePolicy",
    "preset",
]


def _package_version() -> str:
    """The installed distribution's version: pyproject.toml is its one source. A source
    tree used without installing has no metadata, hence no version to report."""
    import importlib.metadata

    try:
        return importlib.metadata.version("hicache")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _package_version()

if TYPE_CHECKING:  # for type checkers and IDEs; at run time see __getattr__
    from hicache.sim.engine import Engine
    from hicache.sim.model import Model, preset

_SIM_ATTRIBUTES = {"Engine": "hicache.sim.engine", "Model": "hicache.sim.model",
                   "preset": "hicache.sim.model"}


def __getattr__(name: str) -> Any:
    """The simulator's names, imported on first use (PEP 562)."""
    module = _SIM_ATTRIBUTES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


_configure_logging()  # the `hicache` logger: silent unless HICACHE_LOG_LEVEL or the app says
