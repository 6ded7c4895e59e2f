"""The recurrent-state component: a node holds the checkpoint at its end or none.

A hit ending at token ``L`` needs the state after exactly ``L`` tokens, so a
prefix ending at a node's end can be served when that node holds a checkpoint
(a state is a running sum over every token before it: no other node's data is
read). An insert keeps a checkpoint the caller gave at the end of a node on its
path; one given elsewhere is not taken. A split leaves the checkpoint with the
suffix (its end is the node's end) and gives the prefix none.
"""

from __future__ import annotations

import torch

from hicache.tree.python.kinds import KindLogic


class StateLogic(KindLogic):
    """A recurrent-state class (see the module docstring)."""

    def num_ids(self, num_pages: int) -> int:
        return self.width

    def split(
        self, ids: torch.Tensor, num_prefix_pages: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        return None, ids

    def serves(self, carry: int, holds: bool, num_pages: int, depth_pages: int) -> tuple[int, bool]:
        return 0, holds

    def split_prefix_holds(self, holds: bool) -> bool:
        return False

    def kept_start(self, start_page: int, end_page: int) -> int | None:
        return None

    def given(self, ids: torch.Tensor, start_page: int, end_page: int) -> torch.Tensor | None:
        part = ids[(end_page - 1) * self.width : end_page * self.width]
        return part if bool((part >= 0).all()) else None
