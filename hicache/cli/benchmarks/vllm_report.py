"""The report of ``hicache bench vllm``: per-configuration figures, comparisons, plot, JSON.

Input: one result per configuration as :mod:`hicache.cli.benchmarks.vllm_engine` writes
it (per-request records plus the engine's stat-logger sums). Prompt tokens are split
by who served them, from vLLM's own accounting:

    prompt tokens = computed + vLLM prefix cache + external (the connector)
    external      = hicache host + storage (+ unspecified)

The external split comes from the connector's hits per tier
(``get_external_cache_hit_sources``: ``host``, ``disk``); tokens a connector reports
without a tier are shown as ``unspecified`` rather than guessed.

A configuration may have run several times (``--repeat``): it then shows the median of
each figure over its runs, the ratios are those of the medians, and the JSON also
keeps every run's figures and every round's paired ratios.
"""

from __future__ import annotations

import statistics
from typing import IO

import numpy as np

from hicache.cli import plots
from hicache.cli.benchmarks.vllm_breakdown import breakdown, median_breakdown, print_breakdown

# Targets of issue 18, checked by the comparisons below (what they apply to is stated).
TTFT_SPEEDUP_TARGET = 2.0  # vllm / vllm+host mean TTFT, working set >= 4x vLLM's cache
COMPUTED_REDUCTION_TARGET = 3.0  # vllm / vllm+host prompt tokens computed
STORAGE_KEEP_TARGET = 0.9  # vllm+host+storage / vllm+host hicache-served tokens
NOREUSE_RPS_TARGET = 0.95  # vllm+host / vllm req/s when nothing can hit
FITS_TTFT_DELTA_MS = 2.0  # vllm+host - vllm mean TTFT when vLLM's cache serves everything
FITS_DECODE_DELTA_MS = 0.5  # vllm+host - vllm decode step
# Issue 26: (vllm / vllm+host mean TTFT) / (vllm / vllm+host computed tokens), agentic.
LOADS_FREE_TARGET = 0.9
# Issue 37: a hybrid model's host bytes per cached token / storing every window page.
HYBRID_HOST_BYTES_TARGET = 0.4


def summarize(result: dict) -> dict:
    """One configuration's figures (times in ms, tokens as counts)."""
    recs = result["requests"]
    ttft_ms = np.array([r["ttft_s"] for r in recs]) * 1e3
    steps = [r["decode_step_s"] for r in recs if r["decode_step_s"] is not None]
    p = result["prompt_token_stats"]
    by_source = result["connector_hits_by_source"]
    host = by_source.get("host", 0)
    storage = by_source.get("disk", 0)
    external = p.get("external_kv_transfer", 0)
    cstats = result["connector_stats"] or {}
    worker_ms, sched_ms = _per_step_ms(cstats, ""), _per_step_ms(cstats, "scheduler_")
    worker_cpu, sched_cpu = _per_step_ms(cstats, "", "cpu_"), _per_step_ms(cstats, "scheduler_", "cpu_")
    in_ttft = _steps_in_ttft(recs, result.get("step_times"))
    step_ms = _step_intervals_ms(result.get("step_times"))
    return {
        "requests": len(recs),
        "failed": result["num_failed"],
        "errors": result.get("errors", []),
        "ttft_mean_ms": round(float(ttft_ms.mean()), 2),
        "ttft_p50_ms": round(float(np.percentile(ttft_ms, 50)), 2),
        "ttft_p99_ms": round(float(np.percentile(ttft_ms, 99)), 2),
        "prompt_tokens": int(sum(r["prompt_tokens"] for r in recs)),
        "computed_tokens": int(p.get("computed", 0)),
        "vllm_hit_tokens": int(p.get("local_cache_hit", 0)),
        "external_hit_tokens": int(external),
        "host_hit_tokens": int(host),
        "storage_hit_tokens": int(storage),
        "unspecified_hit_tokens": int(external - host - storage),
        "req_per_s": round(len(recs) / result["wall_s"], 3),
        "wall_s": round(result["wall_s"], 2),
        "decode_step_ms": round(float(np.mean(steps)) * 1e3, 3) if steps else None,
        # the connector's own time per vLLM step: its worker-side hooks (copies
        # included) and its scheduler-side ones (lookups, plans)
        "connector_ms_per_step": worker_ms,
        "connector_scheduler_ms_per_step": sched_ms,
        # of that, the CPU time of the hooks' own thread (wall time also counts waits
        # for a core, e.g. the scheduler process sharing one with the front end)
        "connector_cpu_ms_per_step": worker_cpu,
        "connector_scheduler_cpu_ms_per_step": sched_cpu,
        # vLLM steps that ended within a request's TTFT (mean over requests), and what
        # the connector's time per step (both halves) comes to over that many steps
        "steps_in_ttft": None if in_ttft is None else round(in_ttft, 2),
        "connector_ttft_ms": _times(in_ttft, worker_ms, sched_ms),
        "connector_ttft_cpu_ms": _times(in_ttft, worker_cpu, sched_cpu),
        # time between two steps' outputs: a step that stalls (a synchronous storage
        # read) stalls every request of its batch
        "step_p50_ms": _pct(step_ms, 50), "step_p90_ms": _pct(step_ms, 90),
        "step_p99_ms": _pct(step_ms, 99), "step_max_ms": _pct(step_ms, 100),
        "preemptions": int(sum(r["preemptions"] for r in recs)),
        # bytes copied into the host tier (the write policy's traffic), None without one
        "host_bytes_written": int(cstats["save_bytes"]) if "save_bytes" in cstats else (
            0 if cstats else None),
        "engine_start_s": round(result["engine_start_s"], 1),
        "connector_stats": result["connector_stats"] or None,  # the connector's totals
        # where a TTFT and a step go (vllm_breakdown)
        "breakdown": breakdown(result),
    }


def _steps_in_ttft(recs: list[dict], step_times: list[float] | None) -> float | None:
    """Mean over requests of the steps whose outputs vLLM handled after the request
    arrived and up to its first token (that step included): the steps it waited for."""
    if not step_times or not recs or any("arrival_s" not in r for r in recs):
        return None
    ts = np.sort(np.asarray(step_times))
    arrival = np.array([r["arrival_s"] for r in recs])
    first = arrival + np.array([r["ttft_s"] for r in recs])
    # vLLM's TTFT is the first token's step time minus arrival: that step is counted
    counts = np.searchsorted(ts, first + 1e-6, "right") - np.searchsorted(ts, arrival, "right")
    return float(counts.mean())


def _step_intervals_ms(step_times: list[float] | None) -> np.ndarray | None:
    if not step_times or len(step_times) < 2:
        return None
    return np.diff(np.sort(np.asarray(step_times))) * 1e3


def _pct(values: np.ndarray | None, q: float) -> float | None:
    return None if values is None else round(float(np.percentile(values, q)), 2)


def _times(steps: float | None, *per_step_ms: float | None) -> float | None:
    known = [ms for ms in per_step_ms if ms is not None]
    if steps is None or len(known) != len(per_step_ms):
        return None
    return round(steps * sum(known), 3)


def _per_step_ms(cstats: dict, prefix: str, clock: str = "") -> float | None:
    steps = cstats.get(f"{prefix}steps", 0)
    if not steps or f"{prefix}hook_{clock}seconds" not in cstats:
        return None
    return round(cstats[f"{prefix}hook_{clock}seconds"] / steps * 1e3, 3)


# Figures that vary from run to run (a repeated configuration shows their median) and
# counts (its median_low: a count one of the runs measured).
TIMED_KEYS = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "req_per_s", "wall_s",
              "decode_step_ms", "connector_ms_per_step", "connector_scheduler_ms_per_step",
              "connector_cpu_ms_per_step", "connector_scheduler_cpu_ms_per_step",
              "steps_in_ttft", "connector_ttft_ms", "connector_ttft_cpu_ms",
              "step_p50_ms", "step_p90_ms", "step_p99_ms", "step_max_ms", "engine_start_s")
COUNT_KEYS = ("computed_tokens", "vllm_hit_tokens", "external_hit_tokens", "host_hit_tokens",
              "storage_hit_tokens", "unspecified_hit_tokens", "preemptions",
              "host_bytes_written")


def summarize_runs(runs: list[dict]) -> dict:
    """One configuration over its runs (at least one): a single run's figures as they
    are; for several, each figure's median, with every run's figures under ``runs``
    (and the connector's totals per run there; the top level keeps the first run's)."""
    if not runs:
        raise ValueError("summarize_runs: expected at least one run, got none")
    each = [summarize(r) for r in runs]
    if len(each) == 1:
        return each[0]
    out = dict(each[0])
    for key in TIMED_KEYS + COUNT_KEYS:
        values = [s[key] for s in each if s[key] is not None]
        if not values:
            out[key] = None
        elif key in COUNT_KEYS:
            out[key] = statistics.median_low(values)
        else:
            out[key] = round(statistics.median(values), 3)
    out["breakdown"] = median_breakdown([s["breakdown"] for s in each])
    out["failed"] = sum(s["failed"] for s in each)
    out["errors"] = [e for s in each for e in s["errors"]]
    out["runs"] = [{k: s[k] for k in ("failed", *TIMED_KEYS, *COUNT_KEYS, "connector_stats",
                                      "breakdown")}
                   for s in each]
    return out


def flatten_runs(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Every run as a configuration of its own (``name`` for a single run, else
    ``name#1``, ``name#2``, ...), in order."""
    return {(name if len(runs) == 1 else f"{name}#{i + 1}"): run
            for name, runs in results.items() for i, run in enumerate(runs)}


def outputs_identical(results: dict[str, dict]) -> tuple[bool, int]:
    """Whether every request generated the same tokens in every configuration.

    Returns ``(identical, number of requests whose tokens differ somewhere)``; a
    request missing from a configuration (failed) counts as differing.
    """
    per_config = [{r["id"]: r["output"] for r in res["requests"]} for res in results.values()]
    ids = set().union(*per_config)
    differ = sum(1 for i in ids if len({tuple(c.get(i, (-1,))) for c in per_config}) != 1)
    return differ == 0, differ


def differing_vs_first(results: dict[str, dict]) -> dict[str, int]:
    """Per configuration: requests finished in it and in the first one with other tokens."""
    first = {r["id"]: r["output"] for r in next(iter(results.values()))["requests"]}
    return {name: sum(1 for r in res["requests"] if r["id"] in first
                      and r["output"] != first[r["id"]])
            for name, res in results.items()}


def compare_per_run(configs: dict[str, dict]) -> list[dict]:
    """:func:`compare` for each round of repeated runs (round ``i``: every configuration's
    ``i``-th run); empty unless every configuration ran the same number of times > 1."""
    counts = {len(c.get("runs", ())) for c in configs.values()}
    if len(counts) != 1 or (n := counts.pop()) < 2:
        return []
    return [compare({name: c["runs"][i] for name, c in configs.items()}) for i in range(n)]


def compare(configs: dict[str, dict]) -> dict:
    """Ratios and deltas of the connector configurations against ``vllm``.

    Only between configurations where every request finished: a ratio over
    different sets of requests would mean nothing.
    """
    out: dict = {}
    complete = {name: c for name, c in configs.items() if c["failed"] == 0}
    base = complete.get("vllm")
    host = complete.get("vllm+host")
    storage = complete.get("vllm+host+storage")
    fits = complete.get("vllm-fits")
    for name, c in complete.items():
        if name == "vllm" or base is None:
            continue
        speedup = _ratio(base["ttft_mean_ms"], c["ttft_mean_ms"])
        reduction = _ratio(base["computed_tokens"], c["computed_tokens"])
        out[name] = {
            "ttft_mean_speedup": speedup,
            "computed_reduction": reduction,
            # issue 26's "loads close to free": the TTFT gain per computed-token gain
            "ttft_gain_per_computed_gain": (_ratio(speedup, reduction)
                                            if speedup and reduction else None),
            "req_per_s_ratio": _ratio(c["req_per_s"], base["req_per_s"]),
            "ttft_mean_delta_ms": round(c["ttft_mean_ms"] - base["ttft_mean_ms"], 2),
            "decode_step_delta_ms": (round(c["decode_step_ms"] - base["decode_step_ms"], 3)
                                     if c["decode_step_ms"] is not None
                                     and base["decode_step_ms"] is not None else None),
        }
        if fits is not None and name != "vllm-fits":
            # its TTFT over vLLM's with the working set in its own blocks (1.0: hits cost
            # what vLLM's own do; the loads are free)
            out[name]["ttft_vs_fits"] = _ratio(c["ttft_mean_ms"], fits["ttft_mean_ms"])
    if host is not None and storage is not None:
        out["storage_keeps_hits"] = _ratio(storage["external_hit_tokens"],
                                           host["external_hit_tokens"])
    for name in ("vllm+host+wb", "vllm+host+sel"):  # write policies vs write_through
        policy = complete.get(name)
        if host is not None and policy is not None:
            out[f"{name} vs vllm+host"] = {
                "bytes_written_reduction": _ratio(host["host_bytes_written"] or 0,
                                                  policy["host_bytes_written"] or 0),
                "host_bytes_written": [host["host_bytes_written"],
                                       policy["host_bytes_written"]],
                "ttft_mean_ratio": _ratio(policy["ttft_mean_ms"], host["ttft_mean_ms"]),
                "cached_tokens_delta": (
                    policy["vllm_hit_tokens"] + policy["external_hit_tokens"]
                    - host["vllm_hit_tokens"] - host["external_hit_tokens"]),
            }
    prefetch = complete.get("vllm+host+storage+async")
    if storage is not None and prefetch is not None:
        out["async_vs_sync_storage"] = {
            "ttft_mean_speedup": _ratio(storage["ttft_mean_ms"], prefetch["ttft_mean_ms"]),
            "step_p99_ratio": _ratio(prefetch["step_p99_ms"] or 0, storage["step_p99_ms"]),
        }
    return out


def hybrid_host_pages(cstats: dict | None, model: dict, block_size: int) -> dict | None:
    """A hybrid model's host tier at the end of a run (the connector's occupancy, one
    page a KV cache group's block): its pages per cached token, against storing every
    sliding-window group's page of every cached token (vLLM's OffloadingConnector by
    default, and SGLang's HiCache). None without the connector's figures."""
    if not cstats or "host_window_pages" not in cstats:
        return None
    used = int(cstats.get("host_pages_used", 0))
    components = int(cstats["host_window_pages"]) + int(cstats.get("host_state_pages", 0))
    full = used - components  # full-attention pages: one a cached block of tokens
    if full <= 0:
        return None
    groups = int(model["num_window_groups"])
    head_dim = model["hidden_size"] // model["num_heads"]
    # one group's bytes a token: K and V of as many layers as there are full-attention ones
    group_nbytes = 2 * model["num_kv_heads"] * head_dim * 4 * (
        model["num_layers"] // model["full_every"])
    B = block_size
    return {"host_pages": used, "full_pages": full, "window_pages": components,
            "cached_tokens": full * B,
            "bytes_per_cached_token": used * group_nbytes // full,
            "every_window_page_bytes_per_token": (1 + groups) * group_nbytes,
            "vs_every_window_page": round(used / (full * (1 + groups)), 3)}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def print_table(configs: dict[str, dict], comparisons: dict, identical: tuple[bool, int],
                out: IO[str], per_run: list[dict] | None = None) -> None:
    names = list(configs)
    if per_run:
        print(f"\nmedians of {len(per_run)} runs per configuration (rounds interleaved, "
              "each round's order the reverse of the previous one's)", file=out)
    rows = [
        ("TTFT mean (ms)", "ttft_mean_ms"), ("TTFT p50 (ms)", "ttft_p50_ms"),
        ("TTFT p99 (ms)", "ttft_p99_ms"), ("prompt tokens", "prompt_tokens"),
        ("  computed", "computed_tokens"), ("  vLLM prefix cache", "vllm_hit_tokens"),
        ("  hicache host", "host_hit_tokens"), ("  storage", "storage_hit_tokens"),
        ("  connector, tier unknown", "unspecified_hit_tokens"), ("requests/s", "req_per_s"),
        ("decode step (ms)", "decode_step_ms"),
        ("connector per step, worker (ms)", "connector_ms_per_step"),
        ("  its CPU time (ms)", "connector_cpu_ms_per_step"),
        ("  scheduler (ms)", "connector_scheduler_ms_per_step"),
        ("  its CPU time (ms)", "connector_scheduler_cpu_ms_per_step"),
        ("steps within a TTFT (mean)", "steps_in_ttft"),
        ("connector within a TTFT (ms)", "connector_ttft_ms"),
        ("  its CPU time (ms)", "connector_ttft_cpu_ms"),
        ("step interval p50 (ms)", "step_p50_ms"), ("  p90 (ms)", "step_p90_ms"),
        ("  p99 (ms)", "step_p99_ms"), ("  max (ms)", "step_max_ms"),
        ("preemptions", "preemptions"),
        ("host tier bytes written", "host_bytes_written"),
        ("failed requests", "failed"), ("engine start (s)", "engine_start_s"),
    ]
    width = max(20, *(len(n) + 2 for n in names))
    print(f"\n{'':<32}" + "".join(f"{n:>{width}}" for n in names), file=out)
    for label, key in rows:
        print(f"{label:<32}" + "".join(f"{_fmt(configs[n][key]):>{width}}" for n in names),
              file=out)
    print_breakdown(configs, out, width, _fmt)
    same, differ = identical
    print(f"generated tokens identical across configs (greedy): "
          f"{'yes' if same else f'NO, {differ} requests differ or failed'}", file=out)
    for name, c in configs.items():
        if c["failed"]:
            print(f"{name}: {c['failed']} requests FAILED, first error: "
                  f"{(c['errors'] or ['?'])[0][:300]}; no comparison made with it", file=out)
        if c["tokens_differ_vs_first"]:
            print(f"{name}: {c['tokens_differ_vs_first']} finished requests generated other "
                  f"tokens than {names[0]}", file=out)
    for name, c in comparisons.items():
        if name.endswith(" vs vllm+host"):
            fewer = ("none written" if c["host_bytes_written"][1] == 0
                     else f"{_fmt(c['bytes_written_reduction'])}x fewer")
            print(f"{name}: host-tier bytes written {fewer} "
                  f"({_fmt(c['host_bytes_written'][1])} vs {_fmt(c['host_bytes_written'][0])}); "
                  f"mean TTFT x{_fmt(c['ttft_mean_ratio'])}; cached prompt tokens "
                  f"{c['cached_tokens_delta']:+,}", file=out)
            continue
        if name == "storage_keeps_hits":
            print(f"vllm+host+storage / vllm+host hicache-served tokens: {_fmt(c)} "
                  f"(target >= {STORAGE_KEEP_TARGET}, working set >= 4x vLLM's cache)", file=out)
            continue
        if name == "async_vs_sync_storage":
            print(f"vllm+host+storage+async vs vllm+host+storage: mean TTFT "
                  f"{_fmt(c['ttft_mean_speedup'])}x lower, step interval p99 "
                  f"x{_fmt(c['step_p99_ratio'])}", file=out)
            continue
        print(f"{name} vs vllm: mean TTFT {_fmt(c['ttft_mean_speedup'])}x lower "
              f"(target >= {TTFT_SPEEDUP_TARGET} when the working set is >= 4x vLLM's cache), "
              f"computed tokens {_fmt(c['computed_reduction'])}x fewer "
              f"(target >= {COMPUTED_REDUCTION_TARGET})", file=out)
        print(f"{'':<{len(name)}}          req/s x{_fmt(c['req_per_s_ratio'])} "
              f"(target >= {NOREUSE_RPS_TARGET} on noreuse); TTFT "
              f"{c['ttft_mean_delta_ms']:+.2f} ms, decode step "
              f"{_fmt(c['decode_step_delta_ms'])} ms (targets <= +{FITS_TTFT_DELTA_MS} and "
              f"<= +{FITS_DECODE_DELTA_MS} when vLLM's cache holds the working set)", file=out)
        print(f"{'':<{len(name)}}          TTFT gain / computed-token gain "
              f"{_fmt(c['ttft_gain_per_computed_gain'])} (target >= {LOADS_FREE_TARGET})"
              + (f"; mean TTFT {_fmt(c['ttft_vs_fits'])}x vllm-fits' (1.00: hits cost what "
                 "vLLM's own do)" if "ttft_vs_fits" in c else ""), file=out)
        rounds = [r[name] for r in per_run or () if name in r]
        if rounds:
            print(f"{'':<{len(name)}}          per run: mean TTFT "
                  f"{', '.join(_fmt(r['ttft_mean_speedup']) for r in rounds)}x lower; "
                  f"decode step {', '.join(_fmt(r['decode_step_delta_ms']) for r in rounds)} "
                  "ms; TTFT gain / computed-token gain "
                  f"{', '.join(_fmt(r['ttft_gain_per_computed_gain']) for r in rounds)}"
                  + ("; x vllm-fits' TTFT "
                     f"{', '.join(_fmt(r.get('ttft_vs_fits')) for r in rounds)}"
                     if "ttft_vs_fits" in c else ""), file=out)


def plot_ttft_cdf(path: str, results: dict[str, list[dict]], title: str) -> None:
    """The TTFT CDF of every configuration, the requests of all its runs together (a
    configuration's label names its failures)."""
    ttft_ms = {}
    for name, runs in results.items():
        failed = sum(res["num_failed"] for res in runs)
        label = f"{name} ({failed} requests failed)" if failed else name
        ttft_ms[label] = [r["ttft_s"] * 1e3 for res in runs for r in res["requests"]]
    plots.plot_ttft_cdf(path, ttft_ms, title)


def report(results: dict[str, list[dict]], model: dict, plan: dict, *, out: IO[str],
           plot: str | None, title: str) -> dict:
    """Print the table (and plot); return the JSON summary of the run.

    ``results``: per configuration, its runs (one or more), as the engine wrote them.
    Generated tokens must agree across every run of every configuration.
    """
    configs = {name: summarize_runs(runs) for name, runs in results.items()}
    flat = flatten_runs(results)
    differ = differing_vs_first(flat)
    for name, runs in results.items():
        keys = [name] if len(runs) == 1 else [f"{name}#{i + 1}" for i in range(len(runs))]
        configs[name]["tokens_differ_vs_first"] = sum(differ[k] for k in keys)
    comparisons = compare(configs)
    per_run = compare_per_run(configs)
    identical = outputs_identical(flat)
    print_table(configs, comparisons, identical, out, per_run)
    if model.get("num_window_groups"):
        hybrid = {name: h for name, c in configs.items()
                  if (h := hybrid_host_pages(c["connector_stats"], model, plan["block_size"]))
                  is not None}
        comparisons["hybrid_host_pages"] = hybrid
        for name, h in hybrid.items():
            print(f"{name}: host tier {h['host_pages']:,} pages for {h['cached_tokens']:,} cached "
                  f"tokens: {h['bytes_per_cached_token']:,} bytes a token, x"
                  f"{_fmt(h['vs_every_window_page'])} of storing every sliding-window page "
                  f"({h['every_window_page_bytes_per_token']:,} bytes a token; target <= "
                  f"{HYBRID_HOST_BYTES_TARGET})", file=out)
    if plot:
        plot_ttft_cdf(plot, results, f"hicache bench vllm: {title}")
        print(f"TTFT CDF written to {plot}", file=out)
    summary = {"model": model, "plan": plan, "configs": configs, "comparisons": comparisons,
               "tokens_identical": identical[0], "requests_differing": identical[1]}
    if per_run:
        summary["comparisons_per_run"] = per_run
    return summary
