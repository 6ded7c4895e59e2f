"""Pick a radix tree: the C++ one when it builds here, else the Python reference.

Callers that do not care which tree they get (the cache, replay, benchmarks)
call :func:`make_tree` and type against :class:`hicache.tree.protocol.RadixTreeLike`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from hicache.components import ComponentSpec, check_components
from hicache.config import EvictionPolicy
from hicache.tree.protocol import RadixTreeLike
from hicache.tree.python import HybridRadixTree, RadixTree


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"hicache: native radix tree unavailable ({reason}); using the Python tree",
        RuntimeWarning,
        stacklevel=3,
    )


def make_tree(
    kind: str,
    page_size: int,
    eviction: EvictionPolicy | str = EvictionPolicy.LRU,
    on_split: Callable[[Any, Any], None] | None = None,
    components: Sequence[ComponentSpec] = (),
) -> RadixTreeLike:
    """A radix tree of ``kind``: ``"python"``, ``"native"`` or ``"auto"``.

    ``"auto"`` is native when it builds here, else the Python tree with one
    ``RuntimeWarning`` per process naming the reason. ``"native"`` raises
    :class:`NativeBuildError` instead of falling back. ``components`` (hybrid
    models, docs/design.md): one :class:`~hicache.components.ComponentSpec` per
    sliding-window or recurrent-state class; the Python tree is then a
    :class:`~hicache.tree.python.hybrid.HybridRadixTree`.
    """
    components = check_components(components)
    if kind == "python":
        if components:
            return HybridRadixTree(page_size, eviction, on_split=on_split, components=components)
        return RadixTree(page_size, eviction, on_split=on_split)
    if kind not in ("native", "auto"):
        raise ValueError(f"kind: expected 'python', 'native' or 'auto', got {kind!r}")
    # Imported here: a Python-tree caller never loads the native build machinery.
    from hicache.native import build as jit
    from hicache.tree.native import NativeRadixTree

    if kind == "auto":
        result = jit._load()
        if result.module is None:
            _warn_fallback(result.reason)
            if components:
                return HybridRadixTree(page_size, eviction, on_split=on_split,
                                       components=components)
            return RadixTree(page_size, eviction, on_split=on_split)
    return NativeRadixTree(page_size, eviction, on_split=on_split, components=components)
