"""The CPU executors: who moves a transfer's pages when no CUDA stream does.

``ImmediateExecutor`` (bookkeeping only: completes at submission, copies nothing),
``SyncExecutor`` (copies every layer at submission, in the submitting thread),
``ManualExecutor`` (tests: a layer moves when the test says so) and ``ThreadExecutor``
(one worker thread per direction, layer by layer). The copying itself is a
:class:`hicache.memory.copier.PageCopier`'s (or anything with its ``load``/``backup``);
here is only who copies which layer when, and how finished transfers are reported.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Collection

from hicache.transfer.base import DriveFn, Executor, LayerCopier, Transfer, TransferKind


def _copy_layers(copier: LayerCopier, transfer: Transfer, first: int, last: int) -> None:
    if transfer.kind is TransferKind.LOAD:
        copier.load(transfer.host_pages, transfer.device_pages, first, last)
    else:
        copier.backup(transfer.device_pages, transfer.host_pages, first, last)


class ImmediateExecutor(Executor):
    """Bookkeeping only: every transfer finishes at submission and copies nothing."""

    def submit(self, transfer: Transfer) -> None:
        transfer.layers_done = transfer.num_layers
        transfer.seconds = 0.0
        transfer._finished = True
        self._completed.append(transfer)

    def close(self) -> None:
        """Nothing runs in the background."""


class SyncExecutor(Executor):
    """Copies every layer of a transfer at submission, in the submitting thread.

    For a caller whose cores are all busy computing whenever a copy thread could run
    (vLLM's CPU worker binds a compute thread to each of its cores): a copy thread
    would only preempt one of them, while a copy made between two forwards runs when
    they are idle. ``submit`` returns a finished transfer; a backup first waits for its
    fence, which another thread must pass (on CPU, ``compute_fence()`` has passed).
    """

    def __init__(self, copier: LayerCopier) -> None:
        super().__init__()
        self._copier = copier

    def submit(self, transfer: Transfer) -> None:
        if transfer.fence is not None:
            transfer.fence.wait()
        started = time.perf_counter()
        try:
            _copy_layers(self._copier, transfer, 0, transfer.num_layers)
        except Exception as exc:  # noqa: BLE001 - reported through the transfer
            transfer.error = exc  # the destination holds garbage: the caller frees it
        else:
            transfer.layers_done = transfer.num_layers
        transfer.seconds = time.perf_counter() - started
        transfer._finished = True
        self._completed.append(transfer)

    def close(self) -> None:
        """Nothing runs in the background."""


class ManualExecutor(Executor):
    """For tests: a layer moves only when the test calls :meth:`complete_layer`.

    The copy of a layer happens at that call, so a test that reuses pages before
    completion sees the corruption a real race would cause.
    """

    def __init__(self, copier: LayerCopier) -> None:
        super().__init__()
        self._copier = copier
        self._pending: list[Transfer] = []
        self._started: dict[int, float] = {}

    def submit(self, transfer: Transfer) -> None:
        self._pending.append(transfer)

    def pending(self) -> list[Transfer]:
        """Submitted transfers that have not finished, in submission order."""
        return list(self._pending)

    def complete_layer(self, transfer: Transfer) -> bool:
        """Copy the next layer of ``transfer``; False if a backup's fence is not set yet."""
        self._check_pending(transfer)
        if transfer.fence is not None and not transfer.fence.is_set():
            return False
        self._started.setdefault(id(transfer), time.perf_counter())
        layer = transfer.layers_done
        try:
            _copy_layers(self._copier, transfer, layer, layer + 1)
        except Exception as exc:  # noqa: BLE001 - reported through the transfer
            self.fail(transfer, exc)
            return True
        transfer.layers_done += 1
        if transfer.layers_done == transfer.num_layers:
            self._finish(transfer)
        return True

    def complete(self, transfer: Transfer) -> bool:
        """Copy all remaining layers; False if a backup's fence is not set yet."""
        while transfer in self._pending:
            if not self.complete_layer(transfer):
                return False
        return True

    def fail(self, transfer: Transfer, exc: BaseException) -> None:
        """Finish ``transfer`` with ``exc`` as its error; remaining layers are not copied."""
        self._check_pending(transfer)
        transfer.error = exc
        self._finish(transfer)

    def _finish(self, transfer: Transfer) -> None:
        started = self._started.pop(id(transfer), time.perf_counter())
        transfer.seconds = time.perf_counter() - started
        transfer._finished = True
        self._pending.remove(transfer)
        self._completed.append(transfer)

    def close(self) -> None:
        """Pending transfers stay pending: only the test moves them."""

    def _check_pending(self, transfer: Transfer) -> None:
        if transfer not in self._pending:
            raise ValueError(
                f"transfer: expected a pending transfer of this engine, got {transfer}"
            )


class ThreadExecutor(Executor):
    """One worker thread per direction; copies run outside the GIL (torch or native).

    A transfer moves one layer at a time (loads, so that the model can start on layer
    0; backups, because one pass over all layers measured 10-25% slower than one pass
    per layer). Each layer is claimed under the condition by whoever copies it: the
    worker, or a thread blocked in ``wait``/``wait_layer`` on that transfer while
    nobody copies it (a blocked caller's core is idle anyway, and copying itself saves
    the two thread hand-offs, ~0.1-0.3 ms a transfer on 2 busy cores). At most one
    thread copies a given transfer at any moment, so its layers land in order and one
    transfer never uses more than one core. A caller that waits with a timeout, or on
    a backup whose fence has not passed, only waits.

    ``cpus``: the CPUs the two worker threads run on (Linux affinity), e.g. cores that
    an engine keeps free of its compute threads; None: wherever the creating thread
    may run. The constructor returns once both threads are pinned, and raises
    ``ValueError`` (the threads stopped) if the system refuses the set.
    """

    def __init__(self, copier: LayerCopier, *, cpus: Collection[int] | None = None) -> None:
        super().__init__()
        self._copier = copier
        self._cond = threading.Condition()
        self._queues: dict[TransferKind, collections.deque[Transfer]] = {
            kind: collections.deque() for kind in TransferKind
        }
        self._closed = False
        self.cpus = None if cpus is None else _check_cpus(cpus)
        self._pin_errors: list[OSError] = []
        pinned = threading.Barrier(len(TransferKind) + 1)
        self._threads = [
            threading.Thread(target=self._work, args=(kind, pinned),
                             name=f"hicache-{kind.value}", daemon=True)
            for kind in TransferKind
        ]
        for t in self._threads:
            t.start()
        pinned.wait()
        if self._pin_errors:
            self.close()
            raise ValueError(
                f"cpus: expected CPUs this process may run on, got {sorted(self.cpus or ())} "
                f"({self._pin_errors[0]})"
            )

    def driver(self) -> DriveFn:
        return self.drive

    def submit(self, transfer: Transfer) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("transfer engine is closed")
            transfer._queued = True
            self._queues[transfer.kind].append(transfer)
            self._cond.notify_all()

    def _work(self, kind: TransferKind, pinned: threading.Barrier) -> None:
        try:
            if self.cpus is not None:
                os.sched_setaffinity(0, self.cpus)  # 0: this thread
        except OSError as exc:
            self._pin_errors.append(exc)
        finally:
            pinned.wait()
        queue = self._queues[kind]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: queue or self._closed)
                if not queue:
                    return
                transfer = queue.popleft()
                transfer._queued = False
                if transfer._busy or transfer._finished:
                    continue  # a waiting caller copies it; it requeues what it leaves
            if transfer.fence is not None:
                transfer.fence.wait()
            self.drive(transfer, transfer.num_layers, None, steal=False)

    def drive(self, transfer: Transfer, need: int, timeout: float | None,
              *, steal: bool = True) -> None:
        """Return once ``transfer`` has ``need`` layers, has finished, or ``timeout`` passed.

        Copies layers below ``need`` here unless another thread copies ``transfer`` now.
        The worker (``steal=False``) leaves a transfer that a caller copies: the caller
        puts it back at the front of the queue if it stops before the last layer. A
        waiting caller copies only without a timeout and once the fence has passed, and
        otherwise sleeps until the layers it needs land. The thread that claims a
        transfer keeps it until it has the layers it needs, so two threads never
        alternate on one (each switch is a GIL hand-off that stalls the copy), and
        nobody wakes the worker at the end of a transfer it did not start.
        """
        deadline = None if timeout is None else time.perf_counter() + timeout
        may_copy = not steal or (
            timeout is None and (transfer.fence is None or transfer.fence.is_set())
        )
        cond = self._cond
        owner = False
        with cond:
            try:
                while not transfer._finished and transfer.layers_done < need:
                    if may_copy and (owner or not transfer._busy):
                        owner = transfer._busy = True
                        self._copy_next_layer(transfer)
                        continue
                    if not steal:
                        return
                    transfer._wake_at = min(transfer._wake_at, need)
                    remaining = None if deadline is None else deadline - time.perf_counter()
                    if remaining is not None and remaining <= 0:
                        return
                    cond.wait(remaining)
            finally:
                if owner:
                    self._release(transfer)

    def _release(self, transfer: Transfer) -> None:
        """Let go of ``transfer`` (the caller holds the condition and owns it)."""
        if not transfer._finished and self._closed:
            # The workers may have exited: finish here what close() promised to finish.
            while not transfer._finished:
                self._copy_next_layer(transfer)
        transfer._busy = False
        if not transfer._finished and not transfer._queued:
            transfer._queued = True
            self._queues[transfer.kind].appendleft(transfer)
            self._cond.notify_all()

    def _copy_next_layer(self, transfer: Transfer) -> None:
        """Copy the next layer with the condition released; the caller holds it and owns
        ``transfer``."""
        layer = transfer._next_layer
        transfer._next_layer += 1
        if transfer._started is None:
            transfer._started = time.perf_counter()
        error = None
        self._cond.release()
        try:
            _copy_layers(self._copier, transfer, layer, layer + 1)
        except BaseException as exc:  # noqa: BLE001 - reported through the transfer
            error = exc
        finally:
            self._cond.acquire()
        assert transfer.layers_done == layer, (
            f"layer {layer} landed while {transfer.layers_done} had: two threads copied "
            "one transfer at once"
        )
        if error is None:
            transfer.layers_done = layer + 1
        else:
            transfer.error = error
        if error is not None or transfer.layers_done == transfer.num_layers:
            transfer.seconds = time.perf_counter() - transfer._started
            transfer._finished = True
            self._completed.append(transfer)
        # Wake sleepers only when one of them asked for this point: every wake-up costs
        # a GIL hand-off that slows the copying thread down.
        if transfer._finished or transfer.layers_done >= transfer._wake_at:
            transfer._wake_at = transfer.num_layers + 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


def _check_cpus(cpus: Collection[int]) -> frozenset[int]:
    if isinstance(cpus, str | bytes) or not isinstance(cpus, Collection):
        raise TypeError(f"cpus: expected a collection of CPU ids, got {type(cpus).__name__}")
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in cpus):
        raise TypeError(f"cpus: expected int CPU ids, got {list(cpus)!r}")
    if not cpus or min(cpus) < 0:
        raise ValueError(f"cpus: expected one or more CPU ids >= 0, got {sorted(cpus)}")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpus: this platform cannot pin threads (no os.sched_setaffinity)")
    return frozenset(cpus)
