"""Radix tree over page-aligned token ids, with device and host page indices per node.

What it knows: token runs, which device pages and host pages hold each run's
KV, locks, IO status, access order. What it does not know: KV tensors, streams,
allocators. It moves index tensors around and tells the caller which pages it
gave up; the caller (``HiCache``) frees them and runs the transfers.

Layout of one root-to-leaf path (device part first, then host-only part)::

    root ── A ── B ── C ── D
           |<-- on device -->|<- host only ->|
    match:  device_len = |A|+|B|,  host_len = |C|+|D|

Conventions:

* Keys are whole pages: a partial last page is never cached. Tokens are kept
  as the bytes of an int32 array, so an edge compare is one ``startswith``.
* ``device_indices`` / ``host_indices`` hold one page id per page (int64 CPU
  tensors), or ``None`` when the node has no copy in that tier.
* Invariants (checked by :meth:`RadixTree.check_integrity`): device-resident
  nodes form a connected subtree from the root; every non-root node has a copy
  somewhere; a locked node is on the device and its parent is locked at least
  as often; a node with IO in flight has both copies; size counters (and each
  node's counts of children with a host copy and of busy host children) equal
  the sums over nodes; no page id is held twice in a tier.
* Host eviction takes a host copy once no child has one: a parent on both tiers
  whose children are device-only is a candidate, and evicting a child's host
  copy makes its parent one. ``host_takeable_tokens`` is exactly what it can take.
* Namespaces (tenant, LoRA, cache salt) get separate roots: they never share nodes.
* The tree owns the page-id tensors it keeps: ``insert``, ``insert_host`` and the
  ``attach_*`` calls copy the caller's ids, so a caller reusing or re-pointing its
  tensor afterwards changes nothing in the tree.
* Hooks (``on_split``, the ``backup`` of :meth:`RadixTree.evict_device`) run in
  the middle of an operation. They may read the tree; ``backup`` may also call
  ``host_lock``, ``host_unlock``, ``attach_host``, ``set_io_status`` and
  ``evict_host`` (what a write-back backup needs). Any other tree-changing call
  from inside a hook raises ``RuntimeError`` before changing anything (the
  native tree refuses the same calls with the same words; docs/native.md). A
  hook that raises ends the operation with the tree consistent.
* Not thread-safe: one thread at a time (the native tree serialises threads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from hicache.checks import (
    check_int,
    check_namespace,
    check_page_count,
    check_page_tensor,
    check_priority,
)
from hicache.config import EvictionPolicy
from hicache.events import page_hashes
from hicache.tree.guards import check_key, check_page_size, reentry_message
from hicache.tree.policies import CandidateHeap, priority_fn
from hicache.tree.types import (
    EvictResult,
    InsertResult,
    IOStatus,
    MatchResult,
    TokenLike,
    token_key,
)

_EMPTY = torch.empty(0, dtype=torch.int64)
def _copy(indices: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of page ids the tree keeps (it owns what it stores)."""
    return indices.clone(memory_format=torch.contiguous_format)


class TreeNode:
    """One edge of the radix tree: a run of whole pages and where their KV lives."""

    __slots__ = (
        "id", "key", "parent", "children", "namespace", "device_indices", "host_indices",
        "lock_ref", "host_lock_ref", "io_status", "hit_count", "last_access", "created",
        "priority", "_dev_seq", "_host_seq", "_end_hash", "_host_children", "_busy_children",
    )

    def __init__(self, node_id: int, key: bytes, parent: TreeNode | None, namespace: str | None):
        self.id = node_id
        self.key = key  # token ids as int32 bytes, a whole number of pages
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}  # keyed by the first page of the child's run
        self.namespace = namespace
        self.device_indices: torch.Tensor | None = None  # one device page id per page
        self.host_indices: torch.Tensor | None = None  # one host page id per page
        self.lock_ref = 0  # running requests using the device pages of this node
        self.host_lock_ref = 0  # loads / third-tier writes reading the host pages
        self.io_status = IOStatus.NONE
        self.hit_count = 0  # times a match went through this node
        self.last_access = 0  # tree clock tick of the last match or insert touching it
        self.created = 0  # tree clock tick of the insert that created it (a split keeps it)
        self.priority = 0  # largest priority a match or insert gave it (raise_priority)
        self._dev_seq = 0  # seq of this node's newest device-heap entry
        self._host_seq = 0  # seq of this node's newest host-heap entry
        self._end_hash: int | None = None  # chained hash of its last page (events), lazily
        # Children with a host copy: a host copy is a host-eviction candidate only
        # without them (evicting it first would leave a host copy under a node without
        # one, against the invariant that host copies are closed under ancestors).
        self._host_children = 0
        # Children whose host copy is "busy": host-locked, IO in flight, or above a
        # busy host child. Host eviction can never take a busy host copy.
        self._busy_children = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2

    def num_pages(self, page_size: int) -> int:
        return (len(self.key) >> 2) // page_size

    @property
    def on_device(self) -> bool:
        return self.device_indices is not None

    @property
    def on_host(self) -> bool:
        return self.host_indices is not None

    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int32)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, device={self.on_device}, "
            f"host={self.on_host}, lock={self.lock_ref}, host_lock={self.host_lock_ref}, "
            f"io={self.io_status.name})"
        )


def _own(indices: torch.Tensor) -> torch.Tensor:
    """``indices``, or a copy when it is a view into storage more than twice its size.

    Callers hand the tree slices of larger tensors (a request's whole page table,
    one allocation split across nodes); keeping such a view would keep the whole
    storage alive for as long as the node lives. Bounded this way, the index
    storage the tree holds is at most twice the bytes of the page ids it caches.
    """
    if indices.untyped_storage().nbytes() > 2 * indices.nbytes:
        return indices.clone()
    return indices


class RadixTree:
    """Radix tree with device and host indices per node (see the module docstring).

    ``on_split(prefix, suffix)`` is called whenever a node is split: ``suffix``
    is the original node object (it keeps children, heap entries and identity),
    ``prefix`` the new parent holding the first part. Owners that track nodes
    with IO in flight use it to track the new node too.
    """

    def __init__(
        self,
        page_size: int,
        eviction: EvictionPolicy | str = EvictionPolicy.LRU,
        on_split: Callable[[TreeNode, TreeNode], None] | None = None,
    ) -> None:
        self.page_size = check_page_size(page_size)
        self._key_nbytes_per_page = 4 * page_size  # key bytes of one page (int32 tokens)
        self.on_split = on_split
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
        self._events: list[tuple] | None = None
        self._hook: str | None = None  # the hook running now: "on_split", "backup" or None

    # ----------------------------------------------------------------- basics
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
            root.device_indices = _EMPTY
            root.host_indices = _EMPTY
            root.lock_ref = 1  # roots are never evicted
            self._roots[namespace] = root
        return root

    @property
    def device_tokens(self) -> int:
        return self.device_evictable_tokens + self.device_protected_tokens

    @property
    def host_tokens(self) -> int:
        return self.host_evictable_tokens + self.host_protected_tokens

    def _refuse_reentry(self, op: str, backup_may: bool = False) -> None:
        """Raise RuntimeError if a hook runs that may not call ``op`` (module docstring)."""
        hook = self._hook
        if hook is not None and not (backup_may and hook == "backup"):
            raise RuntimeError(reentry_message(op, hook))

    def nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new_node(self, key: bytes, parent: TreeNode) -> TreeNode:
        node = TreeNode(self._next_id, key, parent, parent.namespace)
        node.created = self._clock
        self._next_id += 1
        self.num_nodes += 1
        parent.children[key[: self._key_nbytes_per_page]] = node
        return node

    # ------------------------------------------------------------ match/split
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
        return MatchResult(device_len >> 2, host_len >> 2, last_device, node)

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
        prefix = TreeNode(self._next_id, node.key[:cut], parent, node.namespace)
        self._next_id += 1
        self.num_nodes += 1
        parent.children[node.key[: self._key_nbytes_per_page]] = prefix
        node.key = node.key[cut:]
        node.parent = prefix
        prefix.children[node.key[: self._key_nbytes_per_page]] = node
        if node.device_indices is not None:
            prefix.device_indices = _own(node.device_indices[:num_pages])
            node.device_indices = _own(node.device_indices[num_pages:])
        if node.host_indices is not None:
            prefix.host_indices = _own(node.host_indices[:num_pages])
            node.host_indices = _own(node.host_indices[num_pages:])
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
        self, tokens: TokenLike, device_indices: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        """Cache ``tokens`` (whole pages) whose KV sits in ``device_indices`` (one id per page).

        Pages of the first ``num_cached_tokens`` tokens were already on the device
        and are not taken: the caller frees the ones it allocated itself. Host-only
        nodes on the path adopt the given pages (they are on the device again).
        """
        return self.insert_key(token_key(tokens, self.page_size), device_indices, namespace)

    def insert_key(
        self, key: bytes, device_indices: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        """:meth:`insert` for a key already made by :func:`token_key`."""
        key = check_key(key, self._key_nbytes_per_page)
        check_page_count("device_indices", device_indices, len(key) // self._key_nbytes_per_page)
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
            node.device_indices = _copy(device_indices[off // pnb :])
            node.last_access = clock
            self.device_evictable_tokens += node.num_tokens
            if self._events is not None:
                self._log(True, "device", node)
        self._refresh(node)  # the only node on the path that can be a candidate
        self._maybe_compact()
        return InsertResult(num_cached >> 2, node)

    def insert_host(
        self, tokens: TokenLike, host_indices: torch.Tensor, namespace: str | None = None
    ) -> InsertResult:
        """Cache ``tokens`` whose KV sits only in host pages (e.g. fetched from a third tier).

        Pages of the first ``num_cached_tokens`` tokens were already cached (in either
        tier) and are not taken: the caller frees them. The rest become a host-only leaf.
        """
        key = token_key(tokens, self.page_size)
        num_pages = len(key) // self._key_nbytes_per_page
        check_page_count("host_indices", host_indices, num_pages)
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
            node.host_indices = _copy(host_indices[off // pnb :])
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

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from device eviction (one reference each)."""
        self._check_live(node, "lock")
        if self._hook is not None:
            self._refuse_reentry("lock")
        if node.device_indices is None:
            raise ValueError(f"lock: expected a device-resident node, got {node}")
        while node.parent is not None:
            if node.lock_ref == 0:
                self.device_evictable_tokens -= node.num_tokens
                self.device_protected_tokens += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Drop one reference taken by :meth:`lock` on ``node``'s path."""
        self._check_live(node, "unlock")
        if self._hook is not None:
            self._refuse_reentry("unlock")
        walk = node
        while walk.parent is not None:
            if walk.lock_ref <= 0:
                raise ValueError(f"unlock: node {walk.id} on the path is not locked")
            walk = walk.parent
        deepest = node
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                num = len(node.key) >> 2
                self.device_protected_tokens -= num
                self.device_evictable_tokens += num
            node = node.parent
        # Ancestors have a device child on the path: only the deepest can be a candidate.
        self._refresh(deepest)

    def host_lock(self, node: TreeNode) -> None:
        """Protect the host copy of ``node`` (a load or a third-tier write reads it)."""
        self._check_live(node, "host_lock")
        self._refuse_reentry("host_lock", backup_may=True)
        if node.host_indices is None or node.parent is None:
            raise ValueError(f"host_lock: expected a non-root node with a host copy, got {node}")
        was_busy = self._host_busy(node)
        if node.host_lock_ref == 0:
            self.host_evictable_tokens -= node.num_tokens
            self.host_protected_tokens += node.num_tokens
        node.host_lock_ref += 1
        self._host_changed(node, True, was_busy)

    def host_unlock(self, node: TreeNode) -> None:
        self._check_live(node, "host_unlock")
        self._refuse_reentry("host_unlock", backup_may=True)
        if node.host_lock_ref <= 0:
            raise ValueError(f"host_unlock: node {node.id} is not host-locked")
        was_busy = self._host_busy(node)
        node.host_lock_ref -= 1
        if node.host_lock_ref == 0:
            self.host_protected_tokens -= node.num_tokens
            self.host_evictable_tokens += node.num_tokens
            self._host_changed(node, True, was_busy)
            self._refresh(node)

    def raise_priority(self, node: TreeNode, priority: int) -> None:
        """Raise the priority of ``node`` and its ancestors to at least ``priority``.

        A node's priority only grows: a prefix shared by requests of different
        priorities keeps the highest. It orders eviction only under the
        ``priority`` policy (lowest first, least recent among equals).
        """
        priority = check_priority(priority)
        self._check_live(node, "raise_priority")
        self._refuse_reentry("raise_priority")
        refresh = self.eviction is EvictionPolicy.PRIORITY
        while node.parent is not None:
            if node.priority < priority:
                node.priority = priority
                if refresh:  # its heap entry's key changed
                    self._refresh(node)
            node = node.parent

    def _check_live(self, node: TreeNode, op: str) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{op}: expected a TreeNode, got {type(node).__name__}")
        if node.parent is None:
            if node.id != 0:  # removed (the native tree's words)
                raise ValueError(f"{op}: node {node.id} is no longer in the tree (stale)")
            if self._roots.get(node.namespace) is not node:
                raise ValueError(f"{op}: node {node.id} is not a root of this tree")
        elif node.parent.children.get(node.key[: self._key_nbytes_per_page]) is not node:
            raise ValueError(f"{op}: node {node.id} is no longer in the tree (stale)")

    # ------------------------------------------------------- tier membership
    @staticmethod
    def _host_busy(node: TreeNode) -> bool:
        """True if host eviction can never take ``node``'s host copy as things stand."""
        return node.host_indices is not None and bool(
            node.host_lock_ref or node.io_status is not IOStatus.NONE or node._busy_children
        )

    def _host_changed(self, node: TreeNode, was_on_host: bool, was_busy: bool) -> None:
        """Account a change of ``node``'s host copy, host lock or IO status.

        ``was_on_host`` / ``was_busy``: its state before. Keeps the parent's
        ``_host_children``, the ancestors' ``_busy_children`` and
        ``host_takeable_tokens`` exact; a parent left without host children is
        refreshed (it may have become a host-eviction candidate).
        """
        now_on_host = node.host_indices is not None
        now_busy = self._host_busy(node)
        if was_on_host and not was_busy:
            self.host_takeable_tokens -= node.num_tokens
        if now_on_host and not now_busy:
            self.host_takeable_tokens += node.num_tokens
        parent = node.parent
        if parent is None or parent.parent is None:
            return
        if was_on_host != now_on_host:
            parent._host_children += 1 if now_on_host else -1
            if not parent._host_children:
                self._refresh(parent)
        while was_busy != now_busy and parent.parent is not None:
            # A parent without a host copy is never busy: the walk stops there.
            was_busy = self._host_busy(parent)
            parent._busy_children += 1 if now_busy else -1
            now_busy = self._host_busy(parent)
            if parent.host_indices is not None and was_busy != now_busy:
                self.host_takeable_tokens += -parent.num_tokens if now_busy else parent.num_tokens
            parent = parent.parent

    def set_io_status(self, node: TreeNode, status: IOStatus) -> None:
        if not isinstance(status, IOStatus):
            raise TypeError(f"set_io_status: expected an IOStatus, got {type(status).__name__}")
        self._check_live(node, "set_io_status")
        self._refuse_reentry("set_io_status", backup_may=True)
        if status is not IOStatus.NONE and (node.device_indices is None or node.host_indices is None):
            raise ValueError(f"set_io_status: IO in flight needs both copies, got {node}")
        was_busy = self._host_busy(node)
        node.io_status = status
        self._host_changed(node, node.host_indices is not None, was_busy)
        if status is IOStatus.NONE:
            self._refresh(node)

    def attach_device(self, node: TreeNode, device_indices: torch.Tensor) -> None:
        """Give a host-only node device pages (a load target, or adopted on insert)."""
        self._check_live(node, "attach_device")
        check_page_tensor("device_indices", device_indices)
        self._refuse_reentry("attach_device")
        if node.device_indices is not None or node.parent is None:
            raise ValueError(f"attach_device: expected a host-only node, got {node}")
        if node.parent.device_indices is None:
            raise ValueError("attach_device: the parent must be on the device first")
        num_pages = len(node.key) // self._key_nbytes_per_page
        if device_indices.shape[0] != num_pages:
            raise ValueError(
                f"attach_device: expected {num_pages} pages, got {device_indices.shape[0]}"
            )
        node.device_indices = _copy(device_indices)
        self.device_evictable_tokens += node.num_tokens
        if self._events is not None:
            self._log(True, "device", node)
        self._refresh(node)

    def detach_device(self, node: TreeNode) -> torch.Tensor:
        """Drop the device copy of an unlocked node that has a host copy; return its pages."""
        self._check_live(node, "detach_device")
        self._refuse_reentry("detach_device")
        if node.device_indices is None or node.host_indices is None or node.lock_ref:
            raise ValueError(f"detach_device: expected an unlocked node on both tiers, got {node}")
        if any(c.device_indices is not None for c in node.children.values()):
            raise ValueError("detach_device: a child is still on the device")
        if self._events is not None:
            self._log(False, "device", node)
        pages = node.device_indices
        node.device_indices = None
        was_busy = self._host_busy(node)
        node.io_status = IOStatus.NONE
        self._host_changed(node, True, was_busy)
        self.device_evictable_tokens -= node.num_tokens
        self._refresh(node)
        self._refresh(node.parent)
        return pages

    def attach_host(self, node: TreeNode, host_indices: torch.Tensor) -> None:
        """Record the host copy of a device node (a backup target)."""
        self._check_live(node, "attach_host")
        check_page_tensor("host_indices", host_indices)
        self._refuse_reentry("attach_host", backup_may=True)
        if node.device_indices is None or node.host_indices is not None or node.parent is None:
            raise ValueError(f"attach_host: expected a device-only node, got {node}")
        num_pages = len(node.key) // self._key_nbytes_per_page
        if host_indices.shape[0] != num_pages:
            raise ValueError(f"attach_host: expected {num_pages} pages, got {host_indices.shape[0]}")
        node.host_indices = _copy(host_indices)
        self.host_evictable_tokens += node.num_tokens
        self._host_changed(node, False, False)
        if self._events is not None:
            self._log(True, "host", node)
        self._refresh(node)

    def detach_host(self, node: TreeNode) -> torch.Tensor:
        """Drop the host copy of a node that stays on the device; return its host pages."""
        self._check_live(node, "detach_host")
        self._refuse_reentry("detach_host")
        if node.host_indices is None or node.device_indices is None or node.host_lock_ref:
            raise ValueError(f"detach_host: expected a node on both tiers, host-unlocked, got {node}")
        if self._events is not None:
            self._log(False, "host", node)
        was_busy = self._host_busy(node)
        pages = node.host_indices
        node.host_indices = None
        node.io_status = IOStatus.NONE
        self.host_evictable_tokens -= node.num_tokens
        self._host_changed(node, True, was_busy)
        self._refresh(node)
        return pages

    def _merge_host_chain(self, node: TreeNode) -> None:
        """Absorb ``node``'s only child when both are idle and host-only.

        Leaf-first eviction turns a chain (one node per turn of a conversation)
        into host-only nodes one by one; merging them keeps a reload of the chain
        one node instead of dozens. Nothing references an idle host-only node
        (no lock, no pin, no IO), so the absorbed child just goes stale.
        """
        if (
            node.device_indices is not None
            or node.host_lock_ref
            or node.io_status is not IOStatus.NONE
            or len(node.children) != 1
        ):
            return
        (child,) = node.children.values()
        if (
            child.device_indices is not None
            or child.host_lock_ref
            or child.io_status is not IOStatus.NONE
        ):
            return
        node.key += child.key
        node._end_hash = child._end_hash  # node now ends where child ended
        node.host_indices = torch.cat((node.host_indices, child.host_indices))
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        # Both idle and host-only: node was busy exactly when child was.
        node._host_children = child._host_children
        node._busy_children = child._busy_children
        node.hit_count = max(node.hit_count, child.hit_count)
        node.last_access = max(node.last_access, child.last_access)
        node.created = min(node.created, child.created)
        node.priority = max(node.priority, child.priority)
        child.parent = None
        child.children = {}
        self.num_nodes -= 1

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[node.key[: self._key_nbytes_per_page]]
        node.parent = None
        self.num_nodes -= 1
        self._refresh(parent)

    # ------------------------------------------------------------- KV events
    def enable_events(self) -> None:
        """Start logging every node's pages entering or leaving a tier (see take_events)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[tuple]:
        """Drain the log: ``(stored, tier, namespace, parent_hash, hashes, num_tokens)`` each.

        ``stored`` is True when the pages entered ``tier`` ("device" or "host"),
        False when they left it; ``hashes`` are their chained page hashes
        (:func:`hicache.events.page_hashes`), ``parent_hash`` the hash of the page
        before them (None at the root). Empty while logging is off.
        """
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def node_hashes(self, node: TreeNode) -> tuple[int | None, list[int]]:
        """``(parent_hash, page hashes)`` of ``node``'s pages (parent None at the root)."""
        self._check_live(node, "node_hashes")
        if node.parent is None:
            raise ValueError("node_hashes: expected a non-root node, got a root (it holds no pages)")
        return self._hashes(node)

    def _end_hash_of(self, node: TreeNode) -> int | None:
        """Chained hash of ``node``'s last page (None for a root); cached on the node.

        A node's end never moves (a split makes a new prefix node; a merge takes the
        child's end), so the cache needs no invalidation beyond those two.
        """
        if node.parent is None:
            return None
        if node._end_hash is None:
            node._end_hash = self._hashes(node)[1][-1]
        return node._end_hash

    def _hashes(self, node: TreeNode) -> tuple[int | None, list[int]]:
        chain = []
        walk = node.parent
        while walk.parent is not None and walk._end_hash is None:  # iterative: deep paths
            chain.append(walk)
            walk = walk.parent
        prev = walk._end_hash if walk.parent is not None else None
        for n in reversed(chain):
            n._end_hash = page_hashes(n.key, self.page_size, prev or 0)[-1]
            prev = n._end_hash
        hashes = page_hashes(node.key, self.page_size, prev or 0)
        node._end_hash = hashes[-1]
        return prev, hashes

    def _log(self, stored: bool, tier: str, node: TreeNode) -> None:
        if node.parent is None:  # a root holds no pages
            return
        parent, hashes = self._hashes(node)
        self._events.append((stored, tier, node.namespace, parent, hashes, node.num_tokens))

    # --------------------------------------------------------------- eviction
    def _device_rank(self, node: TreeNode) -> int | None:
        """0 if ``node`` may give up its device pages now (a device leaf, idle), else None."""
        if (
            node.device_indices is None
            or node.lock_ref
            or node.io_status is not IOStatus.NONE
            or node.parent is None
        ):
            return None
        for c in node.children.values():
            if c.device_indices is not None:
                return None
        return 0

    def _host_rank(self, node: TreeNode) -> int | None:
        """0: host-only leaf; 1: also on the device (drop only its host copy); else None.

        A candidate has a host copy, no host lock, no IO in flight and no child with
        a host copy (children only on the device do not hold it back; a host-only
        node's children all have host copies, so a host-only candidate is a leaf).
        """
        if (
            node.host_indices is None
            or node.host_lock_ref
            or node.io_status is not IOStatus.NONE
            or node._host_children
            or node.parent is None
        ):
            return None
        return 1 if node.device_indices is not None else 0

    def _refresh(self, node: TreeNode) -> None:
        """Give ``node`` a current heap entry in each tier where it is a candidate.

        Inlines :meth:`_device_rank` and :meth:`_host_rank`: this runs on every
        state change, and the early exits keep it cheap.
        """
        if node.io_status is not IOStatus.NONE or node.parent is None:
            return
        children = node.children
        if node.device_indices is not None and not node.lock_ref:
            for c in children.values():
                if c.device_indices is not None:
                    break
            else:
                self._device_heap.push(node, 0)
        if node.host_indices is not None and not node.host_lock_ref and not node._host_children:
            self._host_heap.push(node, 1 if node.device_indices is not None else 0)

    def _refresh_inner_host(self, node: TreeNode) -> None:
        """Re-key ``node``, a host candidate inside a path whose access time changed.

        A node on both tiers whose children are all device-only is a host
        candidate although it has children (see :meth:`_host_rank`).
        """
        if node.parent is not None and (rank := self._host_rank(node)) is not None:
            self._host_heap.push(node, rank)

    def _maybe_compact(self) -> None:
        """Rebuild the heaps once stale entries outnumber live nodes by far."""
        limit = 4 * self.num_nodes + 1024
        if len(self._device_heap) > limit or len(self._host_heap) > limit:
            self._compact()

    def _compact(self) -> None:
        nodes = list(self.nodes())
        self._device_heap.rebuild((n, r) for n in nodes if (r := self._device_rank(n)) is not None)
        self._host_heap.rebuild((n, r) for n in nodes if (r := self._host_rank(n)) is not None)

    def evict_device(
        self,
        num_tokens: int,
        backup: Callable[[TreeNode], bool] | None = None,
    ) -> EvictResult:
        """Give up device pages of at least ``num_tokens`` tokens (rounded up to pages) if possible.

        Unlocked device leaves go in eviction-policy order; nodes with IO in flight
        are skipped. A node with a host copy becomes host-only; a node without one
        is removed if it has no children, else it is offered to ``backup`` (write-back:
        the hook starts a backup and returns True; its pages are freed when the
        backup completes) and skipped if there is no hook or it declines. A leaf
        larger than what is still needed is split, and only its tail is evicted.
        """
        need = -(-check_int("num_tokens", num_tokens) // self.page_size)
        self._refuse_reentry("evict_device")
        freed: list[torch.Tensor] = []
        num_freed = num_backup = 0
        skipped: list[TreeNode] = []
        node = None
        try:
            while need > 0:
                node = self._device_heap.pop(self._device_rank)
                if node is None:
                    break
                if node.host_indices is None and node.children and backup is None:
                    skipped.append(node)
                    continue
                num_pages = len(node.key) // self._key_nbytes_per_page
                if num_pages > need:
                    self._split(node, num_pages - need)
                    num_pages = need
                if node.host_indices is not None:
                    if self._events is not None:
                        self._log(False, "device", node)
                    freed.append(node.device_indices)
                    node.device_indices = None
                    self.device_evictable_tokens -= node.num_tokens
                    num_freed += node.num_tokens
                    self._merge_host_chain(node)
                    self._refresh(node)
                    self._refresh(node.parent)
                elif backup is not None and self._call_backup(backup, node):
                    num_backup += node.num_tokens
                elif (
                    not node.children
                    and node.host_indices is None
                    and node.io_status is IOStatus.NONE
                    and node.parent is not None
                ):
                    # (A backup hook that declined may have given the node a host
                    # copy or IO in flight: then it is skipped like a node with children.)
                    if self._events is not None:
                        self._log(False, "device", node)
                    freed.append(node.device_indices)
                    self.device_evictable_tokens -= node.num_tokens
                    num_freed += node.num_tokens
                    node.device_indices = None
                    self._remove(node)
                else:
                    skipped.append(node)
                    continue
                need -= num_pages
        except BaseException:
            # A hook raised: the node it was running for and the skipped ones get
            # their heap entries back, so the tree stays consistent.
            for n in skipped:
                self._refresh(n)
            if node is not None and node.parent is not None:
                self._refresh(node)
            raise
        for node in skipped:
            self._device_heap.push(node)
        self._maybe_compact()
        pages = torch.cat(freed) if len(freed) > 1 else (freed[0] if freed else _EMPTY)
        return EvictResult(pages, num_freed, num_backup)

    def _call_backup(self, backup: Callable[[TreeNode], bool], node: TreeNode) -> bool:
        outer, self._hook = self._hook, "backup"
        try:
            return bool(backup(node))
        finally:
            self._hook = outer

    def evict_host(self, num_tokens: int, drop_device_resident: bool = True) -> EvictResult:
        """Give up host pages of at least ``num_tokens`` tokens if possible; return them.

        Host-only leaves go first (removed from the tree), in eviction-policy order;
        then, if ``drop_device_resident``, leaves also on the device lose their host
        copy. Host-locked nodes and nodes with IO in flight are skipped.
        """
        need = -(-check_int("num_tokens", num_tokens) // self.page_size)
        self._refuse_reentry("evict_host", backup_may=True)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while need > 0:
            node = self._host_heap.pop(self._host_rank)
            if node is None:
                break
            if node.device_indices is not None and not drop_device_resident:
                self._host_heap.push(node, 1)
                break
            num_pages = len(node.key) // self._key_nbytes_per_page
            if num_pages > need:
                try:
                    self._split(node, num_pages - need)
                except BaseException:
                    self._refresh(node)  # an on_split hook raised: node keeps its heap entry
                    raise
                num_pages = need
            if self._events is not None:
                self._log(False, "host", node)
            freed.append(node.host_indices)
            node.host_indices = None
            self.host_evictable_tokens -= node.num_tokens
            self._host_changed(node, True, False)  # a candidate is never busy
            num_freed += node.num_tokens
            if node.device_indices is None:
                self._remove(node)
            else:
                self._refresh(node)
            need -= num_pages
        pages = torch.cat(freed) if len(freed) > 1 else (freed[0] if freed else _EMPTY)
        return EvictResult(pages, num_freed, 0)

    # ---------------------------------------------------------------- queries
    def device_indices_of(self, node: TreeNode, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Device page ids of the path from the root to ``node`` (all on the device).

        With ``extra`` (1-D int64 CPU page ids) the result continues with them: a
        request's page table is ``device_indices_of(prefix_node, new_pages)``.
        """
        self._check_live(node, "device_indices_of")
        parts = [] if extra is None else [check_page_tensor("extra", extra)]
        while node.parent is not None:
            if node.device_indices is None:
                raise ValueError(f"device_indices_of: node {node.id} is not on the device")
            parts.append(node.device_indices)
            node = node.parent
        if not parts:
            return _EMPTY
        parts.reverse()
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def path_missing_host(self, node: TreeNode, min_hit_count: int = 0) -> list[TreeNode]:
        """Nodes from the root down to ``node`` that a backup would copy, root side first.

        Those on the device without a host copy, with no IO in flight and at
        least ``min_hit_count`` hits (the selective write policy's threshold).
        """
        min_hit_count = check_int("min_hit_count", min_hit_count)
        self._check_live(node, "path_missing_host")
        nodes = []
        while node.parent is not None:
            if (
                node.host_indices is None
                and node.device_indices is not None
                and node.io_status is IOStatus.NONE
                and node.hit_count >= min_hit_count
            ):
                nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def host_only_path(self, result: MatchResult) -> list[TreeNode]:
        """The host-only nodes of a match, root side first."""
        self._check_live(result.last_node, "host_only_path")
        self._check_live(result.last_device_node, "host_only_path")
        nodes = []
        node = result.last_node
        while node is not result.last_device_node:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """Non-root nodes from the root down to ``node``."""
        self._check_live(node, "path_to")
        nodes = []
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Verify every invariant; raise ``AssertionError`` naming the first violation."""
        pnb = self._key_nbytes_per_page
        sums = {"dev_ev": 0, "dev_pr": 0, "host_ev": 0, "host_pr": 0, "host_take": 0}
        dev_pages: list[torch.Tensor] = []
        host_pages: list[torch.Tensor] = []
        dev_live = self._device_heap.live_priorities()
        host_live = self._host_heap.live_priorities()
        count = 0
        for ns, root in self._roots.items():
            assert root.namespace == ns and root.parent is None and root.lock_ref == 1, (
                f"root of namespace {ns!r} corrupted"
            )
        for node in self.nodes():
            count += 1
            where = f"node {node.id} ({node.namespace!r})"
            parent = node.parent
            assert len(node.key) > 0 and len(node.key) % pnb == 0, f"{where}: key not whole pages"
            assert parent.children.get(node.key[:pnb]) is node, f"{where}: not keyed by first page"
            assert node.namespace == parent.namespace, f"{where}: namespace differs from parent"
            num_pages = len(node.key) // pnb
            for name in ("device_indices", "host_indices"):
                idx = getattr(node, name)
                if idx is not None:
                    assert idx.dtype == torch.int64 and idx.dim() == 1, f"{where}: {name} not int64"
                    assert len(idx) == num_pages, (
                        f"{where}: {name} has {len(idx)} entries for {num_pages} pages"
                    )
            assert node.on_device or node.on_host, f"{where}: no copy in any tier"
            if node.on_device:
                assert parent.on_device, f"{where}: on the device but its parent is not"
                dev_pages.append(node.device_indices)
                sums["dev_pr" if node.lock_ref else "dev_ev"] += node.num_tokens
            if node.on_host:
                host_pages.append(node.host_indices)
                sums["host_pr" if node.host_lock_ref else "host_ev"] += node.num_tokens
                if not self._host_busy(node):
                    sums["host_take"] += node.num_tokens
            kids = node.children.values()
            num_host = sum(c.host_indices is not None for c in kids)
            assert node._host_children == num_host, (
                f"{where}: counts {node._host_children} children with a host copy, has {num_host}"
            )
            num_busy = sum(self._host_busy(c) for c in kids)
            assert node._busy_children == num_busy, (
                f"{where}: counts {node._busy_children} busy host children, has {num_busy}"
            )
            assert node.lock_ref >= 0 and node.host_lock_ref >= 0, f"{where}: negative lock"
            assert node.lock_ref == 0 or node.on_device, f"{where}: locked but not on the device"
            if parent.parent is not None:
                assert parent.lock_ref >= node.lock_ref, f"{where}: locked more than its parent"
            if node.io_status is not IOStatus.NONE:
                assert node.on_device and node.on_host, f"{where}: IO in flight without both copies"
            for heap, live, rank_fn, tier in (
                (self._device_heap, dev_live, self._device_rank, "device"),
                (self._host_heap, host_live, self._host_rank, "host"),
            ):
                rank = rank_fn(node)
                seq = node._dev_seq if tier == "device" else node._host_seq
                if rank is not None:
                    assert live.get(seq) == heap.expected_priority(node, rank), (
                        f"{where}: {tier} eviction candidate without a current heap entry"
                    )
        assert count == self.num_nodes, f"num_nodes is {self.num_nodes}, tree has {count}"
        for name, key in (
            ("device_evictable_tokens", "dev_ev"),
            ("device_protected_tokens", "dev_pr"),
            ("host_evictable_tokens", "host_ev"),
            ("host_protected_tokens", "host_pr"),
            ("host_takeable_tokens", "host_take"),
        ):
            assert getattr(self, name) == sums[key], (
                f"{name} is {getattr(self, name)}, nodes sum to {sums[key]}"
            )
        for tier, pages in (("device", dev_pages), ("host", host_pages)):
            if pages:
                allp = torch.cat(pages)
                assert len(torch.unique(allp)) == len(allp), f"a {tier} page is held twice"
