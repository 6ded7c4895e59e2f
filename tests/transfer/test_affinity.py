"""spare_cpus: the cores a copy thread may use without taking one from compute threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hicache.transfer.affinity import (
    bound_cpus,
    io_cpus,
    parse_cpu_list,
    spare_cpus,
    thread_masks,
    threads_start_on,
)


def fake_sysfs(root: Path, online: str, nodes: list[str], siblings: dict[int, str]) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "online").write_text(online + "\n")
    for cpu, text in siblings.items():
        d = root / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    for i, text in enumerate(nodes):
        d = root / "node" / f"node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(text + "\n")
    return root


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == set()
    with pytest.raises(ValueError, match="cpu list: expected ranges like '0-3,8', got 'x'"):
        parse_cpu_list("x")


def test_the_cores_vllm_reserved_are_spare(tmp_path):
    # 4 cores, no SMT: vLLM computes on 0-2 and keeps 3 for its scheduler.
    sysfs = fake_sysfs(tmp_path, "0-3", ["0-3"], {c: str(c) for c in range(4)})
    assert spare_cpus({0, 1, 2}, sysfs=sysfs) == {3}
    assert spare_cpus({0, 1, 2, 3}, sysfs=sysfs) == frozenset()  # bound nowhere: none


def test_smt_siblings_and_other_numa_nodes_are_not_spare(tmp_path):
    # 2 nodes of 2 cores x 2 threads: cpu c and c+4 share a core; node 0 = 0,1,4,5.
    siblings = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}
    sysfs = fake_sysfs(tmp_path, "0-7", ["0-1,4-5", "2-3,6-7"], siblings)
    # Rank 0 computes on cpu 0: its sibling 4 shares the core, node 1 is rank 1's.
    assert spare_cpus({0}, sysfs=sysfs) == {1, 5}
    assert spare_cpus({0, 1}, sysfs=sysfs) == frozenset()


def test_unreadable_topology_means_no_spare_cpus(tmp_path):
    assert spare_cpus({0}, sysfs=tmp_path / "missing") == frozenset()


def test_compute_cores_are_the_bound_threads_cores():
    # vLLM computes on cores 0 and 1 of 4, an OpenMP thread bound to each; the others
    # (Python's, gloo's) may run anywhere: cores 2 and 3 are spare.
    assert bound_cpus([{0, 1, 2, 3}, {0}, {1}, {0, 1, 2, 3}]) == {0, 1}
    # A worker process confined to core 0 as a whole: every thread there.
    assert bound_cpus([{0}, {0}]) == {0}
    # Nothing bound: every CPU counts as taken, none is spare.
    assert bound_cpus([{0, 1}, {0, 1}]) == {0, 1}
    assert bound_cpus([]) == set()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
def test_thread_masks_of_this_process():
    masks = thread_masks()
    assert os.sched_getaffinity(0) in masks
    assert len(masks) >= threading.active_count()


def test_io_threads_go_to_every_cpu_of_the_compute_nodes(tmp_path):
    """Spare cores included, the compute cores too: the OS places them (a spare core may
    be another instance's compute core)."""
    # 4 cores on 2 NUMA nodes
    sysfs = fake_sysfs(tmp_path, "0-3", ["0-1", "2-3"], {c: str(c) for c in range(4)})
    if not hasattr(os, "sched_setaffinity"):
        assert io_cpus(sysfs=sysfs) is None
        return
    own = bound_cpus(thread_masks())
    expected = {0, 1} if own <= {0, 1} else {2, 3} if own <= {2, 3} else {0, 1, 2, 3}
    assert io_cpus(sysfs=sysfs) == expected
    # Topology unreadable: wherever this process's threads may run.
    assert io_cpus(sysfs=tmp_path / "none") == set().union(*thread_masks())


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity and 2 CPUs")
def test_threads_started_inside_start_on_the_cpus_and_the_caller_is_put_back(caplog):
    allowed = os.sched_getaffinity(0)
    first, last = min(allowed), max(allowed)
    seen: list[set[int]] = []

    def start_one() -> None:
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()

    os.sched_setaffinity(0, {first})
    try:
        with threads_start_on(frozenset({last})):
            start_one()
        inside_none = os.sched_getaffinity(0)
        with threads_start_on(None):  # nothing known: nothing changes
            start_one()
        with threads_start_on(frozenset({4095})):  # refused by the kernel: logged, unchanged
            start_one()
        after = os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, allowed)
    assert seen == [{last}, {first}, {first}]
    assert inside_none == after == {first}
    assert "not [4095]" in caplog.text
