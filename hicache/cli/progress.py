"""Progress of the commands that run a workload through several configurations.

:class:`ProgressBar` is the ``progress`` callback of
:func:`hicache.cli.benchmarks.multiturn_runs.run_configs` (``hicache demo``, ``hicache
bench multiturn``): a tqdm bar per configuration on a terminal, one line per finished
configuration elsewhere.
"""

from __future__ import annotations

import time
from typing import TextIO

from tqdm import tqdm

from hicache.sim.engine import GenerateResult


class ProgressBar:
    """A tqdm bar per configuration on a terminal; off a terminal (a log, a pipe) only
    one finished line per configuration, so logs stay one line per configuration."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.live = out.isatty()
        self._bar: tqdm | None = None
        self._start = time.perf_counter()

    def update(self, name: str, done: int, result: GenerateResult) -> None:
        if done == 1:
            self._start = time.perf_counter()
            self._bar = tqdm(total=self.total, desc=f"  {name:<13}", unit="req", file=self.out,
                             disable=not self.live, leave=True, dynamic_ncols=True)
        assert self._bar is not None
        self._bar.set_postfix_str(f"TTFT {result.ttft_s * 1e3:7.1f} ms", refresh=False)
        self._bar.update(1)
        if done == self.total:
            self._bar.close()
            if not self.live:
                print(f"  {name:<13} {done:>4}/{self.total} requests  "
                      f"{time.perf_counter() - self._start:6.1f} s", file=self.out, flush=True)
