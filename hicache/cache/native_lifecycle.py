"""HiCache's request lifecycle in C++, for bookkeeping-only caches (replay, capacity planning).

A cache with no KV tensors (``allocate_kv=False``) and no third tier moves no
data: every load and backup completes as it starts, and what remains is tree
and free-list bookkeeping. :class:`NativeLifecycle` hands the hot calls
(``match``, ``alloc``, ``insert``, ``release``) to ``csrc/lifecycle.cpp``,
which makes the same tree and free-list calls in the same order as the Python
methods and keeps the same counters, in one crossing per call. HiCache still
owns the handles and checks every argument first; the other methods run in
Python on the same tree and free lists. ``tests/cache/test_lifecycle_differential.py``
holds both lifecycles to identical trees, pages and counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from hicache.cache.handle import PrefixHandle
from hicache.cache.stats import CacheStats
from hicache.config import CacheConfig, WritePolicy
from hicache.tree import TokenLike, token_key
from hicache.tree.native import NativeNode, NativeRadixTree, readable_in_place

if TYPE_CHECKING:  # annotations only
    from hicache.memory import PageAllocator
    from hicache.native.binding import LifecycleBinding
    from hicache.tree.protocol import NodeLike, RadixTreeLike


class NativePrefixHandle(PrefixHandle):
    """A :class:`PrefixHandle` whose lock node is held as a native node handle (an int).

    The hot calls pass ``_lock_h`` straight to C++. Python code reading
    ``_lock_node`` gets the node's proxy (made then, and the node kept
    readable from then on, as proxies are); after release the node may be gone.
    """

    _tree: NativeRadixTree
    _lock_h: int  # the lock node's handle

    @property
    def _lock_node(self) -> NativeNode:
        return self._tree._adopt(self._lock_h)

    @_lock_node.setter
    def _lock_node(self, node: NodeLike | int) -> None:
        if type(node) is int:
            self._lock_h = node
        else:
            assert type(node) is NativeNode, f"a native handle holds native nodes, got {node!r}"
            self._lock_h = node._h


def _native(h: PrefixHandle) -> NativePrefixHandle:
    """``h``, which :meth:`NativeLifecycle.match` made (HiCache checks a handle is its own)."""
    return cast(NativePrefixHandle, h)


def open_native_lifecycle(
    config: CacheConfig, tree: RadixTreeLike, device_allocator: PageAllocator,
    host_allocator: PageAllocator,
) -> NativeLifecycle | None:
    """The C++ lifecycle where it applies (``config.lifecycle``), else None (Python runs it)."""
    if (config.lifecycle == "python" or config.allocate_kv or config.storage is not None
            or config.kv.component_specs):  # hybrid models: the Python lifecycle only
        return None
    if (
        type(tree) is not NativeRadixTree
        or device_allocator.backend != "native"
        or host_allocator.backend != "native"
    ):
        if config.lifecycle == "native":
            raise ValueError(
                "lifecycle='native': expected the native tree and free lists, got "
                f"{type(tree).__name__} and {device_allocator.backend} free lists"
            )
        return None
    from hicache.native.build import load_native

    lifecycle = load_native().Lifecycle
    core = lifecycle(
        tree._impl,
        device_allocator._native,
        host_allocator._native,
        WritePolicy(config.write_policy).value,
        config.backup_hit_threshold,
        config.load_threshold_tokens,
        config.kv.page_nbytes,
        config.has_host_tier,
    )
    return NativeLifecycle(
        core, lifecycle.counter_names, tree, device_allocator, config.page_size,
        config.kv.num_layers,
    )


class NativeLifecycle:
    """The hot calls of the request lifecycle, one C++ crossing each (module docstring).

    The same calls as :class:`hicache.cache.python_lifecycle.PythonLifecycle`
    (``load_back`` excepted: it runs in Python). The caller (HiCache) has checked
    every argument; handles it returns belong to the ``owner`` passed in.
    """

    def __init__(
        self, core: LifecycleBinding, counter_names: list[str], tree: NativeRadixTree,
        device_allocator: PageAllocator, page_size: int, num_layers: int,
    ) -> None:
        self._core = core
        self._device_allocator = device_allocator
        self._num_layers = num_layers
        self._counter_names = counter_names
        self._tree = tree
        self._page_size = page_size

    def add_counters(self, c: CacheStats) -> None:
        """Add what the C++ side counted since the last call into ``c``."""
        for name, value in zip(self._counter_names, self._core.take_counters(), strict=True):
            if value:
                setattr(c, name, getattr(c, name) + value)

    def match(
        self, owner: object, tokens: TokenLike, namespace: str | None, load_back: bool
    ) -> PrefixHandle:
        # The binding reads int32/int64 arrays in place; token_key checks the others first.
        arg = tokens if readable_in_place(tokens) else token_key(tokens, self._page_size)
        num_tokens = len(tokens)
        lock, device_len, host_len, prefix_len, key = self._core.match(
            arg, namespace, num_tokens, load_back
        )
        h = NativePrefixHandle(
            owner, self._tree, self._num_layers, key, namespace, device_len, host_len, lock
        )
        h.prefix_len = prefix_len
        return h

    def raise_priority(self, h: PrefixHandle, priority: int) -> None:
        self._tree._impl.raise_priority(_native(h)._lock_h, priority)

    def alloc(self, h: PrefixHandle, num_pages: int) -> torch.Tensor | None:
        return self._core.alloc(num_pages)

    def insert(self, h: PrefixHandle, tokens: TokenLike) -> int:
        h = _native(h)
        arg = tokens if readable_in_place(tokens) else token_key(tokens, self._page_size)
        owned = h._new_pages
        run = owned[0] if len(owned) == 1 else torch.cat(owned) if owned else None
        done = self._core.insert(arg, h.namespace, h._lock_h, run, h.key, h.prefix_len)
        if done is None:  # no whole page past the prefix
            return 0
        h._lock_h, new_tokens, h.key, rest = done
        h._new_pages = [] if rest is None else [rest]
        h._prefix_pages = None
        h.prefix_len = len(h.key) >> 2
        return new_tokens

    def release(self, h: PrefixHandle) -> None:
        h = _native(h)
        if len(h._new_pages) <= 1:  # one crossing releases the lock and one run of pages
            self._core.release(h._lock_h, h._new_pages[0] if h._new_pages else None)
            return
        self._tree.unlock(h._lock_node)
        for pages in h._new_pages:
            self._device_allocator.free(pages)
