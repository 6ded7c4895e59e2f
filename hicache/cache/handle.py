"""PrefixHandle: one request's view of a :class:`hicache.HiCache` (see its lifecycle).

A handle holds the request's locked prefix (the node ending it), the pages it
owns until they are inserted, and the loads it waits on. HiCache creates and
updates handles; callers read them and wait on them. :class:`InFlightIO`, one
transfer and the requests waiting on it, lives here too: a handle and its loads
refer to each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hicache.cache.request_components import RequestComponents, StatePages
from hicache.checks import check_int
from hicache.errors import LoadError  # defined with the others; raised from here

if TYPE_CHECKING:  # annotations only
    from hicache.transfer.base import Transfer
    from hicache.tree import TreeNode
    from hicache.tree.protocol import RadixTreeLike


class InFlightIO:
    """One transfer in flight and the tree nodes / requests that depend on it.

    Tracked by :class:`hicache.cache.inflight.InFlightTable`; here because a
    :class:`PrefixHandle` lists the loads it waits on and each load its requests.
    """

    __slots__ = ("handle", "kind", "nodes", "requests", "evict", "nbytes", "parts")

    def __init__(self, handle: Transfer, kind: str, nodes: list[TreeNode], nbytes: int) -> None:
        self.handle = handle  # the transfer engine's handle
        self.kind = kind  # "load" | "backup"
        self.nodes = nodes  # grows when a node is split while in flight
        self.requests: list[PrefixHandle] = []  # requests that must wait for this load
        # write-back: the nodes (the evicted leaf, parts split off it) whose device
        # pages are freed once backed up; None for other backups
        self.evict: list[TreeNode] | None = None
        self.nbytes = nbytes  # KV bytes moved
        # hybrid models: nodes whose backup copies only these components (their host
        # copy predates it); None when every node's full pages are copied
        self.parts: dict[TreeNode, list[int]] | None = None


class PrefixHandle:
    """One request's view of the cache: its locked prefix and the pages it owns.

    Valid until :meth:`HiCache.release`. ``prefix_pages`` are valid device pages
    only while the handle is held, and only after :meth:`wait` (or per layer,
    :meth:`wait_layer`) returns when a load is involved.
    """

    def __init__(
        self, owner: object, tree: RadixTreeLike, num_layers: int, key: bytes,
        namespace: str | None, device_len: int, host_len: int, lock_node: Any,
    ) -> None:
        self._owner = owner  # the HiCache that made it (calls check it is theirs)
        self._tree = tree  # the owner's tree: the prefix's pages are read from it
        self._num_layers = num_layers
        self.namespace = namespace
        self.key = key  # int32 bytes of the matched prompt's whole pages
        self.device_len = device_len  # matched on the device at match time
        self.host_len = host_len  # matched only in host memory at match time
        # Hybrid models: tokens cached as full-attention pages at match time (MatchResult.
        # full_len); a state checkpoint there makes it a hit for the next request.
        self.full_len = device_len + host_len
        self.prefix_len = device_len  # tokens whose KV is (or is being loaded) on device
        self.load_error: BaseException | None = None
        # Locked; ends the prefix. A node of the owner's tree (TreeNode or NativeNode); a
        # native handle is given the node's int handle (see native_lifecycle.py).
        self._lock_node: Any = lock_node
        self._prefix_pages: torch.Tensor | None = None  # lazily gathered from the tree
        self._new_pages: list[torch.Tensor] = []  # allocated by alloc, owned until inserted
        self._loads: list[InFlightIO] = []
        # Failed loads not yet applied to this handle (applied by its own calls).
        self._failed_loads: list[tuple[InFlightIO, TreeNode]] = []
        self._failure_unreported = False  # applied, not yet reported by finish_loads
        self.released = False
        # Hybrid models: the request's window and state pages (None: a single-kind model)
        specs = tree.components
        self._components = RequestComponents(specs, tree.page_size) if specs else None

    @property
    def prefix_pages(self) -> torch.Tensor:
        if self.released:  # the tree may have evicted and reused them since
            raise ValueError("handle was already released: its pages are no longer valid")
        if self._prefix_pages is None:
            self._prefix_pages = self._tree.device_indices_of(self._lock_node)
        return self._prefix_pages

    @property
    def num_owned_pages(self) -> int:
        return sum(p.shape[0] for p in self._new_pages)

    def page_table(self) -> torch.Tensor:
        """Device pages of the whole sequence so far: the prefix, then the allocated pages."""
        new = self._new_pages
        if self._prefix_pages is None and len(new) == 1 and not self.released:
            return self._tree.device_indices_of(self._lock_node, new[0])  # one gather
        parts = [self.prefix_pages, *new]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def window_table(self, c: int) -> torch.Tensor:
        """Window component ``c``'s pages of the whole sequence so far, ``(num_pages, width)``.

        The prefix's part from the tree (``-1`` before the window the prefix's end
        reads: those positions are never read), then the request's own pages.
        """
        comps = self._hybrid("window_table", c)
        if c not in comps.windows:
            raise ValueError(f"window_table: component {c} is not a window component")
        if self.released:
            raise ValueError("handle was already released: its pages are no longer valid")
        width = comps.specs[c].width
        prefix = self._tree.component_table(self._lock_node, c, "device")
        return torch.cat((prefix, comps.window_pages(c))).view(-1, width)

    def state_pages(self, c: int) -> StatePages:
        """Where state component ``c``'s layers read and write this request's state.

        ``read`` is the checkpoint the prefix ends at, for the first forward (a matched
        prefix always ends at one; None for an empty prefix: the zero state, and
        after an insert, where the request goes on from its own state); later
        forwards read ``write``, the running state, which ``alloc`` allocates with the
        checkpoints (None before).
        """
        comps = self._hybrid("state_pages", c)
        if c not in comps.checkpoints:
            raise ValueError(f"state_pages: component {c} is not a state component")
        if self.released:
            raise ValueError("handle was already released: its pages are no longer valid")
        write = comps.states.get(c)
        read = None
        if self.prefix_len:
            width = comps.specs[c].width
            ids = self._tree.component_table(self._lock_node, c, "device")[-width:]
            read = ids if bool((ids >= 0).all()) else None
        return StatePages(read, write, dict(comps.checkpoints[c]))

    def _hybrid(self, op: str, c: object) -> RequestComponents:
        if self._components is None:
            raise ValueError(f"{op}: the cache's KV layout has no components")
        num = len(self._components.specs)
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < num:
            raise ValueError(f"{op}: expected a component index in [0, {num}), got {c!r}")
        return self._components

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` of every load this request depends on has landed."""
        num_layers = self._num_layers
        if check_int("layer", layer) >= num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {num_layers}, got {layer}")
        for rec in self._loads:
            landed = rec.handle.wait_layer(layer)
            if rec.handle.error is not None:
                raise LoadError(f"prefix load failed: {rec.handle.error}") from rec.handle.error
            if not landed:  # only the manual executor returns before the layer lands
                raise LoadError(f"layer {layer} of a prefix load has not landed yet")

    def wait(self) -> None:
        """Block until every load this request depends on is complete; raise LoadError if one failed."""
        for rec in self._loads:
            rec.handle.wait()
            if rec.handle.error is not None:
                raise LoadError(f"prefix load failed: {rec.handle.error}") from rec.handle.error

    def __repr__(self) -> str:
        return (
            f"PrefixHandle(prefix_len={self.prefix_len}, device_len={self.device_len}, "
            f"host_len={self.host_len}, owned_pages={self.num_owned_pages}, "
            f"released={self.released})"
        )
