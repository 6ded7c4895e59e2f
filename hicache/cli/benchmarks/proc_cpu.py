"""CPU seconds of a process tree, per process name, from Linux's ``/proc``.

``hicache bench vllm`` runs each configuration's engine in processes of vLLM's own
(the engine core, its workers). On a machine whose cores are shared, wall times move
with what else runs; the CPU seconds each process used do not (much). Read before and
after the measured replay, their differences say what each process spent on it.
Linux only: elsewhere every function returns nothing.
"""

from __future__ import annotations

import os

FRONT_END = "front end"  # the reading process itself (vLLM's AsyncLLM runs in it)


def _stat(pid: int | str) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds: user + system) of one process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # gone meanwhile, or no /proc
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
    ticks = int(fields[11]) + int(fields[12])  # fields 14 and 15: utime, stime
    return name, int(fields[1]), ticks / os.sysconf("SC_CLK_TCK")


def cpu_seconds_by_name(root: int | None = None) -> dict[str, float]:
    """CPU seconds so far of ``root`` (default: this process, named :data:`FRONT_END`)
    and of every process below it, summed per process name (vLLM names its processes,
    e.g. ``VLLM::EngineCor``, ``VLLM::Worker``)."""
    root = os.getpid() if root is None else root
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    stats = {int(p): s for p in pids if (s := _stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid not in stats:
            continue
        name = FRONT_END if pid == root else stats[pid][0]
        out[name] = out.get(name, 0.0) + stats[pid][2]
    return out


def cpu_seconds_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` per name (a process started in between counts from zero)."""
    return {name: round(after[name] - before.get(name, 0.0), 2) for name in after}
