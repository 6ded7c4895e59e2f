"""The sliding-window component: a node holds the window's pages for all its pages or none.

A hit ending at token ``L`` reads the ``w = ceil((W - 1) / page_size)`` pages
before ``L`` (fewer at the start of a sequence). So a prefix ending at a node's
end can be served when the nodes covering those pages all hold the window's
data: walking root side first, the run of consecutive pages held ending here
must reach ``min(w, depth)``. An insert keeps, of each node ``[start, end)`` on
its path, only the tail ``[max(start, end - w), end)`` a hit at ``end`` reads (a
node boundary is made at ``end - w``): pages further back than every window are
never kept. A split gives both halves their pages; only a node shorter than the
window reads its parent's pages for a hit at its end.
"""

from __future__ import annotations

import torch

from hicache.tree.python.kinds import KindLogic


class WindowLogic(KindLogic):
    """A sliding-window class (see the module docstring)."""

    is_window = True

    def num_ids(self, num_pages: int) -> int:
        return num_pages * self.width

    def split(
        self, ids: torch.Tensor, num_prefix_pages: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        cut = num_prefix_pages * self.width
        return ids[:cut], ids[cut:]

    def serves(self, carry: int, holds: bool, num_pages: int, depth_pages: int) -> tuple[int, bool]:
        run = carry + num_pages if holds else 0  # consecutive pages held, ending here
        return run, run >= min(self.window_pages, depth_pages)

    def kept_start(self, start_page: int, end_page: int) -> int | None:
        return max(start_page, end_page - self.window_pages)

    def given(self, ids: torch.Tensor, start_page: int, end_page: int) -> torch.Tensor | None:
        part = ids[start_page * self.width : end_page * self.width]
        return part if bool((part >= 0).all()) else None

    def reads_parent(self, num_pages: int) -> bool:
        return num_pages < self.window_pages

    def split_prefix_holds(self, holds: bool) -> bool:
        return holds
