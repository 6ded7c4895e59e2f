"""``hicache bench vllm``: argument checks, the request dispatcher, the report, a real run.

The argument checks, the dispatcher (driven with a fake engine) and the report need
no vLLM. The real run starts vLLM's CPU engine on a tiny random model once per
configuration (a minute or two each on a 2-core machine); it skips without vLLM,
and fails instead when HICACHE_REQUIRE_VLLM=1 (CI installs vLLM).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from optional import skip_unless

import hicache.cli.benchmarks.vllm as bv
from hicache.cli import app as cli_main
from hicache.cli.benchmarks.vllm_engine import OrderedSlots, StatsSink, drive
from hicache.cli.benchmarks.vllm_report import (
    compare,
    differing_vs_first,
    outputs_identical,
    plot_ttft_cdf,
    report,
    summarize,
    summarize_runs,
)
from hicache.sim.traces import Request
from hicache.sim.workloads import generate

REQUIRE_VLLM = os.environ.get("HICACHE_REQUIRE_VLLM") == "1"


# ----------------------------------------------------------------------------- arguments


@pytest.fixture
def everything_installed(monkeypatch):
    """Validation runs the same whether or not vLLM / the connector / matplotlib exist."""
    monkeypatch.setattr(bv, "installed", lambda module: True)


def _usage_error(capsys, argv: list[str]) -> str:
    assert cli_main.main(["bench", "vllm", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--trace", "t.jsonl", "--workload", "agentic"], "one of --trace or --workload"),
    (["--model", "m", "--preset", "tiny"], "one of --model or --preset"),
    (["--concurrency", "2", "--request-rate", "1"], "one of --concurrency or --request-rate"),
    (["--concurrency", "0"], "--concurrency: expected an int >= 1, got 0"),
    (["--num-requests", "0"], "--num-requests: expected an int >= 1, got 0"),
    (["--vllm-blocks", "-3"], "--vllm-blocks: expected an int >= 1, got -3"),
    (["--max-tokens", "0"], "--max-tokens: expected an int >= 1, got 0"),
    (["--repeat", "0"], "--repeat: expected an int >= 1, got 0"),
    (["--repeat", "2", "--storage", "file:/tmp/x"], "--storage with --repeat 2 or two "
     "storage configs: expected a fresh third tier"),
    (["--configs", "vllm+host+storage,vllm+host+storage+secret", "--storage", "file:/tmp/x"],
     "--storage with --repeat 1 or two storage configs: expected a fresh third tier"),
    (["--store-read-delay-ms", "-1"], "--store-read-delay-ms: expected an int >= 0, got -1"),
    (["--request-rate", "-1"], "--request-rate: expected a number > 0, got -1.0"),
    (["--request-rate", "nan"], "--request-rate: expected a number > 0, got nan"),
    (["--host-gb", "0"], "--host-gb: expected a number > 0, got 0.0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: expected a fraction"),
    (["--configs", "vllm,sglang"], "--configs: expected distinct names among"),
    (["--configs", "vllm,vllm"], "--configs: expected distinct names among"),
    (["--configs", ","], "--configs: expected distinct names among"),
    (["--storage", "s3://bucket"], "--storage: expected 'file:DIR' or 'mooncake://"),
    (["--trace", "/nonexistent/t.jsonl"], "--trace: expected a trace file"),
    (["--model", "/nonexistent"], "--model: expected a model directory with config.json"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, everything_installed, argv, expected):
    line = _usage_error(capsys, argv)
    assert line.startswith("hicache bench vllm: ")
    assert expected in line


def test_vllm_blocks_below_one_sequence_is_refused(capsys, everything_installed):
    # The first agentic request: 768 prompt + 4 generated tokens -> 800-token model length,
    # 25 blocks of 32, and vLLM needs one more than a whole sequence: 26.
    line = _usage_error(capsys, ["--num-requests", "1", "--max-tokens", "4",
                                 "--vllm-blocks", "25"])
    assert "--vllm-blocks: expected >= 26 (one 800-token sequence in 32-token blocks), got 25" \
        in line


def test_bad_trace_content_is_a_usage_error(capsys, everything_installed, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": 0, "session": 0, "prompt": [1, -2], "output": []}\n')
    assert "--trace: " in _usage_error(capsys, ["--trace", str(path)])


@pytest.mark.parametrize("missing, argv, expected", [
    ("vllm", [], "needs vLLM, which is not installed"),
    (bv.CONNECTOR_MODULE, [], "need hicache.integrations.vllm"),
    ("matplotlib", ["--configs", "vllm", "--plot", "x.png"], "--plot needs matplotlib"),
])
def test_missing_dependency_fails_before_work(capsys, monkeypatch, missing, argv, expected):
    monkeypatch.setattr(bv, "installed", lambda module: module != missing)
    monkeypatch.setattr(bv, "make_random_model",
                        lambda *a: pytest.fail("work started before the checks"))
    assert expected in _usage_error(capsys, argv)


def test_installed_survives_a_missing_parent_package():
    assert bv.installed("json")
    assert not bv.installed("no_such_package_hicache.sub")


# ----------------------------------------------------------------------------- plan


def _args(**overrides):
    base = dict(block_size=32, max_tokens=16, vllm_blocks=None, storage_host_tokens=None)
    base.update(overrides)
    return type("Args", (), base)()


def test_plan_sizes_are_exact():
    # Two sessions sharing a 64-token prefix; session 0's second turn extends its first.
    a = list(range(64)) + list(range(100, 132))  # 96 tokens: 3 blocks
    b = list(range(64)) + list(range(200, 240))  # 104 tokens: 3 full blocks (+8)
    a2 = a + list(range(300, 340))  # 136 tokens: 4 full blocks (+8)
    reqs = [Request(0, 0, a, [1] * 20), Request(1, 1, b, [2] * 5), Request(2, 0, a2, [])]
    plan = bv.make_plan(_args(), reqs)
    # distinct page-aligned prompt prefixes: [0:32], [0:64], a[:96], b[:96], a2[:128] = 5 pages
    assert plan.working_set_tokens == 5 * 32
    # longest sequence: 136 prompt + 16 generated (no trace output: the cap) = 152 -> 160
    assert plan.max_model_len == 160
    assert plan.vllm_blocks == 160 // 32 + 1  # a quarter of the working set is below that
    # generated: min(20, 16) + 5 + 16 = 37; (160 + 37) -> 224 tokens, + 16 blocks of slack
    assert plan.host_tokens == 224 + 16 * 32
    assert plan.small_host_tokens == 2 * 160
    # vllm-fits: the 5 working-set blocks, one block past each prompt's last whole one
    # (a: 0 + 16 tokens, b: 8 + 5, a2: 8 + 16), vLLM's null block
    assert plan.fits_blocks == 5 + 3 + 1
    assert bv.make_plan(_args(vllm_blocks=40), reqs).vllm_blocks == 40
    assert bv.make_plan(_args(storage_host_tokens=100), reqs).small_host_tokens == 96


def test_the_chat_workload_adds_short_turns():
    """Each turn adds 28-112 tokens (user line and reply): mostly under SGLang's 256."""
    reqs = bv.load_requests(type("Args", (), {"trace": None, "workload": "chat", "seed": 0,
                                              "num_requests": None})())
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    growth = [len(b.prompt) - len(a.prompt) for turns in by_session.values()
              for a, b in zip(turns, turns[1:], strict=False)]
    assert growth and 28 <= min(growth) and max(growth) <= 112


def test_default_agentic_working_set_is_4x_vllm_cache():
    reqs = generate("agentic", seed=0, **bv.WORKLOADS["agentic"])
    plan = bv.make_plan(_args(), reqs)
    assert plan.working_set_tokens >= 4 * plan.vllm_blocks * plan.block_size
    assert plan.host_tokens >= plan.working_set_tokens
    assert plan.small_host_tokens < plan.working_set_tokens


def test_hybrid_preset_sizes_vllms_blocks_for_every_group():
    """The Gemma-3-style preset: 5 sliding-window layers to 1 full-attention one make 5
    window groups beside the full one; vLLM's blocks hold one group's block, so one
    longest sequence needs a block of every group per token, and the host tier a page of
    every group per token (room for every window page, whatever the connector keeps)."""
    shape = bv.PRESETS["hybrid"]
    assert shape.hybrid and shape.num_window_groups == 5
    assert shape.layer_types() == ["sliding_attention"] * 5 + ["full_attention"]
    reqs = generate("agentic", seed=0, **bv.WORKLOADS["agentic"])
    plan, plain = bv.make_plan(_args(), reqs, shape), bv.make_plan(_args(), reqs)
    assert plan.vllm_blocks >= 6 * (plan.max_model_len // 32 + 1)
    assert plan.fits_blocks > 5 * plain.fits_blocks  # a Llama's plan is as before
    extra = bv._connector_config("vllm+host", plan, _args(host_gb=None), "/tmp", shape)
    assert extra["kv_connector_extra_config"]["host_tokens"] == 6 * plan.host_tokens


def test_hybrid_host_pages_against_every_window_page():
    from hicache.cli.benchmarks.vllm_report import hybrid_host_pages

    model = {"num_window_groups": 5, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 8,
             "num_layers": 6, "full_every": 6}
    # 100 full pages and 140 window pages: 240 pages where every window page makes 600
    h = hybrid_host_pages({"host_pages_used": 240, "host_window_pages": 140,
                           "host_state_pages": 0}, model, 32)
    group = 2 * 8 * 64 * 4  # K and V of one layer, float32, a token
    assert h == {"host_pages": 240, "full_pages": 100, "window_pages": 140,
                 "cached_tokens": 3200, "bytes_per_cached_token": 240 * group // 100,
                 "every_window_page_bytes_per_token": 6 * group, "vs_every_window_page": 0.4}
    assert hybrid_host_pages({"host_pages_used": 3}, model, 32) is None  # not a hybrid run


def test_presets_are_llama_shapes():
    for shape in bv.PRESETS.values():
        assert shape.hidden_size % shape.num_heads == 0
        assert shape.num_heads % shape.num_kv_heads == 0
    small = bv.PRESETS["small"]
    assert small.kv_nbytes_per_token == 2 * 4 * 512 * 4  # K+V, 4 layers, 512 wide, float32


# ----------------------------------------------------------------------------- dispatcher


class FakeEngine:
    """Records what runs concurrently; each request takes ``delay(req)`` seconds."""

    def __init__(self, delay):
        self.delay = delay
        self.in_flight: list[int] = []
        self.max_in_flight = 0
        self.started: list[int] = []
        self.finished: list[int] = []
        self.events: list[tuple[str, int]] = []  # ("start" | "end", id) in time order

    async def submit(self, req: dict) -> dict:
        self.started.append(req["id"])
        self.events.append(("start", req["id"]))
        self.in_flight.append(req["id"])
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        await asyncio.sleep(self.delay(req))
        if req.get("fail"):
            self.in_flight.remove(req["id"])
            raise RuntimeError(f"request {req['id']} failed")
        self.in_flight.remove(req["id"])
        self.finished.append(req["id"])
        self.events.append(("end", req["id"]))
        return {"id": req["id"]}


def _reqs(sessions: list[int], **extra) -> list[dict]:
    return [{"id": i, "session": s, **extra} for i, s in enumerate(sessions)]


def test_drive_keeps_sessions_in_order_and_bounds_concurrency():
    reqs = _reqs([0, 1, 0, 2, 1, 0, 3, 2])
    eng = FakeEngine(lambda r: 0.01 * (1 + r["id"] % 3))
    done = []
    records, errors = asyncio.run(drive(eng.submit, reqs, concurrency=2, request_rate=0,
                                        seed=0, on_done=lambda: done.append(1)))
    assert errors == [] and len(done) == 8
    assert [r["id"] for r in records] == list(range(8))  # trace order, whatever finished first
    assert eng.max_in_flight == 2
    for s in range(4):  # a session's turn starts after its previous turn finished
        ids = [r["id"] for r in reqs if r["session"] == s]
        for prev, nxt in zip(ids, ids[1:], strict=False):
            assert eng.events.index(("end", prev)) < eng.events.index(("start", nxt))


def test_drive_gives_a_free_slot_to_the_earliest_ready_request():
    # One slot. Request 0 (session 0) runs; 1 (session 0) waits for it; 2, 3 (new
    # sessions) are ready at once. A FIFO semaphore would start 2 and 3 before 1; here
    # the freed slot goes to the lowest trace index that is ready: 1 (once 0 is done).
    reqs = _reqs([0, 0, 1, 2])
    eng = FakeEngine(lambda r: 0.01)
    asyncio.run(drive(eng.submit, reqs, concurrency=1, request_rate=0, seed=0))
    assert eng.started == [0, 1, 2, 3]


def test_drive_open_loop_reports_failures_and_releases_the_session():
    reqs = _reqs([0, 0, 1])
    reqs[0]["fail"] = True
    eng = FakeEngine(lambda r: 0.001)
    records, errors = asyncio.run(drive(eng.submit, reqs, concurrency=0, request_rate=500.0,
                                        seed=1))
    assert [r["id"] for r in records] == [1, 2]
    assert errors == ["RuntimeError('request 0 failed')"]


def test_drive_needs_exactly_one_mode():
    with pytest.raises(ValueError, match="one of concurrency > 0 or request_rate > 0"):
        asyncio.run(drive(FakeEngine(lambda r: 0).submit, [], concurrency=2, request_rate=1.0,
                          seed=0))


def test_ordered_slots_count():
    async def scenario():
        slots = OrderedSlots(2)
        await slots.acquire(5)
        await slots.acquire(3)
        assert slots.num_free == 0
        waiter = asyncio.ensure_future(slots.acquire(9))
        await asyncio.sleep(0)
        assert not waiter.done()
        slots.release()  # handed to the waiter, not counted free
        await asyncio.sleep(0)
        assert waiter.done() and slots.num_free == 0
        slots.release()
        slots.release()
        assert slots.num_free == 2

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- report


def _result(ttfts_s, outputs, stats, by_source=None, wall_s=2.0):
    recs = [{"id": i, "session": 0, "prompt_tokens": 100, "cached_tokens": 0, "ttft_s": t,
             "decode_step_s": 0.02, "output": o, "preemptions": 0}
            for i, (t, o) in enumerate(zip(ttfts_s, outputs, strict=True))]
    return {"requests": recs, "num_failed": 0, "prompt_token_stats": stats,
            "connector_hits_by_source": by_source or {}, "wall_s": wall_s,
            "engine_start_s": 30.0, "connector_stats": {}, "errors": []}


def test_summarize_splits_prompt_tokens_by_tier():
    stats = {"computed": 40, "local_cache_hit": 64, "external_kv_transfer": 96, "total": 200}
    s = summarize(_result([0.1, 0.3], [[1], [2]], stats, {"host": 64, "disk": 32}))
    assert (s["computed_tokens"], s["vllm_hit_tokens"], s["host_hit_tokens"],
            s["storage_hit_tokens"], s["unspecified_hit_tokens"]) == (40, 64, 64, 32, 0)
    assert s["prompt_tokens"] == 200 and s["req_per_s"] == 1.0
    assert s["ttft_mean_ms"] == 200.0 and s["ttft_p50_ms"] == 200.0
    assert s["decode_step_ms"] == 20.0 and s["connector_ms_per_step"] is None
    r = _result([0.1], [[1]], stats)
    r["connector_stats"] = {"steps": 4, "hook_seconds": 0.002, "hook_cpu_seconds": 0.001,
                            "scheduler_steps": 64, "scheduler_hook_seconds": 0.016,
                            "scheduler_hook_cpu_seconds": 0.008}
    s = summarize(r)
    assert (s["connector_ms_per_step"], s["connector_cpu_ms_per_step"]) == (0.5, 0.25)
    assert s["connector_scheduler_ms_per_step"] == 0.25
    assert s["connector_scheduler_cpu_ms_per_step"] == 0.125
    assert s["steps_in_ttft"] is None and s["connector_ttft_ms"] is None  # no step times
    # a connector that names no tier: its tokens are shown as such, not guessed
    s = summarize(_result([0.1], [[1]], stats, {"external_unspecified": 96}))
    assert (s["host_hit_tokens"], s["unspecified_hit_tokens"]) == (0, 96)


def test_steps_within_a_ttft_count_the_first_tokens_step():
    stats = {"computed": 40, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 40}
    r = _result([0.25, 0.05], [[1], [2]], stats)
    r["requests"][0]["arrival_s"] = 100.0  # first token at 100.25: steps 100.1-100.25
    r["requests"][1]["arrival_s"] = 100.25  # first token at 100.3: that step only
    r["step_times"] = [99.9, 100.0, 100.1, 100.2, 100.25, 100.3, 100.4]
    r["connector_stats"] = {"steps": 10, "hook_seconds": 0.002, "hook_cpu_seconds": 0.001,
                            "scheduler_steps": 10, "scheduler_hook_seconds": 0.003,
                            "scheduler_hook_cpu_seconds": 0.002}
    s = summarize(r)
    assert s["steps_in_ttft"] == 2.0  # (3 + 1) / 2
    assert s["connector_ttft_ms"] == 1.0  # 2 steps x (0.2 + 0.3) ms
    assert s["connector_ttft_cpu_ms"] == 0.6  # 2 steps x (0.1 + 0.2) ms


def test_breakdown_splits_ttft_and_the_steps_that_load():
    stats = {"computed": 40, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 40}
    r = _result([0.25, 0.05], [[1], [2]], stats)
    for rec, queued, prefill in zip(r["requests"], (0.05, 0.0), (0.15, 0.04), strict=True):
        rec["queued_s"], rec["prefill_s"] = queued, prefill
    r["step_times"] = [100.3, 100.0, 100.1, 100.25]  # intervals 100, 150, 50 ms
    b = summarize(r)["breakdown"]
    assert (b["queued_ms"], b["prefill_ms"], b["front_ms"]) == (25.0, 95.0, 30.0)
    assert b["step_ms_median"] == 100.0
    assert b["step_fixed_ms"] is None  # no per-step token counts
    # the steps at 100.1, 100.25, 100.3 computed 1,000, 2,000 and 0 prompt tokens:
    # intervals 100, 150 and 50 ms = 50 ms + 50 ms per 1,000 tokens
    r["step_computed"] = [0, 7, 1000, 2000]
    b = summarize(r)["breakdown"]
    assert (b["step_fixed_ms"], b["step_ms_per_1k_computed"]) == (50.0, 50.0)
    assert b["computed_in_ttft"] is None  # the requests' arrival times are not recorded
    # request 0 arrived at 100.0, first token at 100.25: steps 100.1 and 100.25 (3,000
    # tokens); request 1 at 100.25, first token at 100.3: step 100.3 (0 tokens)
    r["requests"][0]["arrival_s"], r["requests"][1]["arrival_s"] = 100.0, 100.25
    assert summarize(r)["breakdown"]["computed_in_ttft"] == 1500.0
    # vLLM alone: no connector clocks
    assert b["model_ms_per_step"] is None and b["load_steps"] is None
    assert b["worker_hooks_ms"] == {} and b["scheduler_hooks_ms"] == {}
    r["connector_stats"] = {
        "steps": 10, "scheduler_steps": 20, "model_seconds": 0.9, "model_steps": 10,
        "load_forward_seconds": 0.4, "load_forward_steps": 4, "load_seconds": 0.02,
        "hook_seconds.wait_for_layer_load": 0.004, "hook_seconds.wait_for_save": 0.01,
        "hook_calls.wait_for_save": 10, "hook_cpu_seconds.wait_for_save": 0.005,
        "scheduler_hook_seconds.build_connector_meta": 0.006}
    b = summarize(r)["breakdown"]
    assert b["model_ms_per_step"] == 90.0 and b["load_steps"] == 4
    # per load step: 5 ms of copy under a 100 ms forward, of which it waited 1 ms
    assert (b["load_copy_ms"], b["load_forward_ms"], b["load_wait_ms"]) == (5.0, 100.0, 1.0)
    assert b["load_hidden"] == 0.8
    assert b["worker_hooks_ms"] == {"wait_for_layer_load": 0.4, "wait_for_save": 1.0}
    assert b["scheduler_hooks_ms"] == {"build_connector_meta": 0.3}
    assert b["worker_hooks_cpu_ms"] == {"wait_for_save": 0.5}
    assert b["cpu_worker_s"] is None  # no process accounting in this result
    r["cpu_seconds"] = {"front end": 3.5, "VLLM::EngineCor": 2.0, "VLLM::Worker": 40.0,
                        "python": 0.01}
    b = summarize(r)["breakdown"]
    assert (b["cpu_worker_s"], b["cpu_engine_core_s"], b["cpu_front_end_s"]) == (40.0, 2.0, 3.5)
    # a request without vLLM's timestamps: no split rather than a wrong one
    r["requests"][1]["queued_s"] = None
    assert summarize(r)["breakdown"]["front_ms"] is None


def test_breakdown_medians_over_runs_and_in_the_table(capsys):
    from hicache.cli.benchmarks.vllm_breakdown import median_breakdown

    each = [{"load_copy_ms": v, "load_steps": n, "worker_hooks_ms": hooks}
            for v, n, hooks in ((1.0, 4, {"a": 0.1}), (3.0, 6, {"a": 0.3, "b": 1.0}),
                                (None, 5, {}))]
    assert median_breakdown(each) == {"load_copy_ms": 2.0, "load_steps": 5,
                                      "worker_hooks_ms": {"a": 0.1, "b": 0.0}}
    stats = {"computed": 40, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 40}
    host = _result([0.1], [[1]], stats)
    host["connector_stats"] = {"steps": 2, "hook_seconds.start_load_kv": 0.001,
                               "hook_cpu_seconds.start_load_kv": 0.0004}
    report({"vllm": [_result([0.2], [[1]], stats)], "vllm+host": [host]}, {}, {},
           out=sys.stdout, plot=None, title="t")
    text = capsys.readouterr().out
    assert "where the time goes" in text
    assert "connector per step by hook, worker: wall / CPU (ms)" in text
    assert re.search(r"start_load_kv +- +0\.500 / 0\.200\n", text)
    assert "TTFT gain / computed-token gain 2.00 (target >= 0.9)" in text


def test_connector_stats_are_summed_over_steps():
    sink = StatsSink()
    sink.recording = True
    step = type("S", (), {"connector_prefix_cache_stats": None, "kv_connector_stats": None})
    for data in ({"load_bytes": 10, "load_seconds": 0.5, "name": "x", "host_pages_used": 3},
                 {"load_bytes": 6, "per_tier": {"host": 2}, "flag": True, "host_pages_used": 5},
                 None):
        s = step()
        s.kv_connector_stats = data
        sink.record(s, None)
    # host_pages_used is the host tier's occupancy: the latest report, not a sum
    assert sink.connector_stats == {"load_bytes": 16, "load_seconds": 0.5,
                                    "per_tier": {"host": 2}, "host_pages_used": 5}


def test_outputs_identical_counts_differing_and_missing_requests():
    a = _result([0.1, 0.1, 0.1], [[1, 2], [3], [4]], {})
    b = _result([0.1, 0.1, 0.1], [[1, 2], [3], [5]], {})
    c = _result([0.1, 0.1], [[1, 2], [3]], {})
    assert outputs_identical({"x": a, "y": a}) == (True, 0)
    assert outputs_identical({"x": a, "y": b}) == (False, 1)
    assert outputs_identical({"x": a, "y": c}) == (False, 1)  # request 2 missing in c


def test_differing_vs_first_counts_finished_requests_only():
    a = _result([0.1, 0.1, 0.1], [[1, 2], [3], [4]], {})
    b = _result([0.1, 0.1], [[1, 2], [9]], {})
    assert differing_vs_first({"vllm": a, "x": b}) == {"vllm": 0, "x": 1}


def test_compare_skips_configs_with_failed_requests():
    ok = {"ttft_mean_ms": 1.0, "computed_tokens": 1, "req_per_s": 1.0, "decode_step_ms": 1.0,
          "external_hit_tokens": 1, "failed": 0}
    assert compare({"vllm": ok, "vllm+host": ok, "vllm+host+storage": {**ok, "failed": 3}}) \
        == {"vllm+host": {"ttft_mean_speedup": 1.0, "computed_reduction": 1.0,
                          "ttft_gain_per_computed_gain": 1.0,
                          "req_per_s_ratio": 1.0, "ttft_mean_delta_ms": 0.0,
                          "decode_step_delta_ms": 0.0}}


def test_report_names_failures_and_mismatches(capsys):
    stats = {"computed": 200, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 200}
    a = _result([0.1, 0.2], [[1], [2]], stats)
    b = _result([0.1], [[7]], stats)
    b["num_failed"], b["errors"] = 1, ["EngineDeadError('boom')"]
    summary = report({"vllm": [a], "vllm+host": [b]}, {}, {}, out=sys.stdout, plot=None,
                     title="t")
    text = capsys.readouterr().out
    assert "vllm+host: 1 requests FAILED, first error: EngineDeadError('boom')" in text
    assert "vllm+host: 1 finished requests generated other tokens than vllm" in text
    assert summary["tokens_identical"] is False and summary["requests_differing"] == 2
    assert summary["comparisons"] == {}
    assert summary["configs"]["vllm+host"]["failed"] == 1


def test_repeated_runs_report_medians_and_paired_rounds(capsys):
    stats = {"computed": 200, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 200}
    hit = {"computed": 64, "local_cache_hit": 0, "external_kv_transfer": 136, "total": 200}
    base = [_result([t, t], [[1], [2]], stats, wall_s=w) for t, w in ((0.3, 2.0), (0.5, 4.0),
                                                                      (0.4, 1.0))]
    host = [_result([t, t], [[1], [2]], hit, {"host": 136}, wall_s=1.0)
            for t in (0.1, 0.2, 0.25)]
    host[1]["prompt_token_stats"] = {**hit, "computed": 96}  # a run that hit less
    summary = report({"vllm": base, "vllm+host": host}, {}, {}, out=sys.stdout, plot=None,
                     title="t")
    text = capsys.readouterr().out
    b, h = summary["configs"]["vllm"], summary["configs"]["vllm+host"]
    assert b["ttft_mean_ms"] == 400.0 and h["ttft_mean_ms"] == 200.0  # medians of 3
    assert b["req_per_s"] == 1.0  # 2 requests in 2 s is the median run
    assert h["computed_tokens"] == 64  # median_low of 64, 96, 64: a measured count
    assert [r["ttft_mean_ms"] for r in h["runs"]] == [100.0, 200.0, 250.0]
    assert summary["comparisons"]["vllm+host"]["ttft_mean_speedup"] == 2.0
    assert [r["vllm+host"]["ttft_mean_speedup"] for r in summary["comparisons_per_run"]] \
        == [3.0, 2.5, 1.6]
    assert "medians of 3 runs per configuration" in text
    assert "per run: mean TTFT 3.00, 2.50, 1.60x lower" in text
    assert summary["tokens_identical"] is True and b["tokens_differ_vs_first"] == 0
    host[2]["requests"][1]["output"] = [9]  # one run of one config generated other tokens
    summary = report({"vllm": base, "vllm+host": host}, {}, {}, out=sys.stdout, plot=None,
                     title="t")
    assert summary["tokens_identical"] is False and summary["requests_differing"] == 1
    assert summary["configs"]["vllm+host"]["tokens_differ_vs_first"] == 1


def test_summarize_runs_of_one_run_is_that_run():
    stats = {"computed": 200, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 200}
    r = _result([0.1, 0.3], [[1], [2]], stats)
    assert summarize_runs([r]) == summarize(r) and "runs" not in summarize_runs([r])
    with pytest.raises(ValueError, match="expected at least one run, got none"):
        summarize_runs([])


def test_rounds_alternate_their_order():
    assert bv._schedule(["vllm", "vllm+host"], 3) == [
        ("vllm", 1), ("vllm+host", 1), ("vllm+host", 2), ("vllm", 2), ("vllm", 3),
        ("vllm+host", 3)]
    assert bv._schedule(["vllm"], 1) == [("vllm", 1)]


ALL_COMPUTED = {"computed": 100, "local_cache_hit": 0, "external_kv_transfer": 0, "total": 100}


@pytest.fixture
def model(tmp_path):
    """A model directory holding only the config.json the bench reads its shapes from."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
        "intermediate_size": 352, "vocab_size": 32000}))
    return path


def test_repeat_runs_every_config_n_times_with_a_fresh_third_tier(
        monkeypatch, capfd, everything_installed, tmp_path, model):
    keep = tmp_path / "keep"
    ran = []

    def fake_run_config(name, spec, workdir, progress_fd, tag=None):
        storage = os.path.join(workdir, "storage")
        ran.append((name, tag, spec["config"], os.path.exists(storage)))
        os.makedirs(storage, exist_ok=True)  # what the run left behind
        res = _result([0.1], [[1]], ALL_COMPUTED)
        res["requests"][0]["prompt_tokens"] = 100
        return res

    monkeypatch.setattr(bv, "run_config", fake_run_config)
    argv = ["bench", "vllm", "--model", str(model), "--num-requests", "1", "--repeat", "2",
            "--configs", "vllm,vllm+host+storage", "--keep", str(keep), "--json"]
    assert cli_main.main(argv) == 0
    assert ran == [("vllm", "vllm.1", "vllm.1", False),
                   ("vllm+host+storage", "vllm+host+storage.1", "vllm+host+storage.1", False),
                   ("vllm+host+storage", "vllm+host+storage.2", "vllm+host+storage.2", False),
                   ("vllm", "vllm.2", "vllm.2", False)]
    summary = json.loads(capfd.readouterr().out)
    assert len(summary["configs"]["vllm"]["runs"]) == 2
    assert len(summary["comparisons_per_run"]) == 2


def test_the_restart_config_runs_a_new_process_on_the_tier_a_first_one_filled(
        monkeypatch, capfd, everything_installed, tmp_path, model):
    """vllm+host+storage+restart: a first, unmeasured process of the same configuration on
    a fresh tier, then the measured one on what it left (a restarted instance)."""
    keep = tmp_path / "keep"
    ran = []

    def fake_run_config(name, spec, workdir, progress_fd, tag=None):
        storage = os.path.join(workdir, "storage")
        ran.append((name, tag, os.path.exists(storage),
                    spec["kv_transfer_config"]["kv_connector_extra_config"]["storage"]))
        os.makedirs(storage, exist_ok=True)
        res = _result([0.1], [[1]], ALL_COMPUTED)
        res["requests"][0]["prompt_tokens"] = 100
        return res

    monkeypatch.setattr(bv, "run_config", fake_run_config)
    argv = ["bench", "vllm", "--model", str(model), "--num-requests", "1", "--configs",
            "vllm+host+storage,vllm+host+storage+restart", "--keep", str(keep), "--json"]
    assert cli_main.main(argv) == 0
    tier = f"file:{keep / 'storage'}"
    assert ran == [("vllm+host+storage", "vllm+host+storage", False, tier),
                   ("vllm+host+storage+restart", "vllm+host+storage+restart.first", False, tier),
                   ("vllm+host+storage+restart", "vllm+host+storage+restart", True, tier)]
    summary = json.loads(capfd.readouterr().out)
    assert summary["configs"]["vllm+host+storage+restart"]["failed"] == 0


def test_vllm_fits_runs_vllm_alone_with_the_working_set_in_its_cache(
        monkeypatch, capfd, everything_installed, tmp_path, model):
    specs = {}

    def fake_run_config(name, spec, workdir, progress_fd, tag=None):
        specs[name] = spec
        return _result([0.1], [[1]], ALL_COMPUTED)

    monkeypatch.setattr(bv, "run_config", fake_run_config)
    argv = ["bench", "vllm", "--model", str(model), "--configs", "vllm,vllm+host,vllm-fits",
            "--json"]
    assert cli_main.main(argv) == 0
    assert specs["vllm"]["vllm_blocks"] == specs["vllm+host"]["vllm_blocks"] == 292
    # every block the agentic trace fills: its 1,168-block working set, one block past
    # each of the 192 page-aligned prompts (16 generated tokens), vLLM's null block
    assert specs["vllm-fits"]["vllm_blocks"] == 1168 + 192 + 1
    assert specs["vllm-fits"]["kv_transfer_config"] is None
    assert specs["vllm+host"]["kv_transfer_config"]["kv_connector"] == "HiCacheConnector"
    assert "vllm-fits" in json.loads(capfd.readouterr().out)["comparisons"]


def test_the_secret_config_passes_its_secret_in_the_environment(
        monkeypatch, capfd, everything_installed, tmp_path, model):
    """vllm+host+storage+secret gives the engine a storage secret through
    HICACHE_STORAGE_SECRET, never in vLLM's config (which vLLM logs)."""
    specs = {}

    def fake_run_config(name, spec, workdir, progress_fd, tag=None):
        specs[name] = spec
        return _result([0.1], [[1]], ALL_COMPUTED)

    monkeypatch.setattr(bv, "run_config", fake_run_config)
    argv = ["bench", "vllm", "--model", str(model), "--num-requests", "1", "--configs",
            "vllm,vllm+host+storage+secret", "--json"]
    assert cli_main.main(argv) == 0
    spec = specs["vllm+host+storage+secret"]
    secret = spec["env"]["HICACHE_STORAGE_SECRET"]
    assert len(secret) == 32 and secret not in json.dumps(spec["kv_transfer_config"])
    assert "storage_secret" not in spec["kv_transfer_config"]["kv_connector_extra_config"]


def test_storage_configs_read_in_the_step_or_in_the_background_from_a_slow_store(
        monkeypatch, capfd, everything_installed, tmp_path, model):
    """vllm+host+storage reads third-tier hits in vLLM's step, +async in the background;
    --store-read-delay-ms slows the storage configurations' reads only."""
    specs = {}

    def fake_run_config(name, spec, workdir, progress_fd, tag=None):
        specs[name] = spec
        res = _result([0.2 if name == "vllm+host+storage" else 0.1], [[1]], ALL_COMPUTED)
        res["step_times"] = [0.0, 0.01, 0.02, 0.5] if name == "vllm+host+storage" else [
            0.0, 0.01, 0.02, 0.03]
        return res

    monkeypatch.setattr(bv, "run_config", fake_run_config)
    argv = ["bench", "vllm", "--model", str(model), "--num-requests", "1", "--configs",
            "vllm,vllm+host+storage,vllm+host+storage+async", "--store-read-delay-ms", "5",
            "--json"]
    assert cli_main.main(argv) == 0
    policy = {name: (spec["kv_transfer_config"] or {}).get("kv_connector_extra_config", {})
              .get("prefetch_policy") for name, spec in specs.items()}
    assert policy == {"vllm": None, "vllm+host+storage": "sync",
                      "vllm+host+storage+async": "timeout"}
    assert "env" not in specs["vllm"]
    for name in ("vllm+host+storage", "vllm+host+storage+async"):
        assert specs[name]["env"] == {"HICACHE_FAULTS": "read_delay_ms=5"}
    summary = json.loads(capfd.readouterr().out)
    assert summary["configs"]["vllm+host+storage"]["step_max_ms"] == 480.0
    assert summary["comparisons"]["async_vs_sync_storage"] == {
        "ttft_mean_speedup": 2.0, "step_p99_ratio": round(10.0 / 475.6, 3)}


@skip_unless("plot")
def test_plot_ttft_cdf_writes_a_png(tmp_path):
    a = _result([0.1, 0.2, 0.4], [[1], [2], [3]], {})
    b = _result([0.05], [[1]], {})
    b["num_failed"] = 2
    path = tmp_path / "cdf.png"
    plot_ttft_cdf(str(path), {"vllm": [a, a], "vllm+host": [b]}, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_ratios_against_vllm():
    configs = {
        "vllm": {"ttft_mean_ms": 300.0, "computed_tokens": 900, "req_per_s": 2.0,
                 "decode_step_ms": 20.0, "external_hit_tokens": 0, "failed": 0},
        "vllm+host": {"ttft_mean_ms": 100.0, "computed_tokens": 300, "req_per_s": 3.0,
                      "decode_step_ms": 20.25, "external_hit_tokens": 600, "failed": 0},
        "vllm+host+storage": {"ttft_mean_ms": 150.0, "computed_tokens": 360, "req_per_s": 2.5,
                              "decode_step_ms": 20.5, "external_hit_tokens": 540, "failed": 0},
    }
    c = compare(configs)
    assert c["vllm+host"] == {"ttft_mean_speedup": 3.0, "computed_reduction": 3.0,
                              "ttft_gain_per_computed_gain": 1.0,
                              "req_per_s_ratio": 1.5, "ttft_mean_delta_ms": -200.0,
                              "decode_step_delta_ms": 0.25}
    assert c["storage_keeps_hits"] == 0.9
    # with vllm-fits (vLLM's own cache holding the working set): the bound at the same
    # computed tokens, and each connector configuration's TTFT against it
    configs["vllm-fits"] = {"ttft_mean_ms": 80.0, "computed_tokens": 300, "req_per_s": 3.2,
                            "decode_step_ms": 20.0, "external_hit_tokens": 0, "failed": 0}
    c = compare(configs)
    assert c["vllm-fits"]["ttft_mean_speedup"] == 3.75
    assert c["vllm-fits"]["ttft_gain_per_computed_gain"] == 1.25
    assert "ttft_vs_fits" not in c["vllm-fits"]
    assert c["vllm+host"]["ttft_vs_fits"] == 1.25
    assert c["vllm+host+storage"]["ttft_vs_fits"] == 1.875
    assert c["vllm+host+storage"]["ttft_gain_per_computed_gain"] == 0.8


def test_write_policy_configs_compare_bytes_written_with_write_through():
    base = {"ttft_mean_ms": 100.0, "computed_tokens": 300, "req_per_s": 3.0,
            "decode_step_ms": 20.0, "vllm_hit_tokens": 200, "external_hit_tokens": 600,
            "failed": 0}
    configs = {"vllm": {**base, "external_hit_tokens": 0, "host_bytes_written": None},
               "vllm+host": {**base, "host_bytes_written": 1000},
               "vllm+host+wb": {**base, "ttft_mean_ms": 99.0, "host_bytes_written": 100},
               "vllm+host+sel": {**base, "external_hit_tokens": 500, "host_bytes_written": 0}}
    c = compare(configs)
    assert c["vllm+host+wb vs vllm+host"] == {
        "bytes_written_reduction": 10.0, "host_bytes_written": [1000, 100],
        "ttft_mean_ratio": 0.99, "cached_tokens_delta": 0}
    assert c["vllm+host+sel vs vllm+host"]["bytes_written_reduction"] is None  # 0 written
    assert c["vllm+host+sel vs vllm+host"]["cached_tokens_delta"] == -100


def test_write_policy_configs_run_vllm_host_under_their_policy():
    import argparse

    parser = argparse.ArgumentParser()
    bv.add_arguments(parser)
    args = parser.parse_args(["--configs", "vllm,vllm+host,vllm+host+wb,vllm+host+sel"])
    plan = bv.Plan(32, 1024, 4096, 32, 8192, 2048, 160)
    extras = {name: bv._connector_config(name, plan, args, "/tmp/x")["kv_connector_extra_config"]
              for name in ("vllm+host", "vllm+host+wb", "vllm+host+sel")}
    assert extras == {"vllm+host": {"host_tokens": 8192},
                      "vllm+host+wb": {"write_policy": "write_back", "host_tokens": 8192},
                      "vllm+host+sel": {"write_policy": "write_through_selective",
                                        "host_tokens": 8192}}


# ----------------------------------------------------------------------------- real vLLM


def _vllm_available() -> bool:
    return bv.installed("vllm")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    if not _vllm_available():
        if REQUIRE_VLLM:
            pytest.fail("HICACHE_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed")
    configs = ["vllm"]
    if bv.installed(bv.CONNECTOR_MODULE):
        configs += ["vllm+host", "vllm+host+storage"]
    cwd = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "hicache.cli", "bench", "vllm", "--preset", "tiny",
           "--num-requests", str(NUM_REQUESTS), "--max-tokens", "4", "--concurrency", "2",
           "--configs", ",".join(configs), "--json"]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return configs, proc


NUM_REQUESTS = 16


def test_real_run_json_only_on_stdout(real_run):
    _, proc = real_run
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert "TTFT mean (ms)" in proc.stderr  # the table went to stderr under --json
    assert "AsyncLLM" in proc.stderr  # it says how requests were issued
    # every config's progress bar reached the caller (not the config's vLLM log)
    assert proc.stderr.count(f"{NUM_REQUESTS}/{NUM_REQUESTS}") >= len(real_run[0])
    assert set(summary) >= {"model", "configs", "tokens_identical"}


def test_real_run_accounts_every_prompt_token(real_run):
    configs, proc = real_run
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    reqs = generate("agentic", seed=0, **bv.WORKLOADS["agentic"])[:NUM_REQUESTS]
    expected_prompt = sum(len(r.prompt) for r in reqs)
    assert list(summary["configs"]) == configs
    for name, c in summary["configs"].items():
        assert c["requests"] == NUM_REQUESTS and c["failed"] == 0, name
        assert c["prompt_tokens"] == expected_prompt, name
        assert c["computed_tokens"] + c["vllm_hit_tokens"] + c["external_hit_tokens"] \
            == expected_prompt, name
        assert c["vllm_hit_tokens"] % 32 == 0 and c["external_hit_tokens"] % 32 == 0, name
        assert c["host_hit_tokens"] + c["storage_hit_tokens"] + c["unspecified_hit_tokens"] \
            == c["external_hit_tokens"], name
        assert 0 < c["ttft_p50_ms"] <= c["ttft_p99_ms"], name
        assert c["decode_step_ms"] > 0, name
        assert c["steps_in_ttft"] >= 1, name  # the first token's step at least
        b = c["breakdown"]  # vLLM's own per-request timestamps split every TTFT
        assert b["queued_ms"] >= 0 and b["prefill_ms"] > 0 and b["front_ms"] is not None, name
        assert b["computed_in_ttft"] > 0 and b["step_ms_median"] > 0, name
        assert b["cpu_worker_s"] > 0 and b["cpu_engine_core_s"] > 0, name  # Linux /proc
    base = summary["configs"]["vllm"]
    assert base["external_hit_tokens"] == 0
    # 16 agentic requests replayed on a cache of a quarter of their working set still
    # share system prompts among concurrent sessions: vLLM alone hits something.
    assert base["vllm_hit_tokens"] > 0
    assert summary["tokens_identical"] is True


def test_real_run_connector_configs_serve_from_hicache(real_run):
    configs, proc = real_run
    if "vllm+host" not in configs:
        if REQUIRE_VLLM:
            pytest.fail("HICACHE_REQUIRE_VLLM=1 but the connector module is missing")
        pytest.skip("hicache.integrations.vllm is not in this tree yet")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    base, host = summary["configs"]["vllm"], summary["configs"]["vllm+host"]
    storage = summary["configs"]["vllm+host+storage"]
    assert host["host_hit_tokens"] > 0
    assert host["computed_tokens"] < base["computed_tokens"]
    assert storage["external_hit_tokens"] > 0
    assert np.isfinite(summary["comparisons"]["storage_keeps_hits"])
    for c in (host, storage):  # both halves' clocks reached the report, CPU time too
        assert c["connector_ms_per_step"] > 0 and c["connector_cpu_ms_per_step"] > 0
        assert c["connector_ttft_ms"] > 0 and c["connector_ttft_cpu_ms"] > 0
        # per hook, both sides; the model runner timed between the worker's hooks
        b = c["breakdown"]
        assert {"handle_preemptions", "start_load_kv", "wait_for_save"} <= set(
            b["worker_hooks_ms"])
        assert {"get_num_new_matched_tokens", "build_connector_meta"} <= set(
            b["scheduler_hooks_ms"])
        assert b["model_ms_per_step"] > 0
    assert base["breakdown"]["worker_hooks_ms"] == {}  # vLLM alone: no connector clocks


def test_every_config_runs_on_the_same_cores(monkeypatch, tmp_path):
    """vLLM's CPU backend reserves one more core with a KV connector configured, and none
    where that leaves its worker nothing (2 cores): the connector's worker then computed
    on every core and the baseline's on one. The bench pins one reserved core for all."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    seen = {}

    def fake_run(cmd, cwd, env, stdout, stderr, pass_fds):
        seen[os.path.basename(cmd[-1])] = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bv.subprocess, "run", fake_run)
    spec = {"vllm_blocks": 8, "block_size": 32, "kv_nbytes_per_token": 1024}
    for name in bv.CONFIG_NAMES:
        with pytest.raises(RuntimeError, match=re.escape(f"config {name}: the vLLM process")):
            bv.run_config(name, spec, str(tmp_path), sys.stderr.fileno())
    assert seen == {f"{name}.result.json": "1" for name in bv.CONFIG_NAMES}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the caller's choice stands
    with pytest.raises(RuntimeError):
        bv.run_config("vllm", spec, str(tmp_path), sys.stderr.fileno())
    assert seen["vllm.result.json"] == "0"


@pytest.mark.parametrize("connector", [False, True])
def test_every_config_uses_the_same_executor(connector):
    """With a KV connector vLLM runs its worker in a process of its own; the baseline
    must too, or the two differ in more than the cache."""
    if not _vllm_available():
        if REQUIRE_VLLM:
            pytest.fail("HICACHE_REQUIRE_VLLM=1 but vLLM is not installed")
        pytest.skip("vLLM is not installed")
    from hicache.cli.benchmarks.vllm_engine import _engine_args

    spec = {"model_dir": "m", "dtype": "float32", "enforce_eager": True, "block_size": 32,
            "vllm_blocks": 8, "max_model_len": 256, "gpu_memory_utilization": 0.5,
            "seed": 0, "max_num_seqs": 2}
    if connector:
        spec["kv_transfer_config"] = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
                                      "kv_connector_module_path": "hicache.integrations.vllm"}
    assert _engine_args(spec).distributed_executor_backend == "mp"
