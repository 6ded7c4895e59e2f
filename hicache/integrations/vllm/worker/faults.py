"""Fault injection for the connector's worker half: for tests, off unless asked for.

``HICACHE_FAULTS`` in a worker's environment (vLLM's worker processes inherit it)
makes a random fraction of the worker's copies and third-tier reads fail, the way a
broken device, a full disk or a flaky store would::

    HICACHE_FAULTS="load=0.2,save=0.1,read=0.2,seed=1"
    HICACHE_FAULTS="read_delay_ms=5"
    HICACHE_FAULTS="write_delay_ms=50"
    HICACHE_FAULTS="read=0.2,write=0.2,hang_after=50,hang_ms=3000"

``load``/``save``: the fraction of host -> block / block -> host copies that raise
(CPU executors: the CUDA executor copies on its own streams); ``read``/``write``: the
fraction of third-tier reads / writes that raise; ``rank=N``: only tensor-parallel
rank ``N`` fails (default: every rank, each with the same seed); ``read_delay_ms``:
every third-tier read takes this many milliseconds more per page (a slow store, for
benchmarks of the prefetch); ``write_delay_ms``: the same for third-tier writes (a
prefill instance whose pages land after its answer, for the hand-off's tests);
``hang_ms``: the store hangs once, for this long, from its ``hang_after``-th call on
(reads and writes counted from 0; default 0, the first): every read or write in that
window waits until the window ends, then the store works again (a stalled network
store or disk that recovers; ``hicache bench soak``). Each injected failure is logged
at WARNING (``hicache faults: injected ...``). Nothing here is used unless the
variable is set.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass

_log = logging.getLogger(__name__)

ENV = "HICACHE_FAULTS"


@dataclass(frozen=True)
class FaultRates:
    load: float = 0.0
    save: float = 0.0
    read: float = 0.0
    seed: int = 0
    rank: int | None = None  # only this tensor-parallel rank injects (None: every rank)
    read_delay_ms: int = 0  # added to every third-tier read, per page
    write_delay_ms: int = 0  # added to every third-tier write, per page
    write: float = 0.0
    hang_after: int = 0  # the store's hang starts at this call (reads and writes, from 0)
    hang_ms: int = 0  # and lasts this long (0: no hang)

    @classmethod
    def parse(cls, text: str) -> FaultRates:
        """``"load=0.2,save=0.1,read=0.2,seed=1,rank=0"`` (any subset); a bad entry is a
        ValueError naming it."""
        values: dict[str, float | int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in _NAMES:
                raise ValueError(f"{ENV}: expected {', '.join(n + '=' for n in _NAMES)} "
                                 f"entries, got {item!r}")
            integer = name in _INTEGERS
            try:
                number = int(value) if integer else float(value)
            except ValueError:
                raise ValueError(f"{ENV}: {name}: expected a number, got {value!r}") from None
            if name in _LIMITS and not 0 <= number <= _LIMITS[name]:
                raise ValueError(f"{ENV}: {name}: expected 0 to {_LIMITS[name]}, got {value}")
            if not integer and not 0.0 <= number <= 1.0:
                raise ValueError(f"{ENV}: {name}: expected a fraction in [0, 1], got {value}")
            values[name] = number
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, rank: int = 0) -> FaultRates | None:
        """The rates for tensor-parallel rank ``rank`` (None: this rank injects nothing)."""
        text = os.environ.get(ENV)
        rates = cls.parse(text) if text else None
        return None if rates is None or rates.rank not in (None, rank) else rates


_NAMES = ("load", "save", "read", "write", "read_delay_ms", "write_delay_ms", "hang_after",
          "hang_ms", "seed", "rank")
_INTEGERS = ("seed", "rank", "read_delay_ms", "write_delay_ms", "hang_after", "hang_ms")
_LIMITS = {"read_delay_ms": 60_000, "write_delay_ms": 60_000, "hang_after": 10**9,
           "hang_ms": 600_000}


class FaultyCopier:
    """A block copier (``load`` / ``backup`` of a layer range) whose copies fail at the
    given rates; a copy fails as a whole, at its first layer range. Loads and saves draw
    from streams of their own: which loads fail does not depend on how many saves came
    first (nor on when a background read let a request in)."""

    def __init__(self, inner, rates: FaultRates) -> None:
        self.inner = inner
        self.rates = rates
        self._rngs = {"load": random.Random(rates.seed), "save": random.Random(rates.seed + 2)}

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    def _fail(self, rate: float, what: str, first: int) -> None:
        if first == 0 and rate and self._rngs[what].random() < rate:
            _log.warning("hicache faults: injected %s failure", what)
            raise RuntimeError(f"injected {what} failure")

    def load(self, host_ids, block_ids, first: int, last: int) -> None:
        self._fail(self.rates.load, "load", first)
        self.inner.load(host_ids, block_ids, first, last)

    def backup(self, block_ids, host_ids, first: int, last: int) -> None:
        self._fail(self.rates.save, "save", first)
        self.inner.backup(block_ids, host_ids, first, last)


class FaultyBackend:
    """A storage backend whose ``get_into`` fails at ``rates.read`` and takes
    ``rates.read_delay_ms`` more per page, whose ``set`` fails at ``rates.write`` and
    takes ``rates.write_delay_ms`` more per page, and that hangs once for
    ``rates.hang_ms`` (reads and writes wait)."""

    def __init__(self, inner, rates: FaultRates) -> None:
        self.inner = inner
        self.rates = rates
        self._rng = random.Random(rates.seed + 1)
        self._write_rng = random.Random(rates.seed + 3)
        self._lock = threading.Lock()  # the reader and the writer thread both call
        self._num_calls = 0
        self._hang_until: float | None = None  # time.monotonic() the hang ends

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _hang(self) -> None:
        if not self.rates.hang_ms:
            return
        with self._lock:
            if self._hang_until is None and self._num_calls >= self.rates.hang_after:
                self._hang_until = time.monotonic() + self.rates.hang_ms / 1000
                _log.warning("hicache faults: injected a store hang of %d ms", self.rates.hang_ms)
            self._num_calls += 1
            until = self._hang_until
        delay = 0.0 if until is None else until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def get_into(self, keys, views):
        self._hang()
        if self.rates.read_delay_ms:
            time.sleep(self.rates.read_delay_ms * len(keys) / 1000)
        if self.rates.read and self._rng.random() < self.rates.read:
            _log.warning("hicache faults: injected storage read failure")
            raise OSError("injected storage read failure")
        return self.inner.get_into(keys, views)

    def set(self, keys, values):
        self._hang()
        if self.rates.write_delay_ms:
            time.sleep(self.rates.write_delay_ms * len(keys) / 1000)
        if self.rates.write and self._write_rng.random() < self.rates.write:
            _log.warning("hicache faults: injected storage write failure")
            raise OSError("injected storage write failure")
        return self.inner.set(keys, values)
