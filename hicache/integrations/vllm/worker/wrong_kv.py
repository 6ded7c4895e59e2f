"""Which vLLM blocks hold wrong KV, as the worker half follows them step by step.

A block whose load failed holds wrong KV, and so does every block a forward computes
over it (attention read it), whichever request computes it; a block rewritten over
right KV is right again. The worker half follows vLLM's block tables and what each
step computes (the plan carries both), never saves such a block, and reports the
new ones to the scheduler (which takes them out of vLLM's prefix cache). Knows block
ids and token ranges, nothing of host pages or copies.

A request that computed over wrong KV is *tainted* from the first block it wrote then,
until it finishes or is resumed: vLLM rolls it back (or fails it), but under async
scheduling vLLM 0.32 drops the outputs of the steps in flight while keeping their
placeholders, so the request's recompute may read inputs that are not its tokens
(and keeps a token sampled over the wrong KV). What it writes from there is never
taken for right KV, whatever it read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class PoisonedBlocks(set):
    """The set of blocks holding wrong KV, the ones not reported yet, and the tainted
    requests (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._new: set[int] = set()  # not yet reported to the scheduler
        # request -> index (in its block table) of the first block it wrote over wrong KV
        self.tainted: dict[str, int] = {}

    def forget(self, req_id: str) -> None:
        """The request finished, or starts again from new blocks (resumed): untainted."""
        self.tainted.pop(req_id, None)

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

        def wrong_prefix(table: list[int], start: int) -> bool:
            first = start // P
            return not self.isdisjoint(table[:first]) or (
                start % P != 0 and table[first] in before)

        for _ in range(len(computes) + 1):
            changed = False
            for req_id, start, end in computes:
                table = tables.get(req_id)
                if not table or end <= start:
                    continue
                first, last = start // P, min((end - 1) // P, len(table) - 1)
                written = table[first:last + 1]
                taint = self.tainted.get(req_id)  # from an earlier step
                bad = set(written) if wrong_prefix(table, start) else (
                    set(written[max(0, taint - first):]) if taint is not None else set())
                good = set(written) - bad
                if not bad <= self:
                    self.add_new(bad)
                    changed = True
                if not good.isdisjoint(self):
                    self.difference_update(good)
                    changed = True
            if not changed:
                break
        # Once settled: who computed over wrong KV in this forward is tainted from there.
        for req_id, start, end in computes:
            table = tables.get(req_id)
            if table and end > start and wrong_prefix(table, start):
                first = start // P
                self.tainted[req_id] = min(first, self.tainted.get(req_id, first))
