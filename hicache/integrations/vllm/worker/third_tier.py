"""The worker half's third tier on the step: synchronous reads, write-behind, and what
a copy into a host page waits for.

A save copies blocks to host pages, then (with a third tier) writes those pages to
storage behind the step; a :class:`~hicache.integrations.vllm.worker.prefetch.SaveRecord`
follows both. Before anything writes into a host page, the copies and storage writes
still reading it must end (``_settle_pages``); a storage write that hangs past
``storage_timeout_s`` leaves its pages in use, and the caller must not write them. A
read that times out keeps its pages *quarantined* until it ends (it may still write
into them).

:class:`WorkerThirdTier` is a part of :class:`~hicache.integrations.vllm.worker.half.WorkerHalf`
(a mixin over its state, declared below), kept here so that the worker module reads as
the step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from hicache.integrations.vllm.common.handoff import write_failed_key
from hicache.integrations.vllm.common.keys import salt_keys

if TYPE_CHECKING:
    from hicache.integrations.vllm.common.config import ConnectorConfig
    from hicache.integrations.vllm.worker.prefetch import PrefetchReader, SaveRecord
    from hicache.integrations.vllm.worker.stats import WorkerStats
    from hicache.memory import HostPool
    from hicache.storage.worker import StorageJob, StorageTier

_log = logging.getLogger("hicache.integrations.vllm.worker")


class WorkerThirdTier:
    """The third-tier half of the worker half's state and methods."""

    config: ConnectorConfig
    host_pool: HostPool
    storage: StorageTier | None
    prefetch: PrefetchReader | None
    counters: WorkerStats
    write_reports: tuple[list[str], list[str]] | None
    read_samples: list[tuple[int, float]] | None
    _key_salt: str | None
    _saves: list[SaveRecord]
    _quarantine: set[int]
    _store_stalled: bool
    _reads_in_flight: list[StorageJob]
    _markers: set[StorageJob]

    if TYPE_CHECKING:  # WorkerHalf's
        def _poll(self) -> None: ...
        def _mark_bad(self, pages) -> None: ...
        def _mark_good(self, pages) -> None: ...

    def _wait_pages(self, host_pages: list[int], *, readers: bool = True) -> None:
        """Let every copy in flight that touches one of ``host_pages`` land first.

        ``readers=False``: only copies writing into them (a copy out of a page may run
        beside a storage write reading it).
        """
        pages = set(host_pages)
        while True:
            # A landed save becomes a storage write only when polled: look again after.
            busy = [rec for rec in self._saves if not rec.pages.isdisjoint(pages) and (
                rec.handle is not None or (readers and rec.writing))]
            if not busy:
                return
            for rec in busy:
                if readers:
                    rec.wait()
                elif rec.handle is not None:
                    rec.handle.wait()
            self._poll()

    def _settle_pages(self, host_pages: list[int], deadline: float) -> set[int]:
        """Before writing into ``host_pages``: let the copies writing them land, cancel the
        storage writes of their old content not started yet, and wait until ``deadline``
        (``time.monotonic``) for those running. Returns the pages still in use then (a
        hung store): the caller must not write them."""
        pages = set(host_pages)
        cancel = True
        while True:
            if cancel:
                self._cancel_writes(pages)
            busy = [rec for rec in self._saves if not rec.pages.isdisjoint(pages)
                    and (rec.handle is not None or rec.writing)]
            if not busy:
                return pages & self._quarantine
            for rec in busy:
                if rec.handle is not None:
                    rec.handle.wait()  # a block -> host copy: bounded, no I/O
                elif rec.job is not None and not rec.job.done.wait(
                    max(0.0, deadline - time.monotonic())
                ):
                    self._store_stalled = True
                    self._poll()
                    self._cancel_writes(pages)  # what has not started never will now
                    running = {p for r in self._saves if r.job is not None
                               and not r.job.cancelled for p in r.pages}
                    return pages & (running | self._quarantine)
            self._poll()
            # A save that landed meanwhile has just queued its storage write: a store that
            # keeps up writes it (one page's write, milliseconds); one that stalled lately
            # would hold this step up to the deadline again, so it is cancelled.
            cancel = self._store_stalled

    def yield_to_storage(self, timeout_s: float) -> None:
        """On a step that computes and loads nothing: block (without the GIL) until one of
        the storage jobs in flight ends, at most ``timeout_s``.

        Between steps vLLM's worker waits for the next one in a loop that yields the CPU
        (``sched_yield``) but holds the GIL nearly all the time, and an engine that steps
        only for hicache's background work (a handed-off request's writes, a prefetch)
        steps back to back: the storage threads then barely run (a 0.2 s write took
        over 2 s on 2 cores, and the decode instance stopped waiting for it). Such a
        step has nothing else to do; a request arriving meanwhile starts at most
        ``timeout_s`` later."""
        jobs = [rec.job for rec in self._saves if rec.job is not None and rec.writing]
        jobs += self._reads_in_flight
        if self.prefetch is not None:
            jobs += self.prefetch.jobs_in_flight()
        job = next((j for j in jobs if not j.done.is_set()), None)
        if job is not None:
            job.done.wait(timeout_s)

    def _cancel_writes(self, pages: set[int]) -> None:
        """Cancel the storage writes of ``pages``' content that have not started."""
        if self.storage is not None:
            for rec in self._saves:
                if rec.job is not None and not rec.pages.isdisjoint(pages):
                    self.storage.cancel(rec.job)

    def _read_storage(self, keys: list[str], host_pages: list[int]) -> None:
        """Storage -> host pages, waiting at most ``storage_timeout_s`` in all. Pages not
        read by then are bad (their blocks are load errors); a read still running keeps
        its pages out of use until it ends."""
        from hicache.storage.worker import StorageJob

        c = self.counters
        deadline = time.monotonic() + self.config.storage_timeout_s
        if self.storage is None or self._settle_pages(host_pages, deadline):
            self._mark_bad(host_pages)  # nothing can fill them now
            c.storage_errors += 1
            return
        job = StorageJob("read", self._salted(keys), id_tensor(host_pages))
        self.storage.submit(job)
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            # The backend hangs: the job may still write into these pages later.
            self._store_stalled = True
            self._quarantine.update(host_pages)
            self._reads_in_flight.append(job)
            self._mark_bad(host_pages)
            c.storage_errors += 1
            c.storage_timeouts += 1
            _log.warning("hicache worker: storage read of %d pages timed out after %.1f s",
                         len(keys), self.config.storage_timeout_s)
            return
        self._poll()
        num_done = 0 if job.error is not None else job.num_done
        if job.error is not None or num_done < len(keys):
            c.storage_errors += 1
        c.storage_read_bytes += num_done * self.host_pool.page_nbytes
        c.storage_read_seconds += job.seconds
        if self.read_samples is not None and num_done:
            self.read_samples.append((num_done, job.seconds))
        self._mark_good(host_pages[:num_done])
        self._mark_bad(host_pages[num_done:])

    def _report_write(self, keys: list[str], num_written: int) -> None:
        if self.write_reports is not None:
            self.write_reports[0].extend(keys[:num_written])
            self.write_reports[1].extend(keys[num_written:])

    def _salted(self, keys: list[str]) -> list[str]:
        return salt_keys(keys, self._key_salt)

    def _apply_storage_jobs(self) -> None:
        """Apply the storage jobs that ended: prefetch chunks, reads that timed out,
        write-behinds of saves."""
        if self.storage is None:
            return
        c = self.counters
        for job in self.storage.poll():
            if not job.cancelled:
                self._store_stalled = False  # the store answers again
            if self.prefetch is not None and self.prefetch.owns(job):
                read, missed = self.prefetch.job_done(job)
                self._mark_good(read)
                self._mark_bad(missed)
                c.storage_read_bytes += len(read) * self.host_pool.page_nbytes
                c.storage_read_seconds += job.seconds
                if self.read_samples is not None and read:
                    self.read_samples.append((len(read), job.seconds))
                c.storage_errors += job.error is not None
                continue
            if job.kind != "write":
                if job in self._reads_in_flight:  # a timed-out read ended at last
                    self._reads_in_flight.remove(job)
                    self._quarantine.difference_update(job.host_pages.tolist())
                continue  # the others are waited for where they are submitted
            if job in self._markers:  # a failed write's marker (stored or not: no matter)
                self._markers.discard(job)
                continue
            rec = next(r for r in self._saves if r.job is job)
            self._saves.remove(rec)
            c.storage_write_seconds += job.seconds
            num_written = job.num_done if job.error is None else 0
            self._report_write(rec.keys, num_written)
            if num_written < len(job.keys) and not job.cancelled:
                self._mark_failed_write(job, num_written)
            if job.error is not None:
                c.storage_errors += 1
            else:
                c.storage_write_bytes += job.num_done * self.host_pool.page_nbytes

    def _mark_failed_write(self, job: StorageJob, num_written: int) -> None:
        """A write stopped short of page ``num_written`` of ``job`` (a full store, an
        error; not a cancelled one, whose store may be stalled): store its marker
        (``write_failed_key``), so that a decode request waiting for that page (a
        prefill-to-decode hand-off) stops waiting at once. The marker's bytes are the
        page's host page as it is now (never read); a store that refuses the marker
        too leaves the decode to its timeout."""
        from hicache.storage.worker import StorageJob

        assert self.storage is not None
        marker = StorageJob("write", [write_failed_key(job.keys[num_written])],
                            job.host_pages[num_written:num_written + 1].clone())
        self._markers.add(marker)
        self.storage.submit(marker)


def id_tensor(ids: list[int]) -> torch.Tensor:
    """Page or block ids as the int64 tensor the transfer engine and storage take."""
    return torch.tensor(ids, dtype=torch.int64)
