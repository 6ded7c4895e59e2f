"""proc_cpu: CPU seconds of a process tree from /proc, per process name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache.cli.benchmarks.proc_cpu import FRONT_END, cpu_seconds_by_name, cpu_seconds_since

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def test_a_busy_child_is_counted_under_its_name_and_the_reader_as_front_end():
    before = cpu_seconds_by_name()
    # a child that burns ~0.3 s of CPU, then sleeps so that it is still there when read
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\n"
                              "print('done', flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        spent = cpu_seconds_since(before, cpu_seconds_by_name())
        name = open(f"/proc/{child.pid}/comm").read().strip()
        assert 0.25 <= spent[name] <= 5.0  # clock ticks: 10 ms; the interpreter's start-up
        assert FRONT_END in spent and spent[FRONT_END] >= 0.0
        # a process that is not a descendant is not counted
        assert cpu_seconds_by_name(child.pid) == {FRONT_END: pytest.approx(spent[name],
                                                                           abs=0.05)}
    finally:
        child.kill()
        child.wait()


def test_differences_count_new_processes_from_zero():
    assert cpu_seconds_since({"a": 1.0}, {"a": 3.5, "b": 2.0}) == {"a": 2.5, "b": 2.0}
    assert cpu_seconds_by_name(2**22 + 12345) == {}  # no such process
