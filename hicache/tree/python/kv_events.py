"""KV events of the Python radix tree: which pages entered or left a tier, by hash.

While enabled (:meth:`EventLog.enable_events`), every change of a node's tier
membership appends one entry to the log, ``(stored, tier, namespace,
parent_hash, hashes, num_tokens)`` (:data:`hicache.tree.types.TreeEvent`):
``stored`` is True when the node's pages entered ``tier`` ("device" or
"host"), False when they left it; ``hashes`` are the chained hashes of its
pages (:func:`hicache.events.page_hashes`), ``parent_hash`` the hash of the
page before them (None at the root). :meth:`EventLog.take_events` drains the
log; the cache turns entries into vLLM-style events (``hicache/events.py``).

Each node caches the chained hash of its last page. A node's end never moves (a
split makes a new prefix node; a merge takes the child's end, and copies its
cached hash), so the cache needs no other invalidation.
"""

from __future__ import annotations

from hicache.events import page_hashes
from hicache.tree.python.node import TreeNode
from hicache.tree.python.state import TreeState
from hicache.tree.types import TreeEvent


class EventLog(TreeState):
    """Logs pages entering and leaving a tier, with their chained page hashes."""

    def enable_events(self) -> None:
        """Start logging every node's pages entering or leaving a tier (see take_events)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[TreeEvent]:
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

    def _hashes(self, node: TreeNode) -> tuple[int | None, list[int]]:
        """Hashes of a non-root ``node``'s pages, caching the end hash of every node above."""
        chain = []
        walk = node.parent
        assert walk is not None, "a root holds no pages to hash"
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
        """Append the event of ``node``'s pages entering (``stored``) or leaving ``tier``.

        Callers check ``self._events is not None`` first (logging is on).
        """
        if node.parent is None:  # a root holds no pages
            return
        parent, hashes = self._hashes(node)
        assert self._events is not None, "_log called with event logging off"
        self._events.append((stored, tier, node.namespace, parent, hashes, node.num_tokens))
