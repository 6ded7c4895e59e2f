"""``hicache stress`` end to end: concurrent requests, random delays and faults, real KV.

The default runs take ~25 s in all; the 10-minute soak is marked ``slow``
(``pytest -m slow tests/sim/test_stress.py``).
"""

from __future__ import annotations

import json

import pytest

from hicache.cli import main
from hicache.sim.stress import StressOptions, StressRun

KEYS = {
    "requests", "loads", "backups", "evictions_blocked_by_io", "faults_injected",
    "corruptions", "leaked_pages", "invariant_violations", "errors",
}


def stress(capsys, *args: str) -> dict:
    rc = main(["stress", "--json", *args])
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert KEYS <= report.keys()
    assert rc == 0, report
    return report


def assert_clean(report: dict) -> None:
    assert report["corruptions"] == 0, report
    assert report["leaked_pages"] == 0, report
    assert report["invariant_violations"] == 0, report
    assert report["errors"] == 0, report


@pytest.mark.parametrize(
    "policy, seconds, seed",
    [("write_through", 8, 1), ("write_back", 7, 2), ("write_through_selective", 4, 3)],
)
def test_stress_exercises_the_races_and_finds_nothing(capsys, policy, seconds, seed):
    report = stress(capsys, "--seconds", str(seconds), "--seed", str(seed),
                    "--write-policy", policy)
    assert_clean(report)
    assert report["loads"] > 0 and report["backups"] > 0, "no IO: the races were not exercised"
    assert report["faults_injected"] > 0
    assert report["loads_failed"] + report["backups_failed"] == report["faults_injected"]
    # write_through_selective: few backups, so IO rarely meets an eviction. write_back:
    # its backups start inside an eviction, and an allocation whose pages are still
    # being backed up is refused by the up-front check (a refused allocation evicts
    # nothing), so later evictions rarely find an idle leaf with IO in flight.
    if policy == "write_through":
        assert report["evictions_blocked_by_io"] > 0, "eviction never met IO in flight"


def test_stress_without_faults_or_delays(capsys):
    report = stress(capsys, "--seconds", "2", "--seed", "4", "--fault-rate", "0",
                    "--max-delay-ms", "0", "--eviction", "lru")
    assert_clean(report)
    assert report["faults_injected"] == 0 and report["loads_failed"] == 0
    assert report["requests"] > 0


def test_stress_human_table_then_json(capsys):
    rc = main(["stress", "--seconds", "1", "--seed", "5"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert out[0].split()[0] == "requests" and len(out) > len(KEYS)
    assert KEYS <= json.loads(out[-1]).keys()


def test_stress_run_without_the_command_line(capsys):
    """sim/ runs a stress run from its options alone and prints nothing itself."""
    report = StressRun(StressOptions(seconds=0.5, seed=6)).run()
    assert capsys.readouterr() == ("", "")
    assert_clean(report)
    assert report["requests"] > 0 and report["seconds"] == 0.5 and report["eviction"] == "lfu"


def test_stress_reports_an_unexpected_error_with_its_traceback(capsys, monkeypatch):
    real = StressRun._new_request
    calls = []

    def fail_once(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        real(self)

    monkeypatch.setattr(StressRun, "_new_request", fail_once)
    rc = main(["stress", "--json", "--seconds", "0.5", "--seed", "7"])
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and report["errors"] == 1, report
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err, err
    assert err.rstrip().endswith("error: RuntimeError: boom"), err  # then the problem lines


def test_stress_over_a_hybrid_layout_finds_nothing(capsys):
    """Window and state components: every window page and checkpoint a request reads
    is verified too, through loads, backups, faults and evictions."""
    report = stress(capsys, "--seconds", "6", "--seed", "1", "--components", "window:9,state")
    assert_clean(report)
    assert report["components"] == "window:9,state"
    assert report["loads"] > 0 and report["backups"] > 0 and report["faults_injected"] > 0
    assert report["verified_component_reads"] > 0


def test_stress_over_window_components_alone(capsys):
    """Two windows, no state: nothing to checkpoint, window pages verified."""
    report = stress(capsys, "--seconds", "3", "--seed", "2", "--components", "window:5,window:17")
    assert_clean(report)
    assert report["requests"] > 0 and report["verified_component_reads"] > 0


def test_stress_over_a_hybrid_layout_catches_a_wrong_checkpoint(monkeypatch):
    """The component checks can fail: checkpoints never written read as corrupt."""
    monkeypatch.setattr("hicache.sim.kvcheck.write_state", lambda *args: None)
    report = StressRun(StressOptions(seconds=1, seed=2, fault_rate=0,
                                     components="window:9,state")).run()
    assert report["corruptions"] > 0
    assert any("checkpoint" in line for line in report["first_problems"])


@pytest.mark.slow
def test_stress_soak_ten_minutes(capsys):
    report = stress(capsys, "--seconds", "600", "--seed", "1")
    assert_clean(report)
    assert report["loads"] > 0 and report["evictions_blocked_by_io"] > 0


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("seconds", 0, ValueError, "seconds: expected a finite number > 0, got 0"),
    ("seconds", "5", TypeError, "seconds: expected a number, got str"),
    ("seed", -1, ValueError, "seed: expected >= 0, got -1"),
    ("concurrency", 0, ValueError, "concurrency: expected >= 1, got 0"),
    ("device_pages", 2.0, TypeError, "device_pages: expected int, got float"),
    ("verify_every", True, TypeError, "verify_every: expected int, got bool"),
    ("fault_rate", 1.5, ValueError, r"fault_rate: expected a fraction in \[0, 1\], got 1.5"),
    ("max_delay_ms", float("nan"), ValueError, "max_delay_ms: expected a finite number >= 0"),
    ("components", "window", ValueError, "components: expected 'window:TOKENS"),
    ("components", ("state",), TypeError, "components: expected a text like 'window:9,state'"),
])
def test_stress_options_refuse_bad_values(field, value, error, message):
    """StressOptions is the harness's entry point without the command line: the same
    bounds as the command's options, one clear error naming the field."""
    with pytest.raises(error, match=message):
        StressOptions(**{field: value})
