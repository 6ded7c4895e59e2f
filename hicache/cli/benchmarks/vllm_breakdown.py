"""Where the time to first token goes, per configuration of ``hicache bench vllm``.

A request's TTFT (vLLM's: its first token's step time minus its arrival) splits on
vLLM's own per-request timestamps (engine core clock)::

    arrival        queued                  scheduled                first token
       |<--- front --->|<---- queued ---->|<------- prefill -------->|
        vLLM's engine    waiting in vLLM's   the steps that computed its
        core takes it    queue               prompt, shared with others'
        between steps:
        the rest of the
        step in progress

each step's interval is fitted as a fixed part plus a part per prompt token it
computed (what a TTFT cannot shed by computing fewer tokens), and each step splits, on the connector's clocks (worker side; see
:mod:`hicache.integrations.vllm.clocks`), into the connector's hooks (per hook)
and vLLM's model runner. For the steps that load, the loads' copy time (on the copy
thread) is set against the forward it runs under and the part of it the forward
waited for (``wait_for_layer_load``): what the forward did not wait for is hidden.
Last, the CPU seconds each of vLLM's processes used over the replay: unlike wall
times, they hardly move with what else runs on a shared machine.

Every figure is a mean (ms) over requests or steps; ``None`` where a run has no such
data (vLLM alone has no connector clocks). This module reads result dicts as
:mod:`hicache.cli.benchmarks.vllm_engine` writes them; it prints nothing itself
but :func:`print_breakdown`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import IO

import numpy as np

from hicache.cli.benchmarks.proc_cpu import FRONT_END
from hicache.integrations.vllm.clocks import per_hook

# Figures of breakdown(), in the order they are printed, with their labels.
ROWS = (
    ("TTFT: until queued in vLLM (ms)", "front_ms"),
    ("  queued in vLLM (ms)", "queued_ms"),
    ("  scheduled to first token (ms)", "prefill_ms"),
    ("prompt tokens computed within a TTFT", "computed_in_ttft"),
    ("step interval, median (ms)", "step_ms_median"),
    ("  fit: fixed per step (ms)", "step_fixed_ms"),
    ("  fit: per 1k computed tokens (ms)", "step_ms_per_1k_computed"),
    ("worker: model runner per step (ms)", "model_ms_per_step"),
    ("steps that load", "load_steps"),
    ("  per load step: copy (ms)", "load_copy_ms"),
    ("  forward it ran under (ms)", "load_forward_ms"),
    ("  forward waited for it (ms)", "load_wait_ms"),
    ("  load hidden (share of copy)", "load_hidden"),
    ("CPU over the replay (s): worker", "cpu_worker_s"),
    ("  engine core (scheduler)", "cpu_engine_core_s"),
    ("  front end", "cpu_front_end_s"),
)

# Process names (Linux's 15-character ``comm``) of vLLM's processes, by what they run.
_PROCESSES = {"cpu_worker_s": "VLLM::Worker", "cpu_engine_core_s": "VLLM::EngineC",
              "cpu_front_end_s": FRONT_END}


def breakdown(result: dict) -> dict:
    """The TTFT and step breakdown of one run (see the module docstring)."""
    recs = result["requests"]
    c = result.get("connector_stats") or {}
    out: dict = {}
    ttft = _mean_ms([r["ttft_s"] for r in recs])
    queued = _mean_ms([r.get("queued_s") for r in recs])
    prefill = _mean_ms([r.get("prefill_s") for r in recs])
    out["queued_ms"], out["prefill_ms"] = queued, prefill
    out["front_ms"] = (round(ttft - queued - prefill, 2)
                       if ttft is not None and queued is not None and prefill is not None
                       else None)
    steps = np.diff(np.sort(np.asarray(result.get("step_times") or [], dtype=float)))
    out["step_ms_median"] = round(float(np.median(steps)) * 1e3, 2) if steps.size else None
    out["step_fixed_ms"], out["step_ms_per_1k_computed"] = _step_fit(result)
    out["computed_in_ttft"] = _computed_in_ttft(result)
    out["model_ms_per_step"] = _ratio_ms(c.get("model_seconds"), c.get("model_steps"))
    n_load = c.get("load_forward_steps") or 0
    out["load_steps"] = n_load if c else None
    waits = per_hook(c).get("wait_for_layer_load", 0.0)
    out["load_copy_ms"] = _ratio_ms(c.get("load_seconds"), n_load)
    out["load_forward_ms"] = _ratio_ms(c.get("load_forward_seconds"), n_load)
    out["load_wait_ms"] = _ratio_ms(waits, n_load)
    copy_s = c.get("load_seconds") or 0.0
    out["load_hidden"] = round(max(0.0, 1.0 - waits / copy_s), 3) if n_load and copy_s else None
    cpu = result.get("cpu_seconds") or {}
    for key, prefix in _PROCESSES.items():
        seconds = [s for name, s in cpu.items() if name.startswith(prefix)]
        out[key] = round(sum(seconds), 2) if seconds else None
    out["worker_hooks_ms"] = _hooks_ms(c, "", c.get("steps"))
    out["scheduler_hooks_ms"] = _hooks_ms(c, "scheduler_", c.get("scheduler_steps"))
    out["worker_hooks_cpu_ms"] = _hooks_ms(c, "", c.get("steps"), "cpu_seconds")
    out["scheduler_hooks_cpu_ms"] = _hooks_ms(c, "scheduler_", c.get("scheduler_steps"),
                                              "cpu_seconds")
    return out


def median_breakdown(each: list[dict]) -> dict:
    """Each figure's median over runs (per hook for the hook tables)."""
    out: dict = {}
    for key in each[0]:
        if key.endswith(("_hooks_ms", "_hooks_cpu_ms")):
            hooks = {h for b in each for h in b[key]}
            out[key] = {h: round(statistics.median([b[key].get(h, 0.0) for b in each]), 4)
                        for h in sorted(hooks)}
            continue
        values = [b[key] for b in each if b[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def print_breakdown(configs: dict[str, dict], out: IO[str], width: int,
                    fmt: Callable[[object], str]) -> None:
    """The breakdown rows of every configuration (``configs[name]["breakdown"]``, each
    value written by ``fmt``), then the connector's time per step by hook (wall / CPU
    ms; configurations with a connector)."""
    names = list(configs)
    print("\nwhere the time goes", file=out)
    for label, key in ROWS:
        print(f"{label:<32}" + "".join(f"{fmt(configs[n]['breakdown'][key]):>{width}}"
                                        for n in names), file=out)
    for side in ("worker", "scheduler"):
        wall = {n: configs[n]["breakdown"][f"{side}_hooks_ms"] for n in names}
        cpu = {n: configs[n]["breakdown"][f"{side}_hooks_cpu_ms"] for n in names}
        hooks = sorted({h for n in names for h in wall[n]})
        if hooks:
            print(f"connector per step by hook, {side}: wall / CPU (ms)", file=out)
        for h in hooks:
            print(f"  {h:<30}" + "".join(
                f"{_fmt_ms(wall[n].get(h), cpu[n].get(h)):>{width}}" for n in names), file=out)


def _computed_in_ttft(result: dict) -> float | None:
    """Mean over requests of the prompt tokens computed by the steps within its TTFT
    (those whose outputs came after its arrival, up to its first token's step): the
    work its first token waited for, its own prompt's and the others' of those steps."""
    recs = result["requests"]
    times = np.asarray(result.get("step_times") or [], dtype=float)
    computed = np.asarray(result.get("step_computed") or [], dtype=float)
    if not recs or times.size == 0 or times.size != computed.size or any(
            "arrival_s" not in r for r in recs):
        return None
    order = np.argsort(times, kind="stable")
    times, cumulative = times[order], np.concatenate([[0.0], np.cumsum(computed[order])])
    arrival = np.array([r["arrival_s"] for r in recs])
    first = arrival + np.array([r["ttft_s"] for r in recs])
    # the same steps as vllm_report's steps_in_ttft: (arrival, first token]
    hi = np.searchsorted(times, first + 1e-6, "right")
    lo = np.searchsorted(times, arrival, "right")
    return round(float(np.mean(cumulative[hi] - cumulative[lo])), 1)


def _step_fit(result: dict) -> tuple[float | None, float | None]:
    """Least squares of each step's interval (since the previous step's outputs) on the
    prompt tokens it computed: ``interval = fixed + per_token x computed``, returned as
    (fixed ms, ms per 1,000 computed tokens); Nones without per-step counts."""
    times = np.asarray(result.get("step_times") or [], dtype=float)
    computed = np.asarray(result.get("step_computed") or [], dtype=float)
    if times.size != computed.size or times.size < 3:
        return None, None
    order = np.argsort(times, kind="stable")
    dt, x = np.diff(times[order]), computed[order][1:]
    if np.ptp(x) == 0:
        return None, None
    per_token, fixed = np.polyfit(x, dt, 1)
    return round(float(fixed) * 1e3, 2), round(float(per_token) * 1e6, 2)


def _fmt_ms(wall: float | None, cpu: float | None) -> str:
    return "-" if wall is None else f"{wall:.3f} / {cpu or 0.0:.3f}"


def _mean_ms(values: list) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return round(float(np.mean(values)) * 1e3, 2)


def _ratio_ms(seconds: float | None, count: int | None) -> float | None:
    if not count or seconds is None:
        return None
    return round(seconds / count * 1e3, 3)


def _hooks_ms(c: dict, prefix: str, steps: int | None,
              kind: str = "seconds") -> dict[str, float]:
    """ms per step of each hook (``kind``: wall ``seconds`` or ``cpu_seconds``), over the
    side's steps."""
    if not steps:
        return {}
    return {hook: round(s / steps * 1e3, 4) for hook, s in per_hook(c, prefix, kind).items()}
