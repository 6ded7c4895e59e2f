"""Match, probe, insert and split: the radix tree's own algorithm.

Keys are whole pages of int32 token ids (:func:`hicache.tree.token_key`); an
edge compare is one ``bytes.startswith``. A child is found by its first page,
so at most one child can continue a key. Where a key ends inside a node,
:meth:`PrefixIndex._split` cuts the node at a page boundary (its page ids are
sliced, no KV moves): the new prefix node becomes the parent of the original,
which keeps its children, heap entries and identity. ``on_split(prefix,
suffix)`` runs then (its rules: :mod:`hicache.tree.python`).

* ``match_prefix``/``match_key``: the longest cached prefix, as device tokens
  then host-only tokens; counts a hit and refreshes the access time of every
  matched node; may split; takes no lock.
* ``probe_key``/``probe_path``: the same length read-only (no split, no hit).
* ``insert``/``insert_key``: cache device pages for a key; host-only nodes on
  the path adopt the given pages, the rest becomes a new leaf.
* ``insert_host``: cache host pages (fetched from a third tier) as a new leaf.

Each keeps the eviction candidates current (only the last nodes of a path can
become candidates) and logs KV events for what it adds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.checks import check_page_count
from hicache.tree.guards import check_key
from hicache.tree.python.node import TreeNode, copy_pages, own_pages
from hicache.tree.python.tiers import TierMembership
from hicache.tree.types import InsertResult, MatchResult, TokenLike, token_key


class PrefixIndex(TierMembership):
    """Finds, adds and splits token runs; the lookups a cache makes per request."""

    def match_prefix(self, tokens: TokenLike, namespace: str | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages only).

        Splits a node when the match ends inside it (index slicing, no KV copy),
        so ``last_node`` ends exactly at the matched length. Counts a hit and
        refreshes the access time of every matched node. Takes no locks.
        """
        return self.match_key(token_key(tokens, self.page_size), namespace)

    def match_key(self, key: bytes, namespace: str | None = None) -> MatchResult:
        """:meth:`match_prefix` for a key already made by :func:`token_key`."""
        if type(key) is not bytes or len(key) % self._key_nbytes_per_page:
            key = check_key(key, self._key_nbytes_per_page)
        if self._hook is not None:
            self._refuse_reentry("match")
        node = self.root(namespace)
        self._clock += 1
        clock = self._clock
        off, n = 0, len(key)
        device_len = host_len = 0
        last_device = node
        try:
            while off < n:
                child = self._descend(node, key, off)
                if child is None:
                    break
                if node.host_indices is not None and not node._host_children:
                    self._refresh_inner_host(node)
                node = child
                ck = node.key
                off += len(ck)
                node.hit_count += 1
                node.last_access = clock
                if node.device_indices is not None:
                    device_len += len(ck)
                    last_device = node
                else:
                    host_len += len(ck)
        except BaseException:
            # An on_split hook raised: the nodes touched so far get their heap
            # entries (as below), so the tree stays consistent.
            self._refresh(last_device)
            if node is not last_device:
                self._refresh(node)
            raise
        # Besides the inner host candidates refreshed above, only these two can be
        # candidates: every other matched node has a device child on the path and
        # a host child (or no host copy). last_device is inner only above a
        # host-only child, which holds its host copy back.
        self._refresh(last_device)
        if node is not last_device:
            self._refresh(node)
        return MatchResult(
            device_len >> 2, host_len >> 2, last_device, node, (device_len + host_len) >> 2
        )

    def _descend(self, node: TreeNode, key: bytes, off: int) -> TreeNode | None:
        """The child of ``node`` that ``key[off:]`` enters, split to end inside the key."""
        child = node.children.get(key[off : off + self._key_nbytes_per_page])
        if child is not None and not key.startswith(child.key, off):
            child = self._split(child, self._common_pages(child.key, key, off))
        return child

    def probe_key(self, key: bytes, namespace: str | None = None) -> int:
        """Tokens of ``key`` cached in any tier, like :meth:`match_key` but read-only.

        No split, no hit counted, no access time changed.
        """
        return self._probe(check_key(key, self._key_nbytes_per_page), namespace, None)

    def probe_path(self, key: bytes, namespace: str | None = None) -> list[TreeNode]:
        """The nodes holding the cached prefix of ``key`` (:meth:`probe_key`), root side first.

        Read-only like :meth:`probe_key`; the last node may hold more than ``key``.
        """
        key = check_key(key, self._key_nbytes_per_page)
        nodes: list[TreeNode] = []
        self._probe(key, namespace, nodes)
        return nodes

    def probe_hit_key(self, key: bytes, namespace: str | None = None) -> int:
        """Tokens of ``key`` a match would serve (``device_len + host_len``), read-only.

        Without components every cached prefix is a hit: :meth:`probe_key`.
        """
        return self._probe(check_key(key, self._key_nbytes_per_page), namespace, None)

    def _check_component_pages(
        self, components: Sequence[torch.Tensor | None], num_pages: int
    ) -> None:
        """Refuse ``components`` unless it gives each component's ids along a key."""
        if len(components) != len(self.components):
            raise ValueError(
                f"components: expected one entry per component of the tree "
                f"({len(self.components)}), got {len(components)}"
            )

    def _probe(self, key: bytes, namespace: str | None, path: list[TreeNode] | None) -> int:
        node = self._roots.get(namespace)
        pnb = self._key_nbytes_per_page
        off, n = 0, len(key)
        while node is not None and off < n:
            child = node.children.get(key[off : off + pnb])
            if child is None:
                break
            if path is not None:
                path.append(child)
            ck = child.key
            if not key.startswith(ck, off):
                return (off + self._common_pages(ck, key, off) * pnb) >> 2
            off += len(ck)
            node = child
        return off >> 2

    def _common_pages(self, ck: bytes, key: bytes, off: int) -> int:
        """Whole pages shared by ``ck`` and ``key[off:]``; at least one, fewer than all of ck."""
        pnb = self._key_nbytes_per_page
        lo, hi = 1, min(len(ck), len(key) - off) // pnb
        while lo < hi:  # largest m with ck[:m pages] == key[off: off + m pages]
            mid = (lo + hi + 1) // 2
            if key.startswith(ck[: mid * pnb], off):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Split ``node`` after ``num_pages`` pages; return the new prefix node (its parent)."""
        assert 0 < num_pages < len(node.key) // self._key_nbytes_per_page, "split point outside the node"
        cut = num_pages * self._key_nbytes_per_page
        parent = node.parent
        assert parent is not None, "split of a root"
        prefix = TreeNode(self._next_id, node.key[:cut], parent, node.namespace)
        self._next_id += 1
        self.num_nodes += 1
        parent.children[node.key[: self._key_nbytes_per_page]] = prefix
        node.key = node.key[cut:]
        node.parent = prefix
        prefix.children[node.key[: self._key_nbytes_per_page]] = node
        if node.device_indices is not None:
            prefix.device_indices = own_pages(node.device_indices[:num_pages])
            node.device_indices = own_pages(node.device_indices[num_pages:])
        if node.host_indices is not None:
            prefix.host_indices = own_pages(node.host_indices[:num_pages])
            node.host_indices = own_pages(node.host_indices[num_pages:])
        prefix.lock_ref = node.lock_ref
        prefix.host_lock_ref = node.host_lock_ref
        prefix.io_status = node.io_status
        prefix.hit_count = node.hit_count
        prefix.last_access = node.last_access
        prefix.created = node.created
        prefix.priority = node.priority
        # The prefix's only child is ``node``, whose host state and busyness the
        # prefix shares: the parent's counters and host_takeable_tokens do not change.
        if node.host_indices is not None:
            prefix._host_children = 1
            prefix._busy_children = int(self._host_busy(node))
        if self._has_components:
            self._split_components(prefix, node, num_pages)
        on_split = self.on_split
        if on_split is not None:
            outer, self._hook = self._hook, "on_split"
            try:
                on_split(prefix, node)
            finally:
                self._hook = outer
        return prefix

    # ----------------------------------------------------------------- insert
    def insert(
        self, tokens: TokenLike, device_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """Cache ``tokens`` (whole pages) whose KV sits in ``device_indices`` (one id per page).

        Pages of the first ``num_cached_tokens`` tokens were already on the device
        and are not taken: the caller frees the ones it allocated itself. Host-only
        nodes on the path adopt the given pages (they are on the device again).
        ``components``: per component, its page ids along the key (docs/design.md,
        "Hybrid models: components"); those not taken are ``unused_pages``.
        """
        return self.insert_key(
            token_key(tokens, self.page_size), device_indices, namespace, components=components
        )

    def insert_key(
        self, key: bytes, device_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """:meth:`insert` for a key already made by :func:`token_key`."""
        key = check_key(key, self._key_nbytes_per_page)
        check_page_count("device_indices", device_indices, len(key) // self._key_nbytes_per_page)
        if components:
            self._check_component_pages(components, len(key) // self._key_nbytes_per_page)
        if self._hook is not None:
            self._refuse_reentry("insert")
        return self._insert_key(key, device_indices, namespace)

    def _insert_key(
        self, key: bytes, device_indices: torch.Tensor, namespace: str | None
    ) -> InsertResult:
        node = self.root(namespace)
        self._clock += 1
        clock = self._clock
        pnb = self._key_nbytes_per_page
        off, n = 0, len(key)
        num_cached = 0
        try:
            while off < n:
                child = self._descend(node, key, off)
                if child is None:
                    break
                if node.host_indices is not None and not node._host_children:
                    self._refresh_inner_host(node)
                node = child
                ck = node.key
                node.last_access = clock
                if node.device_indices is None:  # host-only: adopt the caller's pages
                    p = off // pnb
                    self.attach_device(node, device_indices[p : p + len(ck) // pnb])
                elif num_cached == off:
                    num_cached += len(ck)
                off += len(ck)
        except BaseException:
            self._refresh(node)  # an on_split hook raised (see match_key)
            raise
        if off < n:
            if node.host_indices is not None and not node._host_children:
                self._refresh_inner_host(node)  # touched above: now above a device-only leaf
            node = self._new_node(key[off:], node)
            node.device_indices = copy_pages(device_indices[off // pnb :])
            node.last_access = clock
            self.device_evictable_tokens += node.num_tokens
            if self._events is not None:
                self._log(True, "device", node)
        self._refresh(node)  # the only node on the path that can be a candidate
        self._maybe_compact()
        return InsertResult(num_cached >> 2, node)

    def insert_host(
        self, tokens: TokenLike, host_indices: torch.Tensor, namespace: str | None = None,
        *, components: Sequence[torch.Tensor | None] = (),
    ) -> InsertResult:
        """Cache ``tokens`` whose KV sits only in host pages (e.g. fetched from a third tier).

        Pages of the first ``num_cached_tokens`` tokens were already cached (in either
        tier) and are not taken: the caller frees them. The rest become a host-only leaf.
        ``components`` as for :meth:`insert`, in the host tier.
        """
        key = token_key(tokens, self.page_size)
        num_pages = len(key) // self._key_nbytes_per_page
        check_page_count("host_indices", host_indices, num_pages)
        if components:
            self._check_component_pages(components, num_pages)
        if self._hook is not None:
            self._refuse_reentry("insert_host")
        node = last_device = self.root(namespace)
        self._clock += 1
        clock = self._clock  # read once, as in match_key (and the native tree)
        pnb = self._key_nbytes_per_page
        off, n = 0, len(key)
        try:
            while off < n:
                child = self._descend(node, key, off)
                if child is None:
                    break
                if node.host_indices is not None and not node._host_children:
                    self._refresh_inner_host(node)
                node = child
                ck = node.key
                node.last_access = clock
                if node.device_indices is not None:
                    last_device = node
                off += len(ck)
        except BaseException:
            self._refresh(last_device)  # an on_split hook raised (see match_key)
            if node is not last_device:
                self._refresh(node)
            raise
        num_cached = off
        if off < n:
            node = self._new_node(key[off:], node)
            node.host_indices = copy_pages(host_indices[off // pnb :])
            node.last_access = clock
            self.host_evictable_tokens += node.num_tokens
            self._host_changed(node, False, False)
            if self._events is not None:
                self._log(True, "host", node)
        # As in match: only the deepest device node and the last node can be candidates.
        self._refresh(last_device)
        if node is not last_device:
            self._refresh(node)
        self._maybe_compact()
        return InsertResult(num_cached >> 2, node)

    def _new_node(self, key: bytes, parent: TreeNode) -> TreeNode:
        node = TreeNode(self._next_id, key, parent, parent.namespace)
        node.created = self._clock
        self._next_id += 1
        self.num_nodes += 1
        parent.children[key[: self._key_nbytes_per_page]] = node
        return node
