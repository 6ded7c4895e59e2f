"""The worker half's background third-tier reads: prefetches, off vLLM's step.

The scheduler half sends a :class:`~hicache.integrations.vllm.common.plan.PrefetchOp` (storage
keys and the host pages to read them into) with a step's plan and lets the request
wait; this module reads the pages on the storage tier's read thread while vLLM keeps
stepping, and says how far each op got. A read is split into chunks of
``chunk_pages`` so that a long one reports its leading pages as they arrive (the
``best_effort`` and ``timeout`` policies use what arrived)::

    op:      | chunk 0 | chunk 1 | chunk 2 |     one StorageJob each, read in order
    arrived: |<- leading run ->|              a chunk that fails ends the run; the
                                              chunks after it are cancelled

An op's host pages may still be touched by copies of their previous use (the
scheduler evicted them and gave them to the op): a chunk starts only once nothing
touches its pages (``free_for_read``, which also cancels queued storage writes of
their old content). Nothing here blocks vLLM's step.

Also here: :class:`SaveRecord`, a save in flight (block -> host copy, then its storage
write-behind), which the worker keeps and a read must wait for (:func:`free_for_read`).

What it knows: keys, host page ids, jobs. Not the tree, not requests, not blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.integrations.vllm.common.plan import PrefetchOp

if TYPE_CHECKING:
    from hicache.storage.worker import StorageJob
    from hicache.transfer import Transfer

CHUNK_PAGES = 8


class SaveRecord:
    """A save in flight (or its storage write-behind) and what it touches."""

    __slots__ = ("handle", "job", "req_ids", "blocks", "pages", "host_pages", "keys",
                 "write_pages", "since")

    def __init__(self, handle: Transfer | None, req_ids, block_ids, host_pages, keys,
                 write_pages=None) -> None:
        """``write_pages``: the host pages written to storage, one per key (default: all
        ``host_pages``); a save of pages the tier holds already has none."""
        self.since = time.monotonic()  # submitted
        self.handle = handle  # the Transfer of the copy, None once it landed
        self.job: StorageJob | None = None  # writes the pages to storage once the save landed
        self.req_ids = req_ids
        self.blocks = set(block_ids)
        self.host_pages = host_pages
        self.pages = set(host_pages)
        self.keys = keys
        self.write_pages = host_pages if write_pages is None else write_pages

    @property
    def writing(self) -> bool:
        """Its storage write is queued or running."""
        return self.job is not None and not self.job.cancelled

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the copy landed and its storage write ended (the write: at most
        ``timeout_s``)."""
        if self.handle is not None:
            self.handle.wait()
        if self.job is not None and not self.job.cancelled:
            self.job.done.wait(timeout_s)


def free_for_read(host_pages: list[int], saves: list[SaveRecord], quarantine: set[int],
                  tier) -> bool:
    """No copy or storage job touches ``host_pages`` any more (``saves``: the worker's
    saves in flight; ``quarantine``: pages a timed-out read may still write), so a read
    may write them; queued storage writes of their old content are cancelled."""
    pages = set(host_pages)
    if not pages.isdisjoint(quarantine):
        return False
    free = True
    for rec in saves:
        if not rec.pages.isdisjoint(pages) and (rec.handle is not None or (
                rec.job is not None and not tier.cancel(rec.job))):
            free = False
    return free


class _Read:
    """One op being read: its chunks' jobs (None until submitted) and how far it got."""

    __slots__ = ("op", "jobs", "arrived", "finished", "reported", "failed_at")

    def __init__(self, op: PrefetchOp, num_chunks: int) -> None:
        self.op = op
        self.jobs: list = [None] * num_chunks
        self.arrived = 0  # leading pages read on this rank
        self.finished = False  # every chunk's job ended (or was never needed)
        self.reported: tuple[int, bool] | None = None
        self.failed_at: int | None = None  # first chunk that did not read fully


class PrefetchReader:
    """Prefetch ops of one worker, read on the storage tier's read thread."""

    def __init__(self, tier, salt: Callable[[list[str]], list[str]], *,
                 chunk_pages: int = CHUNK_PAGES) -> None:
        """``tier``: the worker's :class:`~hicache.storage.worker.StorageTier`; ``salt``:
        the rank's key salting (:func:`~hicache.integrations.vllm.common.keys.salt_keys`)."""
        self.tier = tier
        self.salt = salt
        self.chunk_pages = chunk_pages
        self._reads: dict[int, _Read] = {}  # op id -> read, until reported finished
        self._jobs: dict[StorageJob, tuple[_Read, int]] = {}  # job -> (read, chunk index)

    # ------------------------------------------------------------------ ops
    def submit(self, op: PrefetchOp) -> None:
        """Take ``op`` (a second submit of the same op id is ignored)."""
        if op.op_id in self._reads:
            return
        n = len(op.host_pages)
        if len(op.storage_keys) != n:
            raise ValueError(f"prefetch {op.op_id}: expected one host page per key, got "
                             f"{len(op.storage_keys)} keys, {n} pages")
        self._reads[op.op_id] = _Read(op, -(-n // self.chunk_pages))

    def take(self, ops, free_for_read: Callable[[list[int]], bool]) -> None:
        """Take ``ops`` (see :meth:`submit`), then start what can start (:meth:`start`)."""
        for op in ops:
            self.submit(op)
        if self._reads:
            self.start(free_for_read)

    def start(self, free_for_read: Callable[[list[int]], bool]) -> None:
        """Submit the chunks whose host pages nothing else touches any more, in order."""
        from hicache.storage.worker import StorageJob

        for read in self._reads.values():
            if read.failed_at is not None:
                continue
            for i, job in enumerate(read.jobs):
                if job is not None:
                    continue
                keys, pages = self._chunk(read, i)
                if not free_for_read(pages):
                    break  # in order: a later chunk waits for this one
                job = StorageJob("read", self.salt(keys), torch.tensor(pages, dtype=torch.int64))
                read.jobs[i] = job
                self._jobs[job] = (read, i)
                self.tier.submit(job)

    def _chunk(self, read: _Read, i: int) -> tuple[list[str], list[int]]:
        a, b = i * self.chunk_pages, (i + 1) * self.chunk_pages
        return read.op.storage_keys[a:b], read.op.host_pages[a:b]

    def owns(self, job) -> bool:
        return job in self._jobs

    def job_done(self, job) -> tuple[list[int], list[int]]:
        """A job of ours ended (from the tier's ``poll``): returns (pages read, pages not
        read) of its chunk, for the worker's good/bad page bookkeeping."""
        read, i = self._jobs.pop(job)
        _, pages = self._chunk(read, i)
        num_done = 0 if (job.error is not None or job.cancelled) else job.num_done
        if num_done < len(pages) and read.failed_at is None:
            read.failed_at = i
            for later in read.jobs[i + 1:]:
                if later is not None:
                    self.tier.cancel(later)
        self._advance(read)
        return pages[:num_done], pages[num_done:]

    def _advance(self, read: _Read) -> None:
        arrived = 0
        for i, job in enumerate(read.jobs):
            if job is None or job in self._jobs:  # not submitted yet, or still reading
                break
            num_done = 0 if (job.error is not None or job.cancelled) else job.num_done
            arrived += num_done
            if num_done < len(self._chunk(read, i)[1]):
                break
        read.arrived = arrived
        running = any(j is not None and j in self._jobs for j in read.jobs)
        # After a failure the chunks not submitted never will be: the op ends with the
        # submitted ones.
        read.finished = not running and (read.failed_at is not None
                                         or all(j is not None for j in read.jobs))

    # ------------------------------------------------------------ reporting
    def progress(self) -> dict[int, tuple[int, bool]]:
        """Ops whose progress changed since the last call: op id -> (leading pages read
        on this rank, the op ended here). An op that ended is forgotten once reported."""
        out = {}
        for op_id, read in list(self._reads.items()):
            if not read.jobs:  # an op of no pages
                read.finished = True
            state = (read.arrived, read.finished)
            if state != read.reported:
                out[op_id] = read.reported = state
            if read.finished:
                del self._reads[op_id]
        return out

    @property
    def num_in_flight(self) -> int:
        """Ops not yet reported ended."""
        return len(self._reads)

    @property
    def num_reading(self) -> int:
        """Ops whose reads have not all ended (ended ones may await their report)."""
        return sum(not r.finished for r in self._reads.values())

    def jobs_in_flight(self) -> list[StorageJob]:
        """The submitted reads not yet ended."""
        return list(self._jobs)

    def busy_pages(self) -> set[int]:
        """Host pages an op may still write (its reads submitted or waiting)."""
        return {p for r in self._reads.values() if not r.finished for p in r.op.host_pages}

    def wait(self, timeout_s: float) -> None:
        """Block until the submitted jobs ended, at most ``timeout_s`` each (tests, close)."""
        for job in list(self._jobs):
            job.done.wait(timeout_s)
