"""hicache replay: JSON contract, host tier, sweep, and agreement with an independent count."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
from kv_layouts import TREE_KINDS

from hicache.cli import main
from hicache.sim.replay import frozen_gc, prepare_requests, replay_device, replay_hierarchical
from hicache.sim.traces import load_trace, trace_stats

# The shared sample trace lies beside the checkout (in CI too); else a generated one.
SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sample_trace.jsonl"


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    if SAMPLE.exists():
        return str(SAMPLE)
    path = tmp_path_factory.mktemp("trace") / "agentic.jsonl"
    assert main(["trace", "make", "agentic", "--seed", "0", "-o", str(path)]) == 0
    return str(path)


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_replay_json_has_the_contract_fields(trace, capsys):
    assert main(["replay", trace, "--page-size", "16", "--device-tokens", "8192", "--json"]) == 0
    out = last_json(capsys)
    for key in ("requests", "seconds", "req_per_s", "prompt_tokens", "hit_tokens", "hit_ratio",
                "evicted_tokens", "tree_bytes_per_cached_token"):
        assert key in out
    assert out["requests"] == len(load_trace(trace))
    assert 0 < out["hit_ratio"] < 1 and out["evicted_tokens"] > 0
    assert out["hit_tokens"] == round(out["hit_ratio"] * out["prompt_tokens"])


def test_unbounded_replay_hits_equal_the_ideal_count(trace):
    stats = trace_stats(load_trace(trace), 16)
    result = replay_device(prepare_requests(trace, 16), 16, 10 * stats.working_set_tokens)
    assert result.hit_tokens == stats.ideal_hit_tokens
    assert result.evicted_tokens == 0


@pytest.mark.parametrize("tree", TREE_KINDS)
def test_host_tier_recovers_the_unbounded_hit_ratio(trace, tree):
    P = 16
    stats = trace_stats(load_trace(trace), P)
    requests = prepare_requests(trace, P)
    device = stats.working_set_tokens // 4 // P * P
    small = replay_device(requests, P, device)
    hier = replay_hierarchical(requests, P, device, stats.working_set_tokens + 64 * P, tree=tree)
    assert hier.hit_tokens == stats.ideal_hit_tokens  # every evicted page came back from host
    assert hier.device_hit_tokens == small.hit_tokens  # same device tier, same device hits
    assert hier.host_hit_tokens == stats.ideal_hit_tokens - small.hit_tokens


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_replay_host_tier_cli(trace, capsys, policy):
    argv = ["replay", trace, "--page-size", "16", "--device-tokens", "8192",
            "--host-tokens", "65536", "--write-policy", policy, "--json"]
    assert main(argv) == 0
    out = last_json(capsys)
    assert out["device_hit_tokens"] + out["host_hit_tokens"] == out["hit_tokens"]
    assert out["write_policy"] == policy
    assert out["lifecycle"] in ("native", "python")
    if policy != "write_through_selective":
        assert out["host_hit_tokens"] > 0


@pytest.mark.parametrize("eviction", ["fifo", "mru", "filo", "priority", "slru"])
def test_replay_accepts_every_eviction_policy(trace, capsys, eviction):
    for host in ([], ["--host-tokens", "65536"]):
        argv = ["replay", trace, "--page-size", "16", "--device-tokens", "8192",
                "--eviction", eviction, *host, "--json"]
        assert main(argv) == 0
        out = last_json(capsys)
        assert out["requests"] == len(load_trace(trace)) and out["evicted_tokens"] > 0


def test_sweep_is_monotone_in_host_size(trace, capsys):
    argv = ["replay", trace, "--page-size", "16", "--device-tokens", "4096",
            "--sweep-host", "1024,8192,65536", "--json"]
    assert main(argv) == 0
    rows = last_json(capsys)["sweep"]
    ratios = [r["hit_ratio"] for r in rows]
    assert [r["host_tokens"] for r in rows] == [1024, 8192, 65536]
    assert ratios == sorted(ratios) and ratios[-1] > ratios[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--device-tokens", "0"],
        ["--device-tokens", "8192", "--sweep-host", "1,x"],
        ["--device-tokens", "8192", "--plot", "x.png"],
    ],
)
def test_bad_arguments_exit_with_a_message(trace, argv, capsys):
    try:
        rc = main(["replay", trace, "--page-size", "16", *argv])
    except SystemExit as exc:  # refused by the parser
        rc = exc.code
    assert rc == 2 and "error: " in capsys.readouterr().err


def test_frozen_gc_freezes_only_while_inside_and_keeps_an_earlier_freeze():
    gc.collect()
    assert gc.get_freeze_count() == 0
    with frozen_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()  # an engine froze its start-up objects: the replay must not undo it
    try:
        with frozen_gc():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("host_fraction", [1.0, 0.3])
def test_native_and_python_lifecycles_replay_identically(trace, policy, host_fraction):
    """The C++ lifecycle (the default over the native tree) replays the trace as Python does."""
    from hicache.tree import native

    if not native.native_available():
        pytest.skip(f"native extension unavailable: {native.native_unavailable_reason()}")
    P = 16
    stats = trace_stats(load_trace(trace), P)
    requests = prepare_requests(trace, P)
    device = stats.working_set_tokens // 4 // P * P
    host = int(stats.working_set_tokens * host_fraction) // P * P + 64 * P
    results = [
        replay_hierarchical(requests, P, device, host, policy, tree=tree, lifecycle=lifecycle)
        for tree, lifecycle in (("python", "python"), ("native", "native"))
    ]
    assert [r.lifecycle for r in results] == ["python", "native"]
    py, nat = (r._replace(seconds=0.0, lifecycle="") for r in results)
    assert py == nat
    assert py.host_hit_tokens > 0 and py.evicted_tokens > 0


def test_bench_tiers_prints_a_table_then_json(trace, capsys):
    assert main(["bench", "tiers", trace, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical hit ratio / unbounded" in out
    result = json.loads(out.strip().splitlines()[-1])
    configs = result["configs"]
    assert set(configs) == {"unbounded", "device", "device-hicache", "hierarchical",
                            "hierarchical-py"}
    hier, py = configs["hierarchical"], configs["hierarchical-py"]
    assert (hier["device_hit_tokens"], hier["host_hit_tokens"]) == (
        py["device_hit_tokens"], py["host_hit_tokens"])
    assert configs["device"]["host_hit_tokens"] == 0 and hier["host_hit_tokens"] > 0
    assert result["hit_vs_unbounded"] >= 0.99  # the host tier holds every unique token
    assert result["speed_vs_device"] > 0


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--device-fraction", "1.5"]])
def test_bench_tiers_rejects_bad_arguments(trace, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "tiers", trace, *argv])
    assert exc.value.code == 2 and "expected" in capsys.readouterr().err
