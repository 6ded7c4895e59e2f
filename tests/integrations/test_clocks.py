"""clocks: the connector's time per hook and the model runner's, exact (no vLLM)."""

from __future__ import annotations

import pytest

from hicache.integrations.vllm.clocks import HookClock, _clocked, per_hook


def _step(clock: HookClock, t: float, *, load: bool) -> None:
    """One worker step at time ``t``: hooks of 1 ms, the forward 10 ms."""
    clock.add("handle_preemptions", t, t + 0.001, 0.0005)
    if load:  # a sync load: started before the forward, waited for inside it
        clock.add("start_load_kv", t + 0.002, t + 0.003, 0.001, loading=True)
        clock.add("wait_for_layer_load", t + 0.004, t + 0.006, 0.0)
    else:  # vLLM calls start_load_kv after the forward when nothing loads
        clock.add("start_load_kv", t + 0.011, t + 0.0111, 0.0001)
    clock.add("wait_for_save", t + 0.013, t + 0.014, 0.001)


def test_hooks_are_summed_per_name_and_the_model_runner_is_timed():
    clock = HookClock()
    _step(clock, 0.0, load=True)
    _step(clock, 1.0, load=False)
    out = clock.take()
    assert per_hook(out, kind="calls") == {"handle_preemptions": 2, "start_load_kv": 2,
                                           "wait_for_layer_load": 1, "wait_for_save": 2}
    assert per_hook(out)["start_load_kv"] == pytest.approx(0.001 + 0.0001)
    assert per_hook(out, kind="cpu_seconds")["handle_preemptions"] == pytest.approx(0.001)
    # model runner: from handle_preemptions' return to wait_for_save's call, both steps
    assert out["model_steps"] == 2 and out["model_seconds"] == pytest.approx(2 * 0.012)
    # the forward a load ran under: from start_load_kv's return, the loading step only
    assert out["load_forward_steps"] == 1
    assert out["load_forward_seconds"] == pytest.approx(0.010)
    assert clock.take() == {}  # taken: zero again


def test_a_step_cut_by_a_take_is_counted_once_in_the_next():
    clock = HookClock()
    clock.add("handle_preemptions", 0.0, 0.001, 0.0)
    assert clock.take() == {"hook_seconds.handle_preemptions": 0.001,
                            "hook_cpu_seconds.handle_preemptions": 0.0,
                            "hook_calls.handle_preemptions": 1}
    clock.add("wait_for_save", 0.011, 0.012, 0.0)
    out = clock.take()
    assert out["model_steps"] == 1 and out["model_seconds"] == pytest.approx(0.010)
    # a wait_for_save without a step start (the first after start-up) times nothing
    clock.add("wait_for_save", 0.02, 0.021, 0.0)
    assert "model_steps" not in clock.take()


def test_prefix_keeps_the_sides_apart_and_bad_arguments_are_named():
    clock = HookClock("scheduler_")
    clock.add("build_connector_meta", 0.0, 0.002, 0.001)
    out = clock.take()
    assert per_hook(out, "scheduler_") == {"build_connector_meta": 0.002}
    assert per_hook(out) == {}  # the worker side's keys: none
    with pytest.raises(TypeError, match="prefix: expected a str, got int"):
        HookClock(3)
    with pytest.raises(ValueError, match="kind: expected 'seconds', 'cpu_seconds' or "
                                         "'calls', got 'ms'"):
        per_hook(out, kind="ms")


def test_clocked_reports_each_call_by_name_even_when_it_raises():
    seen = []

    class Hooks:
        @_clocked(lambda self, hook, start, end, cpu: seen.append((hook, end >= start)))
        def _wait_for_layer_load(self, x):
            if x:
                raise RuntimeError("boom")
            return 7

    assert Hooks()._wait_for_layer_load(0) == 7
    with pytest.raises(RuntimeError, match="boom"):
        Hooks()._wait_for_layer_load(1)
    assert seen == [("wait_for_layer_load", True), ("wait_for_layer_load", True)]
