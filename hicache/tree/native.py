"""The native (C++20) radix tree: the wrapper over the binding's tree.

:class:`NativeRadixTree` behaves exactly like :class:`hicache.tree.RadixTree`
(same methods, results, eviction order, page order and errors); the Python
tree stays the reference and the fallback. :mod:`hicache.native.build` builds and loads
the C++ sources.

Nodes cross the binding as integer handles; :class:`NativeNode` proxies
(:mod:`hicache.tree.native_node`) wrap them. One handle always maps to the same proxy object (callers compare nodes
with ``is`` and key dicts by them). A node removed from the tree stays readable
through its proxy (``parent`` is ``None``), as a removed Python node does, but
tree operations on it raise ``ValueError`` (stale).

What this module does not know: what the tree is used for, KV tensors, pages'
owners. :func:`hicache.tree.make_tree` picks this tree or the Python one.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch

from hicache.checks import check_int, check_priority
from hicache.components import ComponentSpec, check_components
from hicache.config import EvictionPolicy
from hicache.native.binding import TreeBinding
from hicache.native.build import (  # noqa: F401  (re-exported: the tree's build status)
    NativeBuildError,
    load_native,
    native_available,
    native_build_seconds,
    native_unavailable_reason,
)
from hicache.tree.guards import check_key, check_page_size
from hicache.tree.native_components import NativeComponents
from hicache.tree.native_node import NativeNode
from hicache.tree.types import (
    EvictResult,
    InsertResult,
    IOStatus,
    MatchResult,
    TokenLike,
    TreeEvent,
    token_key,
)

_FAST_TOKEN_DTYPES = frozenset({torch.int32, torch.int64, np.dtype(np.int32), np.dtype(np.int64)})
_MAX_COUNT = 2**62  # larger eviction requests mean "everything"; keeps C++ int64 math safe


def readable_in_place(tokens: object) -> bool:
    """True for int32/int64 tensors and numpy arrays: the binding reads them as they are.

    Exact type checks (``isinstance`` against ``torch.Tensor`` goes through its
    metaclass); subclasses and other dtypes take the general path through
    :func:`hicache.tree.token_key`.
    """
    tp = type(tokens)
    if tp is np.ndarray or tp is torch.Tensor:
        return cast("np.ndarray[Any, Any] | torch.Tensor", tokens).dtype in _FAST_TOKEN_DTYPES
    return False


def _probe_key_bytes(key: bytes, namespace: object, page_size: int) -> bytes:
    """A probe's key as the binding reads it. A non-str namespace names no root (the
    binding finds nothing), but an unhashable one raises TypeError, as the Python
    tree's dict lookup does."""
    key = check_key(key, 4 * page_size)
    if namespace is not None and not isinstance(namespace, str):
        hash(namespace)
    return key


class NativeRadixTree(NativeComponents):
    """The radix tree of :mod:`hicache.tree`, implemented in C++ (see the module docstring).

    Same constructor, methods, results and errors as :class:`hicache.tree.RadixTree`.
    Token ids are read without copies from int32 tensors and int32 numpy
    arrays (int64 ones are narrowed once in C++); lists and tuples are converted
    once by :func:`hicache.tree.token_key`.
    """

    def __init__(
        self,
        page_size: int,
        eviction: EvictionPolicy | str = EvictionPolicy.LRU,
        on_split: Callable[[NativeNode, NativeNode], None] | None = None,
        components: Sequence[ComponentSpec] = (),
    ) -> None:
        check_page_size(page_size)
        policy = EvictionPolicy(eviction)
        self.eviction = policy
        self.page_size = page_size
        # Hybrid models (docs/design.md, "Hybrid models: components"); () for a single kind.
        self.components = check_components(components)
        kinds = [(s.is_window, s.width, s.window_pages(page_size)) for s in self.components]
        self._impl: TreeBinding = load_native().Tree(page_size, policy.value, kinds)
        self._proxies: dict[int, NativeNode] = {}
        self._prune_at = 256  # prune proxies of removed nodes when the cache grows past this
        self._on_split: Callable[[NativeNode, NativeNode], None] | None = None
        self.on_split = on_split

    # ------------------------------------------------------------- handles
    @property
    def on_split(self) -> Callable[[NativeNode, NativeNode], None] | None:
        """Called as ``on_split(prefix, suffix)`` on every split; ``suffix`` is the original node."""
        return self._on_split

    @on_split.setter
    def on_split(self, fn: Callable[[NativeNode, NativeNode], None] | None) -> None:
        self._on_split = fn
        if fn is None:
            self._impl.set_on_split(None)
            return
        # A weak reference: the C++ object holding this relay must not keep the tree alive.
        ref = weakref.ref(self)

        def relay(prefix: int, suffix: int) -> None:
            tree = ref()
            if tree is not None and tree._on_split is not None:
                tree._on_split(tree._node(prefix), tree._node(suffix))

        self._impl.set_on_split(relay)

    def _node(self, handle: int) -> NativeNode:
        proxy = self._proxies.get(handle)
        if proxy is None:
            proxy = self._proxies[handle] = NativeNode(self, handle)
            if len(self._proxies) > self._prune_at:
                self._prune_proxies()
        return proxy

    def _adopt(self, handle: int) -> NativeNode:
        """The proxy of a handle the binding returned without a proxy (the native lifecycle's).

        Such a node is freed as soon as it leaves the tree; once it has a proxy it
        stays readable after removal, as every proxied node does. Raises
        ``ValueError`` when the node already left the tree.
        """
        proxy = self._proxies.get(handle)
        if proxy is None:
            self._impl.export(handle)
            proxy = self._node(handle)
        return proxy

    def _prune_proxies(self) -> None:
        """Forget proxies of removed nodes that nobody else holds, and free those nodes.

        A removed node stays readable while its proxy is referenced (as a removed
        Python node does); ``sys.getrefcount(proxies[h]) == 2`` means only this
        cache (and the call's own argument) refers to the proxy.
        """
        proxies = self._proxies
        live = set(self._impl.live(list(proxies)))
        kept = {
            h: proxies[h] for h in list(proxies) if h in live or sys.getrefcount(proxies[h]) > 2
        }
        self._proxies = kept
        self._impl.release_detached([h for h in kept if h not in live])
        # Amortized O(1) per proxy; removed nodes (and their token storage) wait for
        # at most half as many new proxies as there are kept ones.
        self._prune_at = len(kept) + max(256, len(kept) // 2)

    def _handle(self, node: object, op: str) -> int:
        if type(node) is NativeNode:
            if node._tree is self:
                return node._h
            raise ValueError(f"{op}: node {node._h} belongs to another tree")
        raise TypeError(f"{op}: expected a NativeNode, got {type(node).__name__}")

    def _tokens(self, tokens: TokenLike) -> object:
        """``tokens`` as the binding reads them: int32/int64 arrays as they are, else key bytes."""
        if readable_in_place(tokens):
            return tokens
        return token_key(tokens, self.page_size)

    # -------------------------------------------------------------- basics
    def root(self, namespace: str | None = None) -> NativeNode:
        """The root of a namespace (created on first use). Roots hold no tokens."""
        return self._node(self._impl.root(namespace))

    def namespaces(self) -> list[str | None]:
        """The namespaces that have a root now, oldest root first (nodes() order)."""
        return self._impl.namespaces()

    def prune_namespaces(self) -> int:
        """Free the root of every namespace holding no node and no lock; see
        :meth:`RadixTree.prune_namespaces`."""
        return self._impl.prune_namespaces()

    @property
    def num_nodes(self) -> int:
        return self._impl.num_nodes

    @property
    def device_evictable_tokens(self) -> int:
        return self._impl.device_evictable_tokens

    @property
    def device_protected_tokens(self) -> int:
        return self._impl.device_protected_tokens

    @property
    def host_evictable_tokens(self) -> int:
        return self._impl.host_evictable_tokens

    @property
    def host_protected_tokens(self) -> int:
        return self._impl.host_protected_tokens

    @property
    def host_takeable_tokens(self) -> int:
        return self._impl.host_takeable_tokens

    @property
    def device_tokens(self) -> int:
        impl = self._impl
        return impl.device_evictable_tokens + impl.device_protected_tokens

    @property
    def host_tokens(self) -> int:
        impl = self._impl
        return impl.host_evictable_tokens + impl.host_protected_tokens

    def nodes(self) -> Iterator[NativeNode]:
        """All non-root nodes, parents before children (a snapshot taken at the call)."""
        node = self._node
        return iter([node(h) for h in self._impl.nodes()])

    # --------------------------------------------------------- match/insert
    def match_prefix(self, tokens: TokenLike, namespace: str | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages); see :meth:`RadixTree.match_prefix`."""
        arg = tokens if readable_in_place(tokens) else token_key(tokens, self.page_size)
        if self.components:
            return self._match_components(arg, namespace)
        device_len, host_len, last_device, last = self._impl.match(arg, namespace)
        proxies = self._proxies
        return MatchResult(
            device_len,
            host_len,
            proxies.get(last_device) or self._node(last_device),
            proxies.get(last) or self._node(last),
            device_len + host_len,
        )

    def match_key(self, key: bytes, namespace: str | None = None) -> MatchResult:
        """:meth:`match_prefix` for a key already made by :func:`hicache.tree.token_key`."""
        if type(key) is not bytes:
            key = check_key(key, 4 * self.page_size)
        if self.components:
            return self._match_components(key, namespace)
        device_len, host_len, last_device, last = self._impl.match(key, namespace)
        node = self._node
        return MatchResult(device_len, host_len, node(last_device), node(last),
                           device_len + host_len)

    def insert(
        self, tokens: TokenLike, device_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """Cache ``tokens`` whose KV sits in ``device_indices``; see :meth:`RadixTree.insert`.

        The tree keeps a copy of ``device_indices`` (it owns what it stores), as the
        Python tree does.
        """
        if self.components:
            return self._insert_components(tokens, device_indices, namespace, components, host=False)
        if components:
            self._check_component_pages(components)
        arg = tokens if readable_in_place(tokens) else token_key(tokens, self.page_size)
        num_cached, last = self._impl.insert(arg, device_indices, namespace)
        return InsertResult(num_cached, self._proxies.get(last) or self._node(last))

    def insert_key(
        self, key: bytes, device_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """:meth:`insert` for a key already made by :func:`hicache.tree.token_key`."""
        if self.components:
            return self._insert_components(key, device_indices, namespace, components, host=False)
        if components:
            self._check_component_pages(components)
        if type(key) is not bytes:
            key = check_key(key, 4 * self.page_size)
        num_cached, last = self._impl.insert(key, device_indices, namespace)
        return InsertResult(num_cached, self._node(last))

    def insert_host(
        self, tokens: TokenLike, host_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """Cache ``tokens`` whose KV sits only in host pages; see :meth:`RadixTree.insert_host`."""
        if self.components:
            return self._insert_components(tokens, host_indices, namespace, components, host=True)
        if components:
            self._check_component_pages(components)
        num_cached, last = self._impl.insert_host(self._tokens(tokens), host_indices, namespace)
        return InsertResult(num_cached, self._node(last))

    def probe_key(self, key: bytes, namespace: str | None = None) -> int:
        """Tokens of ``key`` cached in any tier; read-only (no split, no hit, no access)."""
        return self._impl.probe(_probe_key_bytes(key, namespace, self.page_size), namespace)

    def probe_path(self, key: bytes, namespace: str | None = None) -> list[NativeNode]:
        """The nodes holding the cached prefix of ``key``; see :meth:`RadixTree.probe_path`."""
        key = _probe_key_bytes(key, namespace, self.page_size)
        proxy = self._node
        return [proxy(h) for h in self._impl.probe_path(key, namespace)]

    # ---------------------------------------------------------------- locks
    def lock(self, node: NativeNode) -> None:
        """Protect ``node`` and its ancestors from device eviction (one reference each)."""
        self._impl.lock(
            node._h
            if type(node) is NativeNode and node._tree is self
            else self._handle(node, "lock")
        )

    def unlock(self, node: NativeNode) -> None:
        """Drop one reference taken by :meth:`lock` on ``node``'s path."""
        self._impl.unlock(
            node._h
            if type(node) is NativeNode and node._tree is self
            else self._handle(node, "unlock")
        )

    def host_lock(self, node: NativeNode) -> None:
        """Protect the host copy of ``node`` (a load or a third-tier write reads it)."""
        self._impl.host_lock(self._handle(node, "host_lock"))

    def host_unlock(self, node: NativeNode) -> None:
        self._impl.host_unlock(self._handle(node, "host_unlock"))

    def raise_priority(self, node: NativeNode, priority: int) -> None:
        """Raise ``node``'s and its ancestors' priority; see :meth:`RadixTree.raise_priority`."""
        priority = check_priority(priority)
        self._impl.raise_priority(self._handle(node, "raise_priority"), priority)

    # ------------------------------------------------------ tier membership
    def set_io_status(self, node: NativeNode, status: IOStatus) -> None:
        if not isinstance(status, IOStatus):
            raise TypeError(f"set_io_status: expected an IOStatus, got {type(status).__name__}")
        self._impl.set_io_status(self._handle(node, "set_io_status"), status.value)

    def attach_device(self, node: NativeNode, device_indices: torch.Tensor) -> None:
        """Give a host-only node device pages (a load target, or adopted on insert)."""
        self._impl.attach_device(self._handle(node, "attach_device"), device_indices)

    def detach_device(self, node: NativeNode) -> torch.Tensor:
        """Drop the device copy of an unlocked node that has a host copy; return its pages."""
        return self._impl.detach_device(self._handle(node, "detach_device"))

    def attach_host(self, node: NativeNode, host_indices: torch.Tensor) -> None:
        """Record the host copy of a device node (a backup target)."""
        self._impl.attach_host(self._handle(node, "attach_host"), host_indices)

    def detach_host(self, node: NativeNode) -> torch.Tensor:
        """Drop the host copy of a node that stays on the device; return its host pages."""
        return self._impl.detach_host(self._handle(node, "detach_host"))

    # ------------------------------------------------------------ KV events
    def enable_events(self) -> None:
        """Start logging pages entering or leaving a tier; see :meth:`RadixTree.take_events`."""
        self._impl.enable_events()

    def take_events(self) -> list[TreeEvent]:
        """Drain the event log; see :meth:`RadixTree.take_events`."""
        return self._impl.take_events()

    def node_hashes(self, node: NativeNode) -> tuple[int | None, list[int]]:
        """``(parent_hash, page hashes)`` of ``node``'s pages; see :meth:`RadixTree.node_hashes`."""
        return self._impl.node_hashes(self._handle(node, "node_hashes"))

    # ------------------------------------------------------------- eviction
    def evict_device(
        self, num_tokens: int, backup: Callable[[NativeNode], bool] | None = None
    ) -> EvictResult:
        """Give up device pages of at least ``num_tokens`` tokens; see :meth:`RadixTree.evict_device`."""
        num = min(check_int("num_tokens", num_tokens), _MAX_COUNT)
        if backup is None:
            return EvictResult(*self._impl.evict_device(num, None))
        node = self._node
        return EvictResult(*self._impl.evict_device(num, lambda h: backup(node(h))))

    def evict_host(self, num_tokens: int, drop_device_resident: bool = True) -> EvictResult:
        """Give up host pages of at least ``num_tokens`` tokens; see :meth:`RadixTree.evict_host`."""
        num = min(check_int("num_tokens", num_tokens), _MAX_COUNT)
        return EvictResult(*self._impl.evict_host(num, bool(drop_device_resident)))

    # -------------------------------------------------------------- queries
    def device_indices_of(
        self, node: NativeNode, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Device page ids of the path from the root to ``node``, then ``extra``.

        The binding checks ``extra`` as :meth:`RadixTree.device_indices_of` does.
        """
        return self._impl.device_indices_of(
            node._h
            if type(node) is NativeNode and node._tree is self
            else self._handle(node, "device_indices_of"),
            extra,
        )

    def path_missing_host(self, node: NativeNode, min_hit_count: int = 0) -> list[NativeNode]:
        """Nodes on ``node``'s path a backup would copy; see :meth:`RadixTree.path_missing_host`."""
        min_hit_count = min(check_int("min_hit_count", min_hit_count), _MAX_COUNT)
        proxy = self._node
        handles = self._impl.path_missing_host(self._handle(node, "path_missing_host"), min_hit_count)
        return [proxy(h) for h in handles]

    def host_only_path(self, result: MatchResult) -> list[NativeNode]:
        """The host-only nodes of a match, root side first."""
        last = self._handle(result.last_node, "host_only_path")
        last_device = self._handle(result.last_device_node, "host_only_path")
        node = self._node
        return [node(h) for h in self._impl.host_only_path(last, last_device)]

    def path_to(self, node: NativeNode) -> list[NativeNode]:
        """Non-root nodes from the root down to ``node``."""
        proxy = self._node
        return [proxy(h) for h in self._impl.path_to(self._handle(node, "path_to"))]

    def memory_bytes(self) -> int:
        """Bytes held by the C++ tree: nodes, maps, heaps, token and index storage.

        Each storage is counted once however many nodes share it. Proxy objects
        (Python) are not included.
        """
        return self._impl.memory_bytes()

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Verify every invariant; raise ``AssertionError`` naming the first violation."""
        problem = self._impl.check_integrity()
        if problem:
            raise AssertionError(problem)
