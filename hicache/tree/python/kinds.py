"""What the tree asks of a component kind: the hooks every kind answers alike.

The hybrid tree (:mod:`hicache.tree.python.hybrid`) keeps one record per
component on every node and knows records only through these hooks: how many
page ids a node holds, how a split divides them, whether a prefix ending at a
node's end can be served, which part of a node an insert keeps, what a caller
gave for it. Each kind answers them in its own module
(:mod:`hicache.tree.python.kind_window`, :mod:`hicache.tree.python.kind_state`).
No tree state lives here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hicache.components import ComponentSpec


class KindLogic(ABC):
    """The hooks of one component of one tree (its spec at the tree's page size); each
    kind implements the abstract ones."""

    is_window = False

    def __init__(self, spec: ComponentSpec, page_size: int) -> None:
        self.spec = spec
        self.width = spec.width  # page ids per token page (window) or per checkpoint (state)
        self.window_pages = spec.window_pages(page_size)  # w: pages a hit reads (0: a state)

    @abstractmethod
    def num_ids(self, num_pages: int) -> int:
        """Page ids a node of ``num_pages`` pages holds when it holds this component."""
        ...

    @abstractmethod
    def split(
        self, ids: torch.Tensor, num_prefix_pages: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A node's ids cut after ``num_prefix_pages`` pages: (the prefix's, the suffix's)."""
        ...

    @abstractmethod
    def serves(self, carry: int, holds: bool, num_pages: int, depth_pages: int) -> tuple[int, bool]:
        """Walking a path root side first: can a hit end at this node's end?

        ``carry`` is what the walk keeps between nodes (0 at the root), ``holds``
        whether this node holds the component in the view walked, ``depth_pages``
        the pages from the root to this node's end. Returns the new carry and the
        answer.
        """
        ...

    @abstractmethod
    def kept_start(self, start_page: int, end_page: int) -> int | None:
        """First page of an inserted node ``[start, end)`` whose ids the tree keeps
        (a node boundary is made there), or None when it keeps the checkpoint at
        ``end`` only."""
        ...

    @abstractmethod
    def given(self, ids: torch.Tensor, start_page: int, end_page: int) -> torch.Tensor | None:
        """What a caller's ids along a key give a node ``[start, end)``, or None if not all."""
        ...

    def reads_parent(self, num_pages: int) -> bool:
        """True when a hit at the end of a node this long also reads its parent's data."""
        return False

    @abstractmethod
    def split_prefix_holds(self, holds: bool) -> bool:
        """Whether the prefix a split cuts off a node holds the component (given the node's)."""
        ...

