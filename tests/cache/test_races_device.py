"""The eviction-during-IO scenarios of ``test_races.py`` with copies really in flight.

``test_races.py`` replays each race on the manual executor, which copies only when the
test says so. Here the same scenarios run where copies move on their own: on CUDA
(the CUDA executor: a load stream and a backup stream, events) and, on every machine,
on the CPU's thread executor (one copy thread per direction). A :class:`Gate` holds
copies in flight while the scenario evicts, reallocates and overwrites pages:

* CUDA: a spin queued on the executor's stream before each copy (``stall_stream``),
  ``HOLD_S`` long, so the copy is still queued while the host runs the scenario;
* CPU: the copy threads block in the page copier until the test lets that direction go.

If the cache let a device or host page be freed and reused while a copy still used
it, the late copy would move the wrong bytes and ``kvcheck`` reports the mismatch;
each scenario asserts its copy was still in flight at the point that matters, so a
hold that ended early fails instead of passing silently. Every scenario ends with
``check_integrity()``, every readable page verified and no page unaccounted for.
"""

from __future__ import annotations

import threading

import pytest
import torch
from cuda_streams import DEVICES, stall_stream
from kv_layouts import P, seq
from leak_checks import assert_no_leaks
from manual_executor import KV_F16, make_cache

from hicache.sim import kvcheck
from hicache.transfer import TransferKind

LOAD, BACKUP = TransferKind.LOAD, TransferKind.BACKUP
# A held CUDA copy's spin. A scenario's host steps take milliseconds; a load must stay
# in flight while the backups submitted after it land, so loads are held longer.
HOLD_S = {TransferKind.LOAD: 2.0, TransferKind.BACKUP: 0.5}
GATE_TIMEOUT_S = 30.0  # a CPU copy held longer than this fails instead of hanging the test


class _GatedCopier:
    """The page copier, blocking each copy until its direction's gate is open."""

    def __init__(self, inner, gates: dict[TransferKind, threading.Event]) -> None:
        self.inner = inner
        self.gates = gates
        self.fail: set[TransferKind] = set()

    def _through(self, kind: TransferKind) -> None:
        if not self.gates[kind].wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"{kind.value} held past {GATE_TIMEOUT_S} s: the test never let it go")
        if kind in self.fail:
            self.fail.discard(kind)
            raise RuntimeError(f"injected {kind.value} failure")

    def load(self, host_ids, device_ids, first, last):
        self._through(LOAD)
        self.inner.load(host_ids, device_ids, first, last)

    def backup(self, device_ids, host_ids, first, last):
        self._through(BACKUP)
        self.inner.backup(device_ids, host_ids, first, last)


class Gate:
    """Holds a cache's copies in flight on its device; :meth:`complete` lets them land."""

    def __init__(self, cache, device: str) -> None:
        self.cache = cache
        self.device = device
        self.submitted: list = []  # every transfer, in submission order
        ex = cache.transfers.executor
        submit = ex.submit
        if device == "cuda":
            assert cache.transfers.executor_name == "cuda"
            self._fail: set[TransferKind] = set()
            streams = {LOAD: ex._load_stream, BACKUP: ex._backup_stream}
            submit_load, submit_backup = ex._submit_load, ex._submit_backup

            def failing(kind, inner):
                def wrapped(transfer, state, compute):
                    if kind in self._fail:
                        self._fail.discard(kind)
                        raise RuntimeError(f"injected {kind.value} failure")
                    inner(transfer, state, compute)
                return wrapped

            ex._submit_load, ex._submit_backup = failing(LOAD, submit_load), failing(
                BACKUP, submit_backup)

            def held(transfer):
                stall_stream(streams[transfer.kind], HOLD_S[transfer.kind])
                self.submitted.append(transfer)
                submit(transfer)
        else:
            assert cache.transfers.executor_name == "thread"
            self._gates = {kind: threading.Event() for kind in TransferKind}
            ex._copier = self._copier = _GatedCopier(ex._copier, self._gates)

            def held(transfer):
                self.submitted.append(transfer)
                submit(transfer)

            # A host wait lets the copy land, as on CUDA (where the spin just ends): the
            # cache waits for copies in flight when it needs their pages.
            drive = cache.transfers._drive

            def waited(transfer, need, timeout):
                gate = self._gates[transfer.kind]
                opened = not gate.is_set()
                gate.set()
                try:
                    drive(transfer, need, timeout)
                finally:
                    if opened:
                        gate.clear()

            cache.transfers._drive = waited

        ex.submit = held

    def pending(self, kind: TransferKind | None = None) -> list:
        """Copies submitted and not yet reported by the cache's poll."""
        tracked = self.cache._inflight.is_tracked
        return [t for t in self.submitted if (kind is None or t.kind is kind) and tracked(t)]

    def in_flight(self, transfer) -> bool:
        """Still moving (not just unreported): the hold is still on."""
        return not transfer.done()

    def fail_next(self, kind: TransferKind) -> None:
        if self.device == "cuda":
            self._fail.add(kind)
        else:
            self._copier.fail.add(kind)

    def complete(self, kind: TransferKind | None = None) -> None:
        """Let every pending copy of ``kind`` (all: None) land, then apply them."""
        kinds = list(TransferKind) if kind is None else [kind]
        waiting = self.pending(kind)
        if self.device != "cuda":
            for k in kinds:
                self._gates[k].set()
        for t in waiting:
            assert t.wait(timeout=GATE_TIMEOUT_S), f"{t} never landed"
        if self.device != "cuda":
            for k in kinds:
                self._gates[k].clear()
        self.cache.poll()

    def settle(self) -> None:
        """Quiescence: everything landed, integrity, every readable page's KV, no leak."""
        while self.pending():
            self.complete()
        assert_no_leaks(self.cache)
        assert kvcheck.verify_cache(self.cache) == []

    def close(self) -> None:
        if self.device != "cuda":
            for g in self._gates.values():
                g.set()
        self.cache.close()


@pytest.fixture(params=DEVICES)
def gated(request):
    """``gated(**make_cache_kwargs)`` -> (cache, gate) on the parametrized device."""
    device = request.param
    made = []

    def factory(**kw):
        executor = "cuda" if device == "cuda" else "thread"
        cache = make_cache(executor=executor, device=device, **kw)
        gate = Gate(cache, device)
        made.append(gate)
        return cache, gate

    yield factory
    for gate in made:
        gate.close()


def verify_prefix(cache, h, tokens, ns=None) -> None:
    for layer in range(KV_F16.num_layers):
        h.wait_layer(layer)  # on CUDA: the reads below queue after the layer's event
    assert kvcheck.verify_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, ns) == []


def serve(cache, gate: Gate, tokens, ns=None) -> None:
    """One whole request: match, let its loads land, verify, compute the rest, insert."""
    before = gate.pending(LOAD)
    h = cache.match(tokens, ns)
    if [t for t in gate.pending(LOAD) if t not in before]:
        gate.complete(LOAD)
    assert cache.finish_loads(h), h.load_error
    verify_prefix(cache, h, tokens, ns)
    assert cache.alloc(h, len(tokens) - h.prefix_len) is not None
    kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, len(tokens), ns)
    cache.insert(h, tokens)
    verify_prefix(cache, h, tokens, ns)
    cache.release(h)
    cache.check_integrity()


def evict_all_device(cache, gate: Gate) -> None:
    for _ in range(2):
        h = cache.match([])
        pages = cache.alloc(h, cache.config.num_device_pages * P)
        cache.release(h)
        if pages is not None:
            return
        gate.complete(BACKUP)
    raise AssertionError("could not free the whole device")


def host_only(cache, gate: Gate, tokens, ns=None) -> None:
    serve(cache, gate, tokens, ns)
    gate.complete(BACKUP)
    evict_all_device(cache, gate)
    m = cache.tree.match_prefix(tokens, ns)
    assert (m.device_len, m.host_len) == (0, len(tokens) // P * P)


# --------------------------------------------------------------------- scenarios


def test_host_pages_of_a_load_in_flight_are_never_freed_or_reused(gated):
    cache, gate = gated(device_pages=8, host_pages=6)
    a = seq(100, 3)
    host_only(cache, gate, a)
    h = cache.match(a)
    (load,) = gate.pending(LOAD)
    a_host = set(load.host_pages.tolist())
    serve(cache, gate, seq(200, 3))
    gate.complete(BACKUP)
    serve(cache, gate, seq(300, 2))  # host full: must evict someone other than A
    (backup,) = gate.pending(BACKUP)
    assert a_host.isdisjoint(backup.host_pages.tolist()), "a backup reuses host pages being loaded"
    assert gate.in_flight(load)
    gate.complete(BACKUP)
    gate.complete(LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    gate.settle()


def test_device_pages_of_a_backup_in_flight_are_never_evicted_or_reused(gated):
    """With every page needed, the allocation waits for the backup still reading A's
    pages (a copying executor; the manual one refuses instead), and only then evicts A
    and hands its pages out: overwriting them cannot reach A's host copy."""
    cache, gate = gated(device_pages=6, host_pages=16)
    a = seq(100, 3)
    serve(cache, gate, a)  # write-through backup of A in flight
    (backup,) = gate.pending(BACKUP)
    h = cache.match(seq(500, 6))
    mine = cache.alloc(h, 3 * P)  # free pages: no wait
    assert mine is not None and set(mine.tolist()).isdisjoint(backup.device_pages.tolist())
    assert gate.in_flight(backup)
    rest = cache.alloc(h, 3 * P)  # A's pages: only once its backup landed
    assert backup.done() and backup.error is None
    assert sorted(rest.tolist()) == sorted(backup.device_pages.tolist())
    kvcheck.write_kv(cache.device_pool, h.page_table(), seq(500, 6), 0, 6 * P)
    cache.release(h)
    evict_all_device(cache, gate)  # A is host-only now: its host copy must be A's KV
    serve(cache, gate, a)
    assert cache.stats()["host_hit_tokens"] == len(a)
    gate.settle()


def test_write_back_frees_device_pages_only_after_the_backup_landed(gated):
    cache, gate = gated(device_pages=6, host_pages=16, policy="write_back")
    a = seq(100, 3)
    serve(cache, gate, a)
    assert gate.pending() == []  # write-back: nothing until eviction
    h = cache.match([])
    got = cache.alloc(h, 6 * P)  # evicts A: its backup starts, its pages free once it landed
    (backup,) = [t for t in gate.submitted if t.kind is BACKUP]
    assert backup.done() and backup.error is None
    assert set(backup.device_pages.tolist()) <= set(got.tolist())
    kvcheck.write_kv(cache.device_pool, h.page_table(), seq(900, 6), 0, 6 * P)  # overwrite
    cache.release(h)
    serve(cache, gate, a)  # from A's host copy: intact
    assert cache.stats()["host_hit_tokens"] == len(a)
    gate.settle()


def test_backup_never_reads_device_pages_before_the_compute_that_writes_them(gated):
    """On CUDA the compute stream is held, then writes A's KV (a device-to-device copy,
    so the host does not wait for it): the backup, submitted at insert on its own
    stream, must wait for that write (the compute fence), not read the stale KV."""
    cache, gate = gated()
    pool = cache.device_pool
    a = seq(100, 3)
    h = cache.match(a)
    cache.alloc(h, len(a))
    kvcheck.write_kv(pool, h.page_table(), a, 0, len(a))
    computed = [b.clone() for b in pool.k_buffers + pool.v_buffers]
    kvcheck.write_kv(pool, h.page_table(), seq(700, 3), 0, len(a))  # stale
    if gate.device == "cuda":
        stall_stream(torch.cuda.current_stream(), HOLD_S[BACKUP])
    for buf, kv in zip(pool.k_buffers + pool.v_buffers, computed, strict=True):
        buf.copy_(kv)  # "the forward": queued behind the hold on CUDA
    cache.insert(h, a)
    (backup,) = gate.pending(BACKUP)
    cache.release(h)
    gate.complete(BACKUP)
    assert backup.error is None
    evict_all_device(cache, gate)
    serve(cache, gate, a)  # from the host copy: A's KV, not the stale one
    assert cache.stats()["host_hit_tokens"] == len(a)
    gate.settle()


def test_write_back_chain_never_frees_host_pages_being_loaded(gated):
    cache, gate = gated(device_pages=6, host_pages=6, policy="write_back")
    a, e = seq(100, 4), seq(200, 2)
    serve(cache, gate, a)
    serve(cache, gate, e)
    evict_all_device(cache, gate)
    gate.complete(BACKUP)
    evict_all_device(cache, gate)
    h = cache.match(a)  # load of A in flight
    (load,) = gate.pending(LOAD)
    a_host = set(load.host_pages.tolist())
    serve(cache, gate, seq(300, 2))  # device full: A (loading) + B
    assert gate.in_flight(load)
    hc = cache.match(seq(400, 2))
    # Evicts B -> backup of B -> host eviction, which must take E's host pages, never
    # A's (still being read by the load); then waits for what is in flight.
    cache.alloc(hc, 2 * P)
    backup = gate.submitted[-1]
    assert backup.kind is BACKUP and a_host.isdisjoint(backup.host_pages.tolist())
    assert cache.stats()["host_evicted_tokens"] == len(e)
    gate.complete(BACKUP)
    cache.release(hc)
    hc = cache.match(seq(400, 2))
    got = cache.alloc(hc, 2 * P)
    kvcheck.write_kv(cache.device_pool, got, seq(400, 2), 0, 2 * P)
    gate.complete(LOAD)
    assert cache.finish_loads(h)
    verify_prefix(cache, h, a)
    cache.release(h)
    cache.release(hc)
    gate.settle()


def test_release_while_load_in_flight_keeps_the_load_safe(gated):
    """An aborted request's load still writes A's device pages: an allocation that needs
    them waits for the load to land before evicting A, so the load cannot overwrite
    what the new owner writes."""
    cache, gate = gated(device_pages=6)
    a = seq(100, 3)
    host_only(cache, gate, a)
    h = cache.match(a)
    (load,) = gate.pending(LOAD)
    cache.release(h)  # the request is aborted; its load is still copying
    cache.check_integrity()
    assert gate.in_flight(load)
    other = cache.match(seq(500, 6))
    got = cache.alloc(other, 6 * P)
    assert load.done() and set(load.device_pages.tolist()) <= set(got.tolist())
    kvcheck.write_kv(cache.device_pool, other.page_table(), seq(500, 6), 0, 6 * P)
    # the new owner's KV, not the late load's
    assert kvcheck.verify_kv(cache.device_pool, other.page_table(), seq(500, 6), 6 * P) == []
    cache.release(other)
    cache.check_integrity()
    serve(cache, gate, a)  # A again, from its host copy
    assert cache.stats()["host_hit_tokens"] == 2 * len(a)
    gate.settle()


def test_release_then_failed_load_leaks_nothing(gated):
    cache, gate = gated(device_pages=6)
    a = seq(100, 3)
    host_only(cache, gate, a)
    gate.fail_next(LOAD)
    h = cache.match(a)
    cache.release(h)
    gate.complete(LOAD)
    m = cache.tree.match_prefix(a)
    assert (m.device_len, m.host_len) == (0, len(a)), "a failed load must leave A host-only"
    gate.settle()


def test_split_while_a_load_is_in_flight(gated):
    cache, gate = gated()
    a = seq(100, 4)
    host_only(cache, gate, a)
    h1 = cache.match(a)
    (load,) = gate.pending(LOAD)
    h2 = cache.match(a[: 2 * P] + [9, 9])  # splits A inside the load's node
    assert cache.tree.num_nodes == 2 and h2.prefix_len == 2 * P
    cache.check_integrity()
    assert gate.in_flight(load)
    gate.complete(LOAD)
    for h, t in ((h1, a), (h2, a[: 2 * P] + [9, 9])):
        assert cache.finish_loads(h)
        verify_prefix(cache, h, t)
        cache.release(h)
    gate.settle()


def test_split_while_a_backup_is_in_flight(gated):
    cache, gate = gated()
    a = seq(100, 4)
    serve(cache, gate, a)
    (backup,) = gate.pending(BACKUP)
    h2 = cache.match(a[:P] + [9, 9])  # splits A while its backup copies
    cache.check_integrity()
    assert gate.in_flight(backup)
    gate.complete(BACKUP)
    cache.release(h2)
    gate.settle()
    assert cache.tree.host_tokens == len(a)


def test_insert_over_a_node_being_loaded_reads_it_only_after_the_load(gated):
    """h2 computed A itself; its insert dedups onto A's pages, still being loaded: h2's
    reads of them must come after the load (on CUDA: queued behind the layer events)."""
    cache, gate = gated()
    a = seq(100, 3)
    t2 = a + seq(50, 1)
    h2 = cache.match(t2)  # before A exists: nothing matched
    host_only(cache, gate, a)
    h1 = cache.match(a)
    (load,) = gate.pending(LOAD)
    cache.alloc(h2, len(t2))
    kvcheck.write_kv(cache.device_pool, h2.page_table(), t2, 0, len(t2))
    cache.insert(h2, t2)
    assert gate.in_flight(load)
    if gate.device == "cuda":  # the host does not wait: the reads queue behind the load
        verify_prefix(cache, h2, t2)
    gate.complete(LOAD)
    verify_prefix(cache, h2, t2)
    for h in (h1, h2):
        cache.release(h)
    gate.settle()
