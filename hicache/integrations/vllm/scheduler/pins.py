"""Host locks the scheduler half takes while it plans one step.

A node that a step loads from or saves into is host-locked (``host_lock``) until the
step's plan is built, so that making room for one request never evicts a page another
request's copy of this step touches. The locks are counted per node, so that all of
them are released at once and the integrity check can compare them with the tree's.
"""

from __future__ import annotations

from hicache.tree import TreeNode
from hicache.tree.protocol import RadixTreeLike


class StepPins:
    """The host locks of the step being planned: node -> how many."""

    def __init__(self, tree: RadixTreeLike) -> None:
        self._tree = tree
        self._pins: dict[TreeNode, int] = {}

    def pin(self, node: TreeNode) -> None:
        """Host-lock ``node`` until :meth:`unpin_all`."""
        self._tree.host_lock(node)
        self._pins[node] = self._pins.get(node, 0) + 1

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """The tree split ``suffix`` off ``prefix`` and copied its host locks to it."""
        n = self._pins.get(suffix)
        if n:
            self._pins[prefix] = n

    def unpin_all(self) -> None:
        """Release every lock taken since the last call."""
        for node, n in self._pins.items():
            for _ in range(n):
                self._tree.host_unlock(node)
        self._pins.clear()

    def count(self, node: TreeNode) -> int:
        """Host locks this step holds on ``node``."""
        return self._pins.get(node, 0)

    def __len__(self) -> int:
        """Nodes pinned."""
        return len(self._pins)
