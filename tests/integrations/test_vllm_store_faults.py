"""The third tier's injected faults (``HICACHE_FAULTS``: ``write=``, ``hang_after=``,
``hang_ms=``), on a backend that records its calls and a clock the test moves. Needs no
vLLM: the worker half's fault wrappers import none."""

from __future__ import annotations

import pytest

from hicache.integrations.vllm.worker import faults
from hicache.integrations.vllm.worker.faults import FaultRates, FaultyBackend


class Recorder:
    """A backend: every call recorded, every page read or written."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def get_into(self, keys, views) -> int:
        self.calls.append(("get_into", list(keys)))
        return len(keys)

    def set(self, keys, values) -> int:
        self.calls.append(("set", list(keys)))
        return len(keys)

    def exists(self, keys) -> int:
        return 0


class Clock:
    """``time.monotonic`` and ``time.sleep`` of the faults module: sleeping moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(faults, "time", c)
    return c


def test_parse_reads_the_store_knobs():
    assert FaultRates.parse("read=0.2,write=0.3,hang_after=5,hang_ms=3000,seed=4") == \
        FaultRates(read=0.2, write=0.3, hang_after=5, hang_ms=3000, seed=4)


def test_writes_fail_at_the_rate_and_reads_are_untouched():
    inner = Recorder()
    backend = FaultyBackend(inner, FaultRates(write=1.0))
    with pytest.raises(OSError, match="injected storage write failure"):
        backend.set(["a"], [b"x"])
    assert backend.get_into(["a"], [bytearray(1)]) == 1
    assert inner.calls == [("get_into", ["a"])]  # the failed write reached nothing
    assert backend.exists(["a"]) == 0  # the rest passes through


def test_write_failures_are_a_seeded_fraction():
    def failures(seed: int) -> list[bool]:
        backend = FaultyBackend(Recorder(), FaultRates(write=0.5, seed=seed))
        out = []
        for i in range(64):
            try:
                backend.set([str(i)], [b""])
                out.append(False)
            except OSError:
                out.append(True)
        return out

    assert failures(1) == failures(1)
    assert 10 < sum(failures(1)) < 54


def test_the_store_hangs_once_from_its_nth_call_then_recovers(clock):
    inner = Recorder()
    backend = FaultyBackend(inner, FaultRates(hang_after=2, hang_ms=3000))
    backend.set(["a"], [b""])
    backend.get_into(["a"], [bytearray(1)])
    assert clock.sleeps == []  # calls 0 and 1: before the hang
    backend.set(["b"], [b""])  # call 2 starts a 3 s hang and waits it out
    assert clock.sleeps == [3.0]
    clock.now -= 1.0  # a call that came 1 s before that hang ended (another thread)...
    backend.get_into(["b"], [bytearray(1)])
    assert clock.sleeps == [3.0, 1.0]  # ...waits for the rest of it
    backend.set(["c"], [b""])
    backend.get_into(["c"], [bytearray(1)])
    assert clock.sleeps == [3.0, 1.0]  # recovered: one hang only
    assert [c[0] for c in inner.calls] == ["set", "get_into", "set", "get_into", "set",
                                           "get_into"]  # every call went through in the end


def test_no_hang_unless_asked(clock):
    backend = FaultyBackend(Recorder(), FaultRates(read=0.0, hang_after=0))
    for _ in range(5):
        backend.set(["a"], [b""])
    assert clock.sleeps == []
