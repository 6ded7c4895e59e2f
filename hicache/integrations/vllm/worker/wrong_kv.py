"""Which vLLM blocks hold wrong KV, as the worker half follows them step by step.

A block whose load failed holds wrong KV, and so does every block a forward computes
over it (attention read it), whichever request computes it; a block rewritten over
right KV is right again. The worker half follows vLLM's block tables and what each
step computes (the plan carries both), never saves such a block, and reports the
new ones to the scheduler (which takes them out of vLLM's prefix cache). Knows block
ids and token ranges, nothing of host pages or copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class PoisonedBlocks(set):
    """The set of blocks holding wrong KV, and the ones not reported yet."""

    def __init__(self) -> None:
        super().__init__()
        self._new: set[int] = set()  # not yet reported to the scheduler

    def add_new(self, block_ids) -> None:
        new = set(block_ids) - self
        self.update(new)
        self._new |= new

    def take_new(self) -> set[int]:
        """Blocks found wrong since the last call (and still wrong)."""
        new, self._new = self._new & self, set()
        return new

    def follow(self, computes: Sequence[tuple[str, int, int]],
               tables: Mapping[str, list[int]], block_size: int) -> None:
        """Blocks this step wrote hold wrong KV when the request's earlier tokens did
        (attention read them), and the right KV again when they did not.

        A request may read a block another request rewrites in the same forward (vLLM
        recomputes a shared block once): repeated until nothing changes. A request's
        partly filled first block is judged by what it held before this step (only
        that request writes it: vLLM shares whole blocks only).
        """
        P = block_size
        before = set(self)
        for _ in range(len(computes) + 1):
            changed = False
            for req_id, start, end in computes:
                table = tables.get(req_id)
                if not table or end <= start:
                    continue
                first, last = start // P, min((end - 1) // P, len(table) - 1)
                wrong_prefix = not self.isdisjoint(table[:first]) or (
                    start % P != 0 and table[first] in before)
                written = set(table[first:last + 1])
                if wrong_prefix and not written <= self:
                    self.add_new(written)
                    changed = True
                elif not wrong_prefix and not written.isdisjoint(self):
                    self.difference_update(written)
                    changed = True
            if not changed:
                return
