"""The run-time KV audit, worker side: each block the scheduler names, computed by this
step's forward, compared with the page a hit would have served (docs/vllm.md,
"Run-time KV audit").

Runs after the step's forward and its hooks (``wait_for_save``): a host page is read
once the copies writing into it landed; a third-tier page is read into scratch memory
(this rank's salted key), at most ``storage_timeout_s``. A comparison that cannot be
made (the block holds wrong KV the worker knows of, the page is bad, quarantined or
being prefetched into, the read failed) is :data:`~..common.audit.SKIPPED`, never a
mismatch. Pages compare plane by plane (one layer's K/V of the block) within the KV
dtype's tolerance (:func:`~..common.audit.tolerance`, :func:`planes_match`); one plane
out of it is a mismatch.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from hicache.integrations.vllm.common.audit import (
    MATCH,
    MISMATCH,
    SKIPPED,
    AuditOp,
    tolerance,
    worst,
)

if TYPE_CHECKING:
    from hicache.integrations.vllm.worker.half import WorkerHalf

_log = logging.getLogger("hicache.integrations.vllm.worker")


def planes_match(computed: torch.Tensor, stored: torch.Tensor, num_planes: int,
                 rtol: float) -> bool:
    """Whether every one of the ``num_planes`` equal planes of ``computed`` is within
    ``rtol`` of ``stored``'s: ``||c - s|| <= rtol * max(||c||, ||s||)`` over the finite
    elements, and the non-finite ones equal, in the same places."""
    c = computed.reshape(num_planes, -1).double()
    s = stored.reshape(num_planes, -1).double()
    finite = torch.isfinite(c)
    if not torch.equal(finite, torch.isfinite(s)):
        return False
    if not bool(finite.all()):
        odd = ~finite
        if not bool(torch.isclose(c[odd], s[odd], equal_nan=True).all()):
            return False
        c, s = c.where(finite, 0.0), s.where(finite, 0.0)
    scale = torch.maximum(c.norm(dim=1), s.norm(dim=1))
    return bool(((c - s).norm(dim=1) <= rtol * scale).all())


class WorkerAudit:
    """Compares blocks with pages for one worker half; outcomes wait for the next report."""

    def __init__(self, half: WorkerHalf) -> None:
        self.half = half
        layout = half.layout
        self.dtype = layout.dtype
        self.tolerance = tolerance(str(layout.dtype))
        pool = half.host_pool
        self._host_bytes = pool.buffer.view(pool.num_pages, -1).view(torch.uint8)
        self._planes = [q for planes in layout.planes for q in planes]
        self.outcomes: dict[int, int] = {}  # op id -> outcome, since the last take
        self._reading: threading.Event | None = None  # set when the last read ended

    def compare(self, ops: list[AuditOp]) -> None:
        """Compare every op's block with its page (after this step's forward)."""
        half = self.half
        stored = self._read_stored([op for op in ops if op.host_page < 0 and op.storage_key])
        reading = half.prefetch.busy_pages() if half.prefetch is not None else set()
        poisoned = half._poisoned
        for op in ops:
            page: torch.Tensor | None
            if op.block_id in poisoned:
                page = None
            elif op.host_page >= 0:
                p = op.host_page
                if p in half._bad_pages or p in half._quarantine or p in reading:
                    page = None
                else:
                    half._wait_pages([p], readers=False)
                    page = self._host_bytes[p]
            else:
                page = stored.get(op.op_id)
            outcome = SKIPPED if page is None else (
                MATCH if self._same(self.block_bytes(op.block_id), page) else MISMATCH)
            self.outcomes[op.op_id] = worst(self.outcomes.get(op.op_id, MATCH), outcome)

    def take(self) -> dict[int, int]:
        """Outcomes since the last call."""
        out, self.outcomes = self.outcomes, {}
        return out

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as a host page holds it (every layer's planes back to back),
        in host memory."""
        rows = [q[block_id].reshape(-1).view(torch.uint8) for q in self._planes]
        return torch.cat(rows).cpu()

    def _same(self, computed: torch.Tensor, page: torch.Tensor) -> bool:
        if self.tolerance is None:
            return torch.equal(computed, page)
        return planes_match(computed.view(self.dtype), page.view(self.dtype),
                            len(self._planes), self.tolerance)

    def _read_stored(self, ops: list[AuditOp]) -> dict[int, torch.Tensor]:
        """The third-tier pages of ``ops`` (this rank's shard), read into scratch memory:
        op id -> bytes, for the leading pages that arrived (and verified) in time."""
        half = self.half
        if not ops or half.storage is None:
            return {}
        if self._reading is not None and not self._reading.is_set():
            return {}  # the last read still hangs: no pile-up of hung reads
        backend = half.storage.backend
        keys = half._salted([op.storage_key for op in ops])
        nbytes = half.host_pool.page_nbytes
        bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in ops]
        got: list[int] = []
        done = self._reading = threading.Event()

        def read() -> None:
            try:
                n = 0
                for key, buf in zip(keys, bufs, strict=True):  # one by one: a hole is a miss
                    if backend.get_into([key], [buf]) == 1:
                        got.append(n)
                    n += 1
            except Exception as exc:  # noqa: BLE001 - what did not arrive is skipped
                _log.warning("hicache audit: a third-tier read failed (%s)", type(exc).__name__)
            finally:
                done.set()

        thread = threading.Thread(target=read, name="hicache-audit-read", daemon=True)
        thread.start()
        if not done.wait(half.config.storage_timeout_s):
            _log.warning("hicache audit: third-tier reads did not end within %.1f s; those "
                         "pages are not audited", half.config.storage_timeout_s)
        return {ops[i].op_id: bufs[i] for i in list(got)}
