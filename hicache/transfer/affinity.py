"""Which CPUs a copy thread may use without taking a core from compute threads.

An engine that binds its compute threads one per core (vLLM's CPU worker does: one
OpenMP thread per core of its list) keeps other cores free for its scheduler and for
KV transfers. A copy thread belongs on those: on a compute core it can only preempt a
compute thread. The compute cores are found from the threads of this process: those
bound to fewer CPUs than the process may use. This module reads Linux's ``/proc`` and
CPU topology (``/sys/devices/system``) and knows nothing of transfers.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

_log = logging.getLogger(__name__)

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


def bound_cpus(masks: list[set[int]]) -> set[int]:
    """The CPUs compute threads are bound to, from every thread's affinity ``masks``: the
    union of the masks narrower than the widest (the process's), or that widest one
    where no thread is bound (then nothing is spare)."""
    allowed = set().union(*masks) if masks else set()
    bound = [m for m in masks if m != allowed]
    return set().union(*bound) if bound else allowed


def thread_masks() -> list[set[int]]:
    """The affinity of every thread of this process (empty where it cannot be read)."""
    masks = []
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
    for tid in tids:
        try:
            masks.append(set(os.sched_getaffinity(tid)))
        except OSError:  # the thread exited meanwhile
            continue
    return masks


def io_cpus(*, sysfs: Path = SYSFS) -> frozenset[int] | None:
    """Where background IO threads (third-tier reads and writes, a storage client's own)
    belong: every online CPU on the NUMA nodes of the compute cores (the kernel leaves
    out those outside the process's cpuset), for the OS to place. A thread started by
    a compute thread inherits its one core and waits behind it there; vLLM's CPU worker
    also spins on that core between steps. Not the spare cores alone: they may be
    another instance's compute cores (two vLLM servers on 2 cores, each bound to one:
    each one's IO threads would wait behind the other's spinning runner).
    None where affinity cannot be read or set: leave the threads as they are."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    masks = thread_masks()
    cpus = _read(sysfs / "cpu" / "online") or set().union(*masks)
    own = bound_cpus(masks)
    if own:
        cpus = _on_nodes_of(own, cpus, sysfs)
    return frozenset(cpus) or None


@contextlib.contextmanager
def threads_start_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Inside, threads the calling thread starts (Python's, or a native library's own
    pools) are started on ``cpus``: a new thread inherits its creator's affinity, so the
    calling thread is moved there meanwhile and put back after. A storage client opened
    by vLLM's model runner would otherwise start its threads on the one core the runner
    is bound to (and spins on between steps). Nothing changes for None, or where the
    affinity cannot be set (logged)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        _log.warning("hicache: threads started here stay on CPUs %s, not %s (%s)",
                     sorted(before), sorted(cpus), e)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def spare_cpus(own: set[int] | None = None, *, sysfs: Path = SYSFS) -> frozenset[int]:
    """The online CPUs on the NUMA nodes of ``own`` that are neither in ``own`` nor SMT
    siblings of a CPU in it. ``own`` defaults to the cores this process's compute
    threads are bound to (:func:`bound_cpus` of :func:`thread_masks`): call it once the
    engine has bound them (vLLM: when the KV caches are registered).

    Empty where the process may use every online CPU and none of its threads is bound,
    where the topology cannot be read, or where threads cannot be pinned (no
    ``os.sched_getaffinity``). A process confined to some CPUs (taskset, a container's
    cpuset) with no thread bound gets the CPUs outside its reach: pinning a thread
    there fails (:class:`~hicache.transfer.executors.ThreadExecutor` says so).
    """
    if own is None:
        if not hasattr(os, "sched_getaffinity"):
            return frozenset()
        own = bound_cpus(thread_masks())
        if not own:
            return frozenset()
    online = _read(sysfs / "cpu" / "online")
    if not online:
        return frozenset()
    spare = _on_nodes_of(own, online - own, sysfs)
    for cpu in own:
        spare -= _read(sysfs / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list")
    return frozenset(spare)


def _on_nodes_of(own: set[int], cpus: set[int], sysfs: Path) -> set[int]:
    """``cpus`` on the NUMA nodes of ``own`` (all of them with one node or none readable:
    other nodes compute for other workers)."""
    nodes = [_read(p / "cpulist") for p in sorted((sysfs / "node").glob("node[0-9]*"))]
    nodes = [n for n in nodes if n]
    if len(nodes) > 1:
        cpus = cpus & set().union(*(n for n in nodes if n & own))
    return cpus


def _read(path: Path) -> set[int]:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return set()
