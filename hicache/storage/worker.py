"""The third tier's data movement: host pages to and from a storage backend, in the background.

Two worker threads (one writes, one reads, so a prefetch never queues behind a
burst of backups) run jobs against a :class:`~hicache.storage.StorageBackend`.
A job reads or writes whole host-pool pages in place (the host pool is
page-first, so a page is one contiguous block). Finished jobs are handed back
only through :meth:`StorageTier.poll`; workers never touch the cache's state.

What it knows: keys, host page ids, the host pool's memory. What it does not:
the tree, locks, allocation — the cache pins and frees around each job.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any

import torch

from hicache.memory import HostPool
from hicache.storage import StorageBackend

_log = logging.getLogger("hicache.storage")

# KV events of one node a write covers: (namespace, parent hash, page hashes).
EventPages = tuple[str | None, int | None, list[int]]


class StorageJob:
    """One batch of pages moving between host memory and storage."""

    __slots__ = (
        "kind", "keys", "host_pages", "nodes", "num_done", "error", "seconds", "done",
        "token_key", "namespace", "start_page", "committed", "stale", "event_pages",
        "cancelled", "started", "num_unauthentic",
    )

    def __init__(self, kind: str, keys: list[str], host_pages: torch.Tensor) -> None:
        self.kind = kind  # "write" (host -> storage) | "read" (storage -> host)
        self.keys = keys
        self.host_pages = host_pages  # one host page id per key; kept alive until done
        # write: host-pinned tree nodes whose pages are read (the cache's; never read here)
        self.nodes: list[Any] = []
        self.num_done = 0  # leading pages written / read and verified
        self.num_unauthentic = 0  # read jobs: pages refused, their tag did not verify
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.done = threading.Event()
        # read jobs: where the pages go in the tree once they arrived
        self.token_key = b""  # int32 bytes of the tokens up to the last fetched page
        self.namespace: str | None = None
        self.start_page = 0  # first fetched page's position in the sequence
        self.committed = False
        self.stale = False  # read jobs: a reset came meanwhile, throw the pages away
        # write jobs with KV events on: (namespace, parent hash, page hashes) per node
        self.event_pages: list[EventPages] = []
        # StorageTier.cancel before the job started: it finishes moving nothing (num_done 0)
        self.cancelled = False
        self.started = False


class StorageTier:
    """Background reads and writes of host pages to one backend."""

    def __init__(self, backend: StorageBackend, host_pool: HostPool, *,
                 cpus: frozenset[int] | None = None) -> None:
        """``cpus``: the CPUs the two threads run on (Linux affinity); None: wherever the
        creating thread may run. A thread the system refuses to move there stays where
        it started (logged): the tier works anywhere, only slower."""
        self.backend = backend
        self.host_pool = host_pool
        backend.register_memory(host_pool.buffer)
        self._finished: deque[StorageJob] = deque()
        self._lock = threading.Lock()  # a job starts or is cancelled, never both
        self._queues: dict[str, queue.SimpleQueue[StorageJob | None]] = {
            "write": queue.SimpleQueue(), "read": queue.SimpleQueue(),
        }
        self._threads = [
            threading.Thread(target=self._work, args=(kind,), name=f"hicache-storage-{kind}",
                             daemon=True)
            for kind in self._queues
        ]
        for t in self._threads:
            t.start()
            tid = t.native_id
            if cpus is not None and tid is not None:
                try:
                    os.sched_setaffinity(tid, cpus)
                except OSError as e:
                    _log.warning("hicache storage: thread %s stays on CPUs %s, not %s (%s)",
                                 t.name, sorted(os.sched_getaffinity(tid)), sorted(cpus), e)
        self.num_in_flight = 0

    def submit(self, job: StorageJob) -> StorageJob:
        self.num_in_flight += 1
        self._queues[job.kind].put(job)
        return job

    def cancel(self, job: StorageJob) -> bool:
        """Cancel ``job`` if it has not started: True then, and it will touch no page (it
        still finishes, through :meth:`poll`, with ``num_done == 0``)."""
        with self._lock:
            if not job.started:
                job.cancelled = True
            return job.cancelled

    def poll(self) -> list[StorageJob]:
        """Jobs finished since the last poll, each once, in completion order."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        self.num_in_flight -= len(out)
        return out

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self.backend.close()

    def _work(self, kind: str) -> None:
        q = self._queues[kind]
        while (job := q.get()) is not None:
            start = time.perf_counter()
            with self._lock:
                job.started = not job.cancelled
            try:
                if job.cancelled:
                    raise _Cancelled()
                views = [self.host_pool.page(int(p)) for p in job.host_pages]
                if job.kind == "write":
                    job.num_done = self.backend.set(job.keys, views)
                else:
                    # This thread's own count: the write thread's replacements of
                    # unauthentic values are not this read's.
                    before = self.backend.thread_unauthentic_values()
                    try:
                        job.num_done = self.backend.get_into(job.keys, views)
                    finally:
                        job.num_unauthentic = (
                            self.backend.thread_unauthentic_values() - before
                        )
            except _Cancelled:
                pass
            except Exception as exc:  # noqa: BLE001 - any failure finishes the job as failed
                job.error = exc
            job.seconds = time.perf_counter() - start
            self._finished.append(job)
            job.done.set()


class _Cancelled(Exception):
    """A job cancelled before it started."""
