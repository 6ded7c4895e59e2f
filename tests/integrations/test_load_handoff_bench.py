"""bench/load_handoff.py: the worker half's start_loads timed alone (a subprocess: the
script pins its thread to CPU 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "load_handoff.py"

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0) & {0, 1}) < 2,
    reason="needs CPUs 0 and 1")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.parametrize("executor", ["thread", "manual"])
def test_each_load_is_timed_and_the_last_line_is_json(executor):
    proc = _run("--executor", executor, "--loads", "3", "--blocks", "2", "--forward-ms", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["executor"] == executor and out["loads"] == 3 and out["blocks"] == 2
    # 2 blocks of medium KV: 8 layers x 12 heads x 32 tokens x 128 floats x 4 bytes each
    assert out["load_nbytes"] == 2 * 8 * 12 * 32 * 128 * 4
    assert 0 < out["start_loads_median_ms"] <= out["start_loads_max_ms"]
    assert out["start_loads_cpu_median_ms"] > 0
    assert "start_loads of 3.0 MiB, 3 loads" in proc.stderr


def test_bad_arguments_are_one_usage_error():
    proc = _run("--blocks", "0")
    assert proc.returncode == 2
    assert "expected --loads >= 1, 1 <= --blocks <= 148, --forward-ms >= 0, got 60, 0, 20.0" \
        in proc.stderr
