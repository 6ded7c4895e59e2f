"""The read-only view of one node of the native (C++) radix tree.

Nodes cross the binding as integer handles; :class:`NativeNode` wraps one and
reads every attribute from C++. :class:`hicache.tree.native.NativeRadixTree`
makes exactly one proxy per handle, so callers compare nodes with ``is`` and key
dicts by them. It knows nothing of tree operations (the tree does them).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from hicache.components import ComponentSpec
from hicache.native.binding import TreeBinding
from hicache.tree.guards import check_component, check_tier
from hicache.tree.types import IOStatus, Tier


class NodeOwner(Protocol):
    """What a proxy reads through: its tree's binding, and the tree's one proxy per handle.

    :class:`hicache.tree.native.NativeRadixTree` is one; naming it here instead
    keeps this module below the tree (which makes the proxies).
    """

    @property
    def _impl(self) -> TreeBinding: ...

    @property
    def components(self) -> tuple[ComponentSpec, ...]: ...

    def _node(self, handle: int) -> NativeNode: ...


class NativeNode:
    """Read-only view of one native node, with the attributes of :class:`hicache.tree.TreeNode`.

    Every attribute reads the node in C++. A node removed from the tree
    (evicted, merged into its parent) keeps its last state and ``parent`` None,
    like a removed Python node, while this proxy is referenced.
    """

    __slots__ = ("_tree", "_h", "__weakref__")

    def __init__(self, tree: NodeOwner, handle: int) -> None:
        self._tree = tree
        self._h = handle

    @property
    def id(self) -> int:
        return self._tree._impl.node_id(self._h)

    @property
    def parent(self) -> NativeNode | None:
        h = self._tree._impl.parent(self._h)
        return None if h == 0 else self._tree._node(h)

    @property
    def children(self) -> dict[bytes, NativeNode]:
        """Children keyed by the int32 bytes of their first page, in insertion order."""
        node = self._tree._node
        return {k: node(h) for k, h in self._tree._impl.children(self._h)}

    @property
    def namespace(self) -> str | None:
        return self._tree._impl.namespace(self._h)

    @property
    def key(self) -> bytes:
        return self._tree._impl.key(self._h)

    @property
    def device_indices(self) -> torch.Tensor | None:
        return self._tree._impl.device_indices(self._h)

    @property
    def host_indices(self) -> torch.Tensor | None:
        return self._tree._impl.host_indices(self._h)

    @property
    def lock_ref(self) -> int:
        return self._tree._impl.lock_ref(self._h)

    @property
    def host_lock_ref(self) -> int:
        return self._tree._impl.host_lock_ref(self._h)

    @property
    def io_status(self) -> IOStatus:
        return IOStatus(self._tree._impl.io_status(self._h))

    @property
    def hit_count(self) -> int:
        return self._tree._impl.hit_count(self._h)

    @property
    def last_access(self) -> int:
        return self._tree._impl.last_access(self._h)

    @property
    def created(self) -> int:
        return self._tree._impl.created(self._h)

    @property
    def priority(self) -> int:
        return self._tree._impl.priority(self._h)

    @property
    def num_tokens(self) -> int:
        return self._tree._impl.num_tokens(self._h)

    @property
    def on_device(self) -> bool:
        return self._tree._impl.on_device(self._h)

    @property
    def on_host(self) -> bool:
        return self._tree._impl.on_host(self._h)

    def num_pages(self, page_size: int) -> int:
        return self._tree._impl.num_tokens(self._h) // page_size

    def tokens(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.key, dtype=np.int32)

    def component_pages(self, c: int, tier: Tier) -> torch.Tensor | None:
        """Component ``c``'s page ids in ``tier``; see :meth:`hicache.tree.TreeNode.component_pages`."""
        check_tier(tier, "component_pages")
        check_component(c, len(self._tree.components), "component_pages")
        return self._tree._impl.component_pages(self._h, c, tier == "host")

    def __repr__(self) -> str:
        try:
            return self._tree._impl.repr(self._h)
        except ValueError:
            return f"NativeNode(handle={self._h}, freed)"
