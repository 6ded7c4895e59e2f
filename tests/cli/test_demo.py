"""`hicache demo` and `hicache bench multiturn` (which share the replay code), shrunk to
seconds: tiny preset, a handful of requests."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from optional import skip_unless

from hicache.cli import app as cli
from hicache.cli.benchmarks import multiturn

TINY_WORKLOAD = ["--preset", "tiny", "--sessions", "3", "--turns", "3", "--system-prompts", "2",
                 "--system-tokens", "96", "--first-turn-tokens", "48"]


@pytest.fixture(autouse=True)
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_demo_prints_table_and_conclusion(capsys):
    assert cli.main(["demo", *TINY_WORKLOAD]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in ("none", "device", "hierarchical"):
        assert any(line.startswith(f"  {name} ") and "9/9" in line for line in lines), out
        assert any(line.startswith(f"{name} ") for line in lines), out
    assert "all three configurations generated identical tokens" in out
    conclusion = next(line for line in lines if line.startswith("hierarchical: "))
    assert "lower mean TTFT than device-only" in conclusion
    assert "fewer tokens computed" in conclusion


def test_demo_runs_a_hybrid_model_with_identical_tokens(capsys):
    """tiny-hybrid: window and linear layers beside full attention; every configuration
    generates what the uncached one does, and the cache serves hits."""
    workload = ["--preset", "tiny-hybrid", *TINY_WORKLOAD[2:]]
    assert cli.main(["demo", *workload, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["preset"] == "tiny-hybrid" and result["identical_tokens"]
    configs = result["configs"]
    assert configs["device"]["computed_tokens"] < configs["none"]["computed_tokens"]


def test_demo_refuses_a_page_too_small_for_a_hybrid_state(capsys):
    assert cli.main(["demo", "--preset", "tiny-hybrid", *TINY_WORKLOAD[2:], "--page-size", "4"]) == 2
    assert "--page-size: page_size: a linear layer's state takes 8" in capsys.readouterr().err


def test_demo_requests_option_shrinks_the_run(capsys):
    assert cli.main(["demo", *TINY_WORKLOAD, "--requests", "4"]) == 0
    out = capsys.readouterr().out
    assert "hicache demo: 4 agent requests" in out
    assert "4/4" in out


@skip_unless("plot")
def test_demo_plot(tmp_path, capsys):
    path = tmp_path / "ttft.png"
    assert cli.main(["demo", *TINY_WORKLOAD, "--requests", "4", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {path}" in capsys.readouterr().out


def test_demo_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    path = tmp_path / "ttft.png"
    assert cli.main(["demo", *TINY_WORKLOAD, "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err
    assert not path.exists()
    assert captured.out == ""  # failed before running anything


def test_demo_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *TINY_WORKLOAD, "--turns", "0"])
    assert exc.value.code == 2
    assert "--turns: expected an integer > 0, got 0" in capsys.readouterr().err


def test_bench_multiturn_json(capsys):
    assert cli.main(["bench", "multiturn", "--preset", "tiny", "--requests", "10", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints only the JSON line"
    result = json.loads(out[-1])
    assert list(result["configs"]) == ["none", "device", "hierarchical"]
    keys = {"ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "hit_ratio", "device_hit_ratio",
            "host_hit_ratio", "computed_tokens", "req_per_s"}
    for name, summary in result["configs"].items():
        assert keys <= set(summary), name
        assert summary["requests"] == 10
    none, device, hier = (result["configs"][n] for n in ("none", "device", "hierarchical"))
    assert none["computed_tokens"] == none["prompt_tokens"] and none["hit_ratio"] == 0
    assert device["host_hit_ratio"] == 0
    assert hier["computed_tokens"] <= device["computed_tokens"]
    assert result["device_tokens"] < result["working_set_tokens"]


def test_bench_multiturn_runs_a_hybrid_model(capsys):
    """tiny-hybrid at the default sizing (device = the largest request with its window
    pages and state, under the working set): the device tier evicts, the host tier
    serves hits with their window tails and checkpoints, and every configuration
    generates the same tokens (run_configs raises otherwise)."""
    workload = ["--preset", "tiny-hybrid", *TINY_WORKLOAD[2:]]
    assert cli.main(["bench", "multiturn", *workload, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["device_tokens"] < result["working_set_tokens"]
    none, device, hier = (result["configs"][n] for n in ("none", "device", "hierarchical"))
    assert device["device_evicted_tokens"] > 0 and hier["host_hit_ratio"] > 0
    assert hier["computed_tokens"] < device["computed_tokens"] < none["computed_tokens"]


def test_bench_multiturn_trace_file(tmp_path, capsys):
    from hicache.sim.traces import write_trace
    from hicache.sim.workloads import generate

    path = tmp_path / "t.jsonl"
    write_trace(generate("agentic", seed=1, num_system_prompts=1, system_tokens=64,
                         num_sessions=2, num_turns=2, output_tokens=3), str(path))
    assert cli.main(["bench", "multiturn", "--trace", str(path), "--preset", "tiny",
                     "--configs", "device,hierarchical", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["configs"]) == ["device", "hierarchical"]
    assert result["num_requests"] == 4 and result["trace"] == str(path)


def test_bench_multiturn_rejects_unknown_config(capsys):
    assert multiturn.main(["--preset", "tiny", "--requests", "2", "--configs", "none,disk"]) == 2
    assert "--configs" in capsys.readouterr().err
