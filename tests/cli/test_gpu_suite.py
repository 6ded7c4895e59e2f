"""bench/gpu_suite.py, the runner of the one run a GPU machine gets: budget, timeouts,
results written whatever happens. (CI runs the whole script on a CPU: .ci/run.)"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_suite.py"


@pytest.fixture(scope="module")
def gpu_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_suite"]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_step_past_its_timeout_is_killed_with_its_children_and_recorded(gpu_suite, tmp_path):
    suite = gpu_suite.Suite(tmp_path, 60, sys.executable)
    script = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              "print('child', p.pid, flush=True); time.sleep(60)")
    record = suite.run(gpu_suite.Step("slow", ["PY", "-c", script], timeout_s=1.5, min_s=0))
    assert record["status"] == "timeout" and record["timed_out"] and suite.failed
    child = int(next(line for line in record["tail"] if line.startswith("child")).split()[1])
    assert gone(child), "the step's child outlived the step"
    # Written as it went: the summary and the log already hold the step.
    assert [s["status"] for s in summary(tmp_path)["steps"]] == ["timeout"]
    assert "child" in (tmp_path / "suite.log").read_text()
    after = suite.run(gpu_suite.Step("next", ["PY", "-c", "print('ran')"], 30, min_s=0))
    assert after["status"] == "ok" and after["tail"] == ["ran"]
    suite.close()


def test_budget_bounds_each_step_and_a_spent_budget_skips(gpu_suite, tmp_path):
    suite = gpu_suite.Suite(tmp_path, 8, sys.executable)  # 8 s, 5 kept for the summary
    start = time.monotonic()
    record = suite.run(gpu_suite.Step("long", ["PY", "-c", "import time; time.sleep(60)"], 600,
                                      min_s=0))
    assert record["status"] == "timeout" and time.monotonic() - start < 10
    skipped = suite.run(gpu_suite.Step("late", ["PY", "-c", "pass"], 60, min_s=10))
    assert skipped == {"status": "skipped"}
    steps = summary(tmp_path)["steps"]
    assert steps[-1]["status"] == "skipped" and "budget spent" in steps[-1]["reason"]
    suite.close()


def test_a_bench_step_needs_a_json_last_line(gpu_suite, tmp_path):
    suite = gpu_suite.Suite(tmp_path, 60, sys.executable)
    ok = suite.run(gpu_suite.Step("b1", ["PY", "-c", "print('table'); print('{\"x\": 1}')"], 30,
                                  min_s=0, bench=True))
    assert ok["status"] == "ok" and ok["result"] == {"x": 1} and not suite.failed
    bad = suite.run(gpu_suite.Step("b2", ["PY", "-c", "print('no json')"], 30, min_s=0,
                                   bench=True))
    assert bad["status"] == "failed" and "JSON" in bad["error"] and suite.failed
    (tmp_path / "soft").mkdir()
    soft = gpu_suite.Suite(tmp_path / "soft", 60, sys.executable)
    rec = soft.run(gpu_suite.Step("n", ["PY", "-c", "raise SystemExit(3)"], 30, min_s=0,
                                  fatal=False))
    assert rec["status"] == "failed" and not soft.failed  # recorded, not the run's failure
    suite.close()
    soft.close()


def test_command_line_errors_exit_2(gpu_suite, monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_suite.main([]) == 2
    assert "expected an output folder" in capsys.readouterr().err
    assert gpu_suite.main(["/tmp/x", "--budget-s", "0"]) == 2
    assert "--budget-s: expected > 0, got 0.0" in capsys.readouterr().err
