"""The report of ``bench multiturn`` and ``demo``: per-configuration metrics, table, verdicts.

Input: the :class:`~hicache.cli.benchmarks.multiturn_runs.ConfigResult` of each
configuration. Hit ratios are over all prompt tokens; "storage" is the part of the
host hits read from the third tier first.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from hicache.cli.benchmarks.multiturn_runs import ConfigResult, Request


def summarize(res: ConfigResult, requests: Sequence[Request]) -> dict:
    """The JSON metrics of one configuration."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ttft_ms = [r.ttft_s * 1e3 for r in res.results]
    device_hit = sum(r.device_hit_tokens for r in res.results)
    host_hit = sum(r.host_hit_tokens for r in res.results)
    # Tokens read from storage into host memory, then loaded back as host hits (a
    # fetched page that is evicted before use, or computed meanwhile, counts too).
    storage_hit = res.stats.get("storage_hit_tokens", 0)
    read_s = res.stats.get("storage_read_seconds", 0.0)
    return {
        "requests": len(res.results),
        "ttft_mean_ms": statistics.fmean(ttft_ms),
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
        "hit_ratio": (device_hit + host_hit) / prompt_tokens,
        "device_hit_ratio": device_hit / prompt_tokens,
        "host_hit_ratio": host_hit / prompt_tokens,
        "storage_hit_ratio": storage_hit / prompt_tokens,
        "storage_hit_tokens": storage_hit,
        "storage_read_gbps": res.stats.get("storage_read_bytes", 0) / read_s / 1e9
        if read_s else 0.0,
        "storage_write_bytes": res.stats.get("storage_write_bytes", 0),
        "storage_errors": res.stats.get("storage_errors", 0),
        "host_evicted_tokens": res.stats.get("host_evicted_tokens", 0),
        "computed_tokens": sum(r.computed_tokens for r in res.results),
        "prompt_tokens": prompt_tokens,
        "req_per_s": len(res.results) / res.wall_s,
        "wall_s": res.wall_s,
        "load_failures": sum(r.num_load_failures for r in res.results),
        "device_evicted_tokens": res.stats.get("device_evicted_tokens", 0),
        "load_gbps": res.stats.get("load_gbps", 0.0),
    }


def format_table(summaries: dict[str, dict]) -> list[str]:
    """One row per configuration; a "storage" column when a storage tier took part."""
    w = max(14, *(len(name) for name in summaries))
    with_storage = any(s.get("storage_hit_tokens") or s.get("storage_write_bytes")
                       for s in summaries.values())
    header = (f"{'config':<{w}} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'hit':>6} "
              f"{'device':>7} {'host':>6}" + (f" {'(from':>8}" if with_storage else "")
              + f" {'computed':>9} {'req/s':>7}")
    lines = [header, f"{'':<{w}} {'(ms)':>10} {'(ms)':>8} {'(ms)':>8} {'':>6} {'hit':>7} "
             f"{'hit':>6}" + (f" {'storage)':>8}" if with_storage else "") + f" {'tokens':>9}"]
    for name, s in summaries.items():
        storage = f" {s.get('storage_hit_ratio', 0.0):>8.1%}" if with_storage else ""
        lines.append(
            f"{name:<{w}} {s['ttft_mean_ms']:>10.1f} {s['ttft_p50_ms']:>8.1f} "
            f"{s['ttft_p99_ms']:>8.1f} {s['hit_ratio']:>6.1%} {s['device_hit_ratio']:>7.1%} "
            f"{s['host_hit_ratio']:>6.1%}{storage} {s['computed_tokens']:>9} "
            f"{s['req_per_s']:>7.2f}"
        )
    return lines


def conclusion(summaries: dict[str, dict]) -> str:
    """One line comparing the hierarchy with device-only, from the numbers."""
    if "hierarchical" not in summaries or "device" not in summaries:
        return "(run both 'device' and 'hierarchical' for a comparison)"
    h, d = summaries["hierarchical"], summaries["device"]
    ttft_x = d["ttft_mean_ms"] / h["ttft_mean_ms"]
    computed_x = d["computed_tokens"] / max(h["computed_tokens"], 1)
    return (f"hierarchical: {ttft_x:.1f}x lower mean TTFT than device-only, "
            f"{computed_x:.1f}x fewer tokens computed "
            f"(hit ratio {h['hit_ratio']:.0%} vs {d['hit_ratio']:.0%})")


def storage_conclusion(summaries: dict[str, dict]) -> str | None:
    """One line on what the third tier buys at the small host tier; None without both runs."""
    if "hierarchical+storage" not in summaries or "hierarchical-small-host" not in summaries:
        return None
    st, sm = summaries["hierarchical+storage"], summaries["hierarchical-small-host"]
    ttft_x = sm["ttft_mean_ms"] / st["ttft_mean_ms"]
    computed_x = sm["computed_tokens"] / max(st["computed_tokens"], 1)
    return (f"hierarchical+storage: {ttft_x:.1f}x lower mean TTFT than the same small host "
            f"tier alone, {computed_x:.1f}x fewer tokens computed (hit ratio "
            f"{st['hit_ratio']:.0%} vs {sm['hit_ratio']:.0%}, {st['storage_hit_ratio']:.0%} "
            f"of prompt tokens read from storage)")
