"""What the Python radix tree holds, and the guards every operation starts with.

:class:`TreeState` owns the fields all the other parts share: one root per
namespace, the size counters, the clock that orders accesses, the two eviction
heaps, the KV-event log and the name of the hook running now. It offers:

* :meth:`TreeState.root`: the root of a namespace, made on first use, and freed
  (:meth:`TreeState._free_if_empty`) once it holds no node and no lock: when its
  last child is removed, when the last lock taken on the root itself goes, and
  by :meth:`TreeState.prune_namespaces` (a reset). The default namespace's root
  (``None``) stays;
* :meth:`TreeState.nodes`: every non-root node, parents before children;
* the two guards: :meth:`TreeState._check_live` (a call names a node of this
  tree that is still in it) and :meth:`TreeState._refuse_reentry` (a hook may
  not call what would change the tree under it).

The counters are kept by the parts that change nodes; what they must equal is
checked by :mod:`hicache.tree.python.integrity`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from hicache.checks import check_namespace
from hicache.components import ComponentSpec
from hicache.config import EvictionPolicy
from hicache.tree.guards import check_component, check_page_size, check_tier, reentry_message
from hicache.tree.policies import CandidateHeap, priority_fn
from hicache.tree.python.node import EMPTY_PAGES, TreeNode
from hicache.tree.types import Tier, TreeEvent


class TreeState:
    """The fields of :class:`hicache.tree.RadixTree` and the checks on its arguments."""

    # A tree with components (HybridRadixTree) sets it: the few places where every tree
    # divides or drops a node's data call its component hooks only then.
    _has_components = False

    def __init__(
        self,
        page_size: int,
        eviction: EvictionPolicy | str = EvictionPolicy.LRU,
        on_split: Callable[[TreeNode, TreeNode], None] | None = None,
    ) -> None:
        self.page_size = check_page_size(page_size)
        self._key_nbytes_per_page = 4 * page_size  # key bytes of one page (int32 tokens)
        self.on_split = on_split  # called as on_split(prefix, suffix) by every split
        self._roots: dict[str | None, TreeNode] = {}
        self._next_id = 1
        self._clock = 0
        self.num_nodes = 0  # non-root nodes
        self.device_evictable_tokens = 0  # on device, lock_ref == 0
        self.device_protected_tokens = 0  # on device, lock_ref > 0
        self.host_evictable_tokens = 0  # on host, host_lock_ref == 0
        self.host_protected_tokens = 0  # on host, host_lock_ref > 0
        # On host and not busy (see TreeNode._busy_children): exactly the host tokens
        # evict_host can take, leaf by leaf, once nothing changes meanwhile.
        self.host_takeable_tokens = 0
        self.eviction = EvictionPolicy(eviction)
        prio = priority_fn(self.eviction)
        self._device_heap = CandidateHeap(prio, "_dev_seq")
        self._host_heap = CandidateHeap(prio, "_host_seq")
        # KV event log (hicache/events.py), None while off: raw entries
        # (stored, tier, namespace, parent hash, page hashes, num_tokens).
        self._events: list[TreeEvent] | None = None
        self._hook: str | None = None  # the hook running now: "on_split", "backup" or None
        # Hybrid models (docs/design.md, "Hybrid models: components"): none in this tree.
        self.components: tuple[ComponentSpec, ...] = ()
        self.device_component_evictable_pages = 0  # component ids on unlocked device nodes
        self.host_component_takeable_pages = 0  # component ids evict_host can take now

    def root(self, namespace: str | None = None) -> TreeNode:
        """The root of a namespace (created on first use). Roots hold no tokens."""
        try:
            root = self._roots.get(namespace)
        except TypeError:  # unhashable: say what a namespace must be
            check_namespace(namespace)
            raise
        if root is None:
            check_namespace(namespace)
            if namespace is not None:
                try:
                    namespace.encode()
                except UnicodeEncodeError:
                    raise ValueError(
                        f"namespace: expected a str encodable as UTF-8, got {namespace!r}"
                    ) from None
            root = TreeNode(0, b"", None, namespace)
            root.device_indices = EMPTY_PAGES
            root.host_indices = EMPTY_PAGES
            # Roots are never evicted; a lock taken on the root itself (a request that
            # matched nothing) counts on top, and holds the namespace's root.
            root.lock_ref = 1
            self._roots[namespace] = root
        return root

    def namespaces(self) -> list[str | None]:
        """The namespaces that have a root now, oldest root first (nodes() order)."""
        return list(self._roots)

    def prune_namespaces(self) -> int:
        """Free the root of every namespace that holds no node and no lock; how many.

        (The default namespace's root stays.) A namespace's root is also freed as soon
        as it loses its last child or its last lock; this frees the roots that lookups
        made and nothing filled (a reset calls it).
        """
        self._refuse_reentry("prune_namespaces")
        empty = [r for ns, r in self._roots.items()
                 if ns is not None and not r.children and r.lock_ref == 1]
        for root in empty:
            self._free_if_empty(root)
        return len(empty)

    def _free_if_empty(self, root: TreeNode) -> None:
        """Free ``root`` (its namespace's state) if it holds no node and no lock."""
        ns = root.namespace
        if ns is not None and not root.children and root.lock_ref == 1 and (
                self._roots.get(ns) is root):
            del self._roots[ns]
            root.lock_ref = 0  # a freed root: stale from now on (_check_live)

    def num_component_pages(self, c: int, tier: Tier) -> int:
        """Page ids component ``c`` holds in ``tier``."""
        check_tier(tier, "num_component_pages")
        check_component(c, len(self.components), "num_component_pages")
        return 0

    @property
    def device_tokens(self) -> int:
        return self.device_evictable_tokens + self.device_protected_tokens

    @property
    def host_tokens(self) -> int:
        return self.host_evictable_tokens + self.host_protected_tokens

    def nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split_components(self, prefix: TreeNode, suffix: TreeNode, num_pages: int) -> None:
        """Divide the component data of a node split after ``num_pages`` (hybrid trees)."""

    def _drop_components(self, node: TreeNode, tier: str) -> torch.Tensor | None:
        """Give up ``node``'s component data in ``tier`` with its full copy (hybrid trees)."""
        return None

    def _refuse_reentry(self, op: str, backup_may: bool = False) -> None:
        """Raise RuntimeError if a hook runs that may not call ``op`` (hicache.tree.python)."""
        hook = self._hook
        if hook is not None and not (backup_may and hook == "backup"):
            raise RuntimeError(reentry_message(op, hook))

    def _check_live(self, node: TreeNode, op: str) -> None:
        """Raise unless ``node`` is a node (or root) of this tree that is still in it."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"{op}: expected a TreeNode, got {type(node).__name__}")
        if node.parent is None:
            if node.id != 0 or node.lock_ref == 0:  # removed, or a freed root (native words)
                raise ValueError(f"{op}: node {node.id} is no longer in the tree (stale)")
            if self._roots.get(node.namespace) is not node:
                raise ValueError(f"{op}: node {node.id} is not a root of this tree")
        elif node.parent.children.get(node.key[: self._key_nbytes_per_page]) is not node:
            raise ValueError(f"{op}: node {node.id} is no longer in the tree (stale)")
