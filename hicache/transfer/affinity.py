"""Which CPUs a copy thread may use without taking a core from compute threads.

An engine that binds its compute threads one per core (vLLM's CPU worker does) leaves
the thread that calls :func:`spare_cpus` bound to those cores, and keeps others free
for its scheduler and for KV transfers. A copy thread belongs on those: on a compute
core it can only preempt a compute thread. This module reads Linux's CPU topology
(``/sys/devices/system``) and knows nothing of transfers.
"""

from __future__ import annotations

import os
from pathlib import Path

SYSFS = Path("/sys/devices/system")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as ``"0-3,8,10-11"``."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cpu list: expected ranges like '0-3,8', got {text!r}") from None
        cpus.update(range(first, last + 1))
    return cpus


def spare_cpus(own: set[int] | None = None, *, sysfs: Path = SYSFS) -> frozenset[int]:
    """The online CPUs on the NUMA nodes of ``own`` (default: the calling thread's
    affinity) that are neither in ``own`` nor SMT siblings of a CPU in it.

    Empty where the thread may run on every online CPU, where the topology cannot be
    read, or where threads cannot be pinned (no ``os.sched_getaffinity``).
    """
    if own is None:
        if not hasattr(os, "sched_getaffinity"):
            return frozenset()
        own = os.sched_getaffinity(0)
    online = _read(sysfs / "cpu" / "online")
    if not online:
        return frozenset()
    spare = online - own
    nodes = [_read(p / "cpulist") for p in sorted((sysfs / "node").glob("node[0-9]*"))]
    nodes = [n for n in nodes if n]
    if len(nodes) > 1:  # other NUMA nodes compute for other workers
        spare &= set().union(*(n for n in nodes if n & own))
    for cpu in own:
        spare -= _read(sysfs / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list")
    return frozenset(spare)


def _read(path: Path) -> set[int]:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return set()
