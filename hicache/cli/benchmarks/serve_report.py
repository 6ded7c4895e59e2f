"""Figures of ``hicache bench serve``: per run, per sweep, and the comparisons.

A run (one configuration at one request rate) is summarized by :func:`summarize`:
input and output tokens per second over the run (first request sent to last reply),
TTFT and inter-token latency percentiles (numpy's linear interpolation, as
``vllm bench serve``), the TTFT percentiles of the later turns alone (every turn after
a conversation's first: the turns a KV cache can serve; every conversation's first
turn is computed in every configuration, and at ``inf`` they all start at once), the
share of prompt tokens the server reported cached, and the failed requests.
:func:`loaded_rates` finds the request rates where vLLM alone is loaded: its TTFT p90
at least ``factor`` times its unloaded TTFT p90 (one request at a time);
:func:`compare_at` puts each configuration against vLLM alone at a rate;
:func:`same_outputs` compares greedy replies turn by turn.

What a user of a chat server reads beside those (issue 47):

* :func:`goodput`: the highest request rate at which TTFT p90 stays under an SLO;
* :func:`history_figures`: for every later turn of a conversation, the history its
  prompt could reuse (the previous prompt and reply, as far as this prompt starts with
  them: *reusable*), how much of it the server reported cached (*reused*), and the
  *retokenization loss*: tokens of the previous prompt and generated reply that the
  chat template re-rendered differently in this prompt (no cache can serve them; a
  cache miss is another matter);
* :func:`tier_tokens`: the prompt tokens each tier served in a run (vLLM's own prefix
  cache, hicache's host tier, its third tier) and those computed, from the counters on
  the server's ``/metrics`` before and after the run.

This module knows nothing of HTTP or vLLM.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from hicache.cli.benchmarks.serve_client import Record

PERCENTILES = (50, 90, 99)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    if not len(values):
        return dict.fromkeys([*(f"p{p}" for p in PERCENTILES), "mean", "max"])
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {f"p{p}": round(float(np.percentile(arr, p)), 3)
                                    for p in PERCENTILES}
    out["mean"] = round(float(arr.mean()), 3)
    out["max"] = round(float(arr.max()), 3)
    return out


def summarize(records: Sequence[Record]) -> dict:
    """One run's figures (times in ms, throughputs per second of the run)."""
    ok = [r for r in records if r.error is None]
    duration_s = (max(r.done_s for r in records) - min(r.sent_s for r in records)
                  if records else 0.0)
    prompt_tokens = sum(len(r.prompt) for r in ok)
    output_tokens = sum(len(r.output) for r in ok)
    per_s = (lambda n: round(n / duration_s, 3)) if duration_s > 0 else (lambda n: 0.0)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error is not None})[:3],
        "duration_s": round(duration_s, 3),
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(prompt_tokens),
        "output_throughput": per_s(output_tokens),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_ratio": round(sum(r.cached_tokens for r in ok) / prompt_tokens, 4)
        if prompt_tokens else 0.0,
        "ttft_ms": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "later_ttft_ms": _pcts([r.ttft_s for r in ok if r.ttft_s is not None and r.round_no]),
        "itl_ms": _pcts([x for r in ok for x in r.itl_s]),
    }


def outputs_by_turn(records: Sequence[Record]) -> dict[tuple[int, int, int], list[int]]:
    return {(r.client, r.conversation, r.round_no): r.output for r in records
            if r.error is None}


def same_outputs(a: Sequence[Record], b: Sequence[Record]) -> dict:
    """Turns answered in both runs, and how many of them got a different reply."""
    oa, ob = outputs_by_turn(a), outputs_by_turn(b)
    common = oa.keys() & ob.keys()
    differing = sum(oa[k] != ob[k] for k in common)
    return {"num_compared": len(common), "num_differing": differing}


def goodput(sweep: dict[str, dict], slo_ms: float) -> float:
    """The highest request rate of ``sweep`` (one configuration's runs by rate) at which
    TTFT p90 is at most ``slo_ms`` with no failed request, and at every lower rate too
    (the first rate that misses bounds it: a noisy pass above a miss does not count);
    ``inf`` counts as the request throughput it reached. 0.0 when the lowest rate
    misses."""
    best = 0.0
    for rate in sorted(sweep, key=rate_value):
        s = sweep[rate]
        p90 = s["ttft_ms"]["p90"]
        if p90 is None or p90 > slo_ms or s["num_failed"]:
            break
        best = s["request_throughput"] if rate == "inf" else rate_value(rate)
    return best


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def history_figures(records: Sequence[Record], replies_in_history: bool = True) -> dict:
    """Over every later turn answered after its conversation's previous turn was:
    ``history_tokens``, the previous prompt and reply (``len(prev_prompt +
    prev_output)``); ``reusable_tokens``, their common prefix with this prompt;
    ``reused_tokens``, as much of that as the server reported cached;
    ``retokenization_loss_tokens``, history less reusable: what the chat template
    re-rendered differently (None unless the prompts carry the server's own replies,
    ``replies_in_history``: recorded replies differ from the generated ones anyway)."""
    turns = {(r.client, r.conversation, r.round_no): r for r in records if r.error is None}
    history = reusable = reused = 0
    num = 0
    for (client, conv, round_no), rec in turns.items():
        prev = turns.get((client, conv, round_no - 1)) if round_no else None
        if prev is None:
            continue
        seq = prev.prompt + prev.output
        n = common_prefix(seq, rec.prompt)
        num += 1
        history += len(seq)
        reusable += n
        reused += min(rec.cached_tokens, n)
    loss = history - reusable if replies_in_history else None
    return {
        "num_turns": num, "history_tokens": history, "reusable_tokens": reusable,
        "reused_tokens": reused,
        "reused_share": round(reused / reusable, 4) if reusable else None,
        "retokenization_loss_tokens": loss,
        "retokenization_loss_share": round(loss / history, 4)
        if loss is not None and history else None,
    }


# vLLM's prompt tokens by source, and hicache's hits by tier, on /metrics.
_BY_SOURCE = 'vllm:prompt_tokens_by_source_total{{source="{}"}}'
_HIT = 'vllm:hicache_hit_tokens_total{{tier="{}"}}'
TIER_SERIES = {
    "vllm_prefix": _BY_SOURCE.format("local_cache_hit"),
    "external": _BY_SOURCE.format("external_kv_transfer"),
    "computed": _BY_SOURCE.format("local_compute"),
    "host": _HIT.format("host"),
    "third_tier": _HIT.format("storage"),
    # Not tokens: requests vLLM preempted for KV blocks in the run (a cache too small for
    # what is in flight; vLLM recomputes or reloads them).
    "preemptions": "vllm:num_preemptions_total",
}


def tier_tokens(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Prompt tokens of a run by where they came from (``/metrics`` around it, as
    :func:`~hicache.cli.benchmarks.serve_server.parse_metrics` keys them): ``vllm_prefix``
    (vLLM's own prefix cache), ``host`` and ``third_tier`` (hicache's hits, as the
    connector planned them), ``external`` (what vLLM counted loaded from outside: the
    two before), ``computed``; and ``preemptions``, requests vLLM preempted for KV
    blocks."""
    return counter_deltas(before, after, TIER_SERIES)


def counter_deltas(before: dict[str, float], after: dict[str, float],
                   series: dict[str, str]) -> dict[str, int]:
    """Each of ``series`` (name -> ``/metrics`` key) as its counter's rise from ``before``
    to ``after`` (a series absent counts 0)."""
    return {name: int(round(after.get(key, 0.0) - before.get(key, 0.0)))
            for name, key in series.items()}


# The connector's run-time KV audit on /metrics (docs/vllm.md, "Run-time KV audit").
AUDIT_SERIES = {
    "audited_requests": "vllm:hicache_audited_requests_total",
    "computed_tokens": "vllm:hicache_audit_computed_tokens_total",
    "audited_pages": "vllm:hicache_audited_pages_total",
    "mismatched_pages": "vllm:hicache_audit_mismatches_total",
    "skipped_pages": "vllm:hicache_audit_skipped_pages_total",
}


def audit_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """A run's audit counters (``/metrics`` around it): requests audited, the hit tokens
    they computed instead (the audit's cost), pages compared, found wrong, skipped."""
    return counter_deltas(before, after, AUDIT_SERIES)


def loaded_rates(sweep: dict[str, dict], unloaded_ttft_p90_ms: float,
                 factor: float = 3.0) -> list[str]:
    """The rates (keys of ``sweep``, the baseline's runs by rate), lowest first, whose TTFT
    p90 is at least ``factor`` x ``unloaded_ttft_p90_ms``."""
    return [rate for rate in sorted(sweep, key=rate_value)
            if (p90 := sweep[rate]["ttft_ms"]["p90"]) is not None
            and p90 >= factor * unloaded_ttft_p90_ms]


def rate_value(rate: str) -> float:
    return math.inf if rate == "inf" else float(rate)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def compare_at(runs: dict[str, dict], baseline: str = "vllm") -> dict[str, dict]:
    """Each configuration's figures over the baseline's at one rate: TTFT p90 (of every
    turn, and of the later turns), and ITL p50 ratios (lower is better), input and output
    throughput ratios (higher is better)."""
    base = runs[baseline]
    out = {}
    for name, s in runs.items():
        if name == baseline:
            continue
        out[name] = {
            "ttft_p90_ratio": _ratio(s["ttft_ms"]["p90"], base["ttft_ms"]["p90"]),
            "later_ttft_p90_ratio": _ratio(s["later_ttft_ms"]["p90"],
                                           base["later_ttft_ms"]["p90"]),
            "itl_p50_ratio": _ratio(s["itl_ms"]["p50"], base["itl_ms"]["p50"]),
            "input_throughput_ratio": _ratio(s["input_throughput"], base["input_throughput"]),
            "output_throughput_ratio": _ratio(s["output_throughput"],
                                              base["output_throughput"]),
        }
    return out


def median_run(runs: Sequence[dict]) -> dict:
    """Figures of repeated runs: the median of each throughput and percentile."""
    def med(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(float(np.median(values)), 3) if values else None

    out = dict(runs[0])
    for key in ("request_throughput", "input_throughput", "output_throughput", "duration_s",
                "cached_ratio"):
        out[key] = med([r[key] for r in runs])
    for key in ("ttft_ms", "later_ttft_ms", "itl_ms"):
        out[key] = {k: med([r[key][k] for r in runs]) for k in runs[0][key]}
    out["num_failed"] = sum(r["num_failed"] for r in runs)
    out["num_requests"] = sum(r["num_requests"] for r in runs)
    return out


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def sweep_table(sweeps: dict[str, dict[str, dict]], unloaded: dict[str, dict],
                out: TextIO) -> None:
    """One row per configuration and rate: throughputs, TTFT (every turn's, and the
    later turns' p90) and ITL percentiles."""
    head = (f"{'config':<18} {'rate':>6} {'req/s':>6} {'in tok/s':>9} {'out tok/s':>9} "
            f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'later p90':>9} {'ITL p50':>8} {'p90':>7} "
            f"{'p99':>7} {'cached':>7} {'fail':>4}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for name, by_rate in sweeps.items():
        rows = ([("1 inflt", unloaded[name])] if name in unloaded else []) + [
            (rate, by_rate[rate]) for rate in sorted(by_rate, key=rate_value)]
        for rate, s in rows:
            t, i = s["ttft_ms"], s["itl_ms"]
            print(f"{name:<18} {rate:>6} {_fmt(s['request_throughput'], 2):>6} "
                  f"{_fmt(s['input_throughput']):>9} {_fmt(s['output_throughput'], 1):>9} "
                  f"{_fmt(t['p50']):>9} {_fmt(t['p90']):>8} {_fmt(t['p99']):>8} "
                  f"{_fmt(s['later_ttft_ms']['p90']):>9} {_fmt(i['p50'], 1):>8} "
                  f"{_fmt(i['p90'], 1):>7} {_fmt(i['p99'], 1):>7} "
                  f"{s['cached_ratio']:>7.2f} {s['num_failed']:>4}", file=out)


def plot_sweep(sweeps: dict[str, dict[str, dict]], path: str, title: str) -> None:
    """TTFT p90 and input throughput against the request rate, one line per
    configuration (``inf``, requests sent as fast as the cap allows, drawn rightmost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r for by_rate in sweeps.values() for r in by_rate}, key=rate_value)
    finite = [rate_value(r) for r in rates if r != "inf"]
    inf_x = (max(finite) * 1.4) if finite else 1.0
    xs = {r: (inf_x if r == "inf" else rate_value(r)) for r in rates}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_rate in sweeps.items():
        rs = [r for r in rates if r in by_rate]
        ax1.plot([xs[r] for r in rs], [by_rate[r]["ttft_ms"]["p90"] for r in rs],
                 marker="o", label=name)
        ax2.plot([xs[r] for r in rs], [by_rate[r]["input_throughput"] for r in rs],
                 marker="o", label=name)
    for ax, ylabel in ((ax1, "TTFT p90 (ms)"), (ax2, "input throughput (tokens/s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_xticks([xs[r] for r in rates])
        ax.set_xticklabels(["inf" if r == "inf" else f"{rate_value(r):g}" for r in rates])
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend()
    fig.suptitle(textwrap.fill(title, 110), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
