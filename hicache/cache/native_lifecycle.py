"""HiCache's request lifecycle in C++, for bookkeeping-only caches (replay, capacity planning).

A cache with no KV tensors (``allocate_kv=False``) and no third tier moves no
data: every load and backup completes as it starts, and what remains is tree
and free-list bookkeeping. :class:`NativeLifecycleMixin` hands the hot calls
(``match``, ``alloc``, ``insert``, ``release``) to ``csrc/lifecycle.cpp``,
which makes the same tree and free-list calls in the same order as the Python
methods and keeps the same counters, in one crossing per call. HiCache still
owns the handles and checks every argument first; the other methods run in
Python on the same tree and free lists. ``tests/cache/test_lifecycle_differential.py``
holds both lifecycles to identical trees, pages and counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.cache.handle import PrefixHandle
from hicache.config import CacheConfig
from hicache.tree import TokenLike, token_key
from hicache.tree.native import NativeNode, _readable_in_place

if TYPE_CHECKING:
    from hicache.cache.facade import CacheStats


class NativePrefixHandle(PrefixHandle):
    """A :class:`PrefixHandle` whose lock node is held as a native node handle (an int).

    The hot calls pass ``_lock_h`` straight to C++. Python code reading
    ``_lock_node`` gets the node's proxy (made then, and the node kept
    readable from then on, as proxies are); after release the node may be gone.
    """

    @property
    def _lock_node(self) -> NativeNode:
        return self._cache.tree._adopt(self._lock_h)

    @_lock_node.setter
    def _lock_node(self, node: NativeNode | int) -> None:
        self._lock_h = node if type(node) is int else node._h


class NativeLifecycleMixin:
    """The native-lifecycle half of :class:`hicache.HiCache` (see the module docstring)."""

    _core: object | None
    _counters: CacheStats

    def _open_lifecycle(self, config: CacheConfig) -> None:
        """Use the C++ lifecycle where it applies (``config.lifecycle``), else Python."""
        self._core = None
        if config.lifecycle == "python" or config.allocate_kv or config.storage is not None:
            return
        from hicache.tree.native import NativeRadixTree

        usable = (
            type(self.tree) is NativeRadixTree
            and self.device_allocator.backend == "native"
            and self.host_allocator.backend == "native"
        )
        if not usable:
            if config.lifecycle == "native":
                raise ValueError(
                    "lifecycle='native': expected the native tree and free lists, got "
                    f"{type(self.tree).__name__} and {self.device_allocator.backend} free lists"
                )
            return
        from hicache.native.build import load_native

        lifecycle = load_native().Lifecycle
        self._core = lifecycle(
            self.tree._impl,
            self.device_allocator._native,
            self.host_allocator._native,
            config.write_policy.value,
            config.backup_hit_threshold,
            config.load_threshold_tokens,
            config.kv.page_nbytes,
            config.has_host_tier,
        )
        self._core_counter_names = lifecycle.counter_names

    @property
    def lifecycle(self) -> str:
        """Where the request lifecycle runs: ``"native"`` (C++) or ``"python"``."""
        return "python" if self._core is None else "native"

    @property
    def counters(self) -> CacheStats:
        """Counters since construction (exact; see :class:`hicache.cache.CacheStats`)."""
        core = self._core  # read-only: also after close()
        if core is not None:
            c = self._counters
            for name, value in zip(self._core_counter_names, core.take_counters(), strict=True):
                if value:
                    setattr(c, name, getattr(c, name) + value)
        return self._counters

    def _match_native(
        self, tokens: TokenLike, namespace: str | None, load_back: bool
    ) -> PrefixHandle:
        if _readable_in_place(tokens):  # the binding reads int32/int64 arrays in place
            num_tokens = len(tokens)
        else:
            key = token_key(tokens, self.page_size)  # checks what tokens are first
            num_tokens = len(tokens)
            tokens = key
        lock, device_len, host_len, prefix_len, key = self._core.match(
            tokens, namespace, num_tokens, load_back
        )
        h = NativePrefixHandle(self, key, namespace, device_len, host_len, lock)
        h.prefix_len = prefix_len
        self._live.add(h)
        return h

    def _insert_native(self, h: PrefixHandle, tokens: TokenLike) -> int:
        if not _readable_in_place(tokens):
            tokens = token_key(tokens, self.page_size)
        owned = h._new_pages
        run = owned[0] if len(owned) == 1 else torch.cat(owned) if owned else None
        done = self._core.insert(tokens, h.namespace, h._lock_h, run, h.key, h.prefix_len)
        if done is None:  # no whole page past the prefix
            return 0
        h._lock_h, new_tokens, h.key, rest = done
        h._new_pages = [] if rest is None else [rest]
        h._prefix_pages = None
        h.prefix_len = len(h.key) >> 2
        return new_tokens
