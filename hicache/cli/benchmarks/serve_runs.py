"""The runs of ``hicache bench serve`` and what they add up to.

:func:`start_targets` starts every configuration's server at once (their start-up
overlaps; none is measured while another starts) or takes the ``--url`` given;
:func:`measure` runs, in this order, each configuration unloaded, vLLM alone at
``inf`` (which places an ``auto`` sweep), the sweep (rate by rate, the order of
configurations reversed at every rate so a drift of the machine weighs on all alike),
then the no-hit comparison in ABBA rounds; :func:`report` prints the table and
returns the JSON summary. The command line is :mod:`hicache.cli.benchmarks.serve`.

Around every measured run :func:`measure` also reads the server's ``/metrics`` (the
prompt tokens each tier served, :func:`~hicache.cli.benchmarks.serve_report.tier_tokens`)
and the CPU seconds of every *other* server started here (they stay up, idle, while one
is driven: on a machine of few cores their CPU time across the run says whether they
took any from it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from contextlib import ExitStack
from typing import TextIO

from hicache.cli.benchmarks.proc_cpu import cpu_seconds_by_name
from hicache.cli.benchmarks.serve_client import Record, run_load
from hicache.cli.benchmarks.serve_report import (
    audit_counts,
    compare_at,
    goodput,
    history_figures,
    loaded_rates,
    median_run,
    plot_sweep,
    rate_value,
    same_outputs,
    summarize,
    sweep_table,
    tier_tokens,
)
from hicache.cli.benchmarks.serve_server import (
    Server,
    ServerSpec,
    get_metrics,
    reset_caches,
    served_model,
)
from hicache.cli.benchmarks.serve_workload import AnyWorkload, unique_prompts

BASELINE = "vllm"
WITHOUT_CONNECTOR = ("vllm", "vllm-fits")  # vLLM alone; with a KV cache for everything
FITS = "vllm-fits"
CONNECTED = ("vllm+host", "vllm+host+file")
NO_HIT = ("vllm", "vllm+host")  # the no-hit comparison: vLLM alone, and with the connector
RATE_MULTIPLES = (0.5, 1.0, 1.5, 2.0)  # of vLLM alone's throughput at inf (an auto sweep)
LOADED_FACTOR = 3.0  # the comparison rate: vLLM alone's TTFT p90 >= 3x unloaded
SLO_FACTOR = 3.0  # goodput's default TTFT SLO: 3x vLLM alone's unloaded TTFT p90
# The connector's own clocks on vLLM's /metrics (its worker and scheduler hooks).
STEP_SERIES = {side: (f'vllm:hicache_connector_seconds_total{{side="{side}"}}',
                      f'vllm:hicache_connector_steps_total{{side="{side}"}}')
               for side in ("worker", "scheduler")}


class Target:
    """A configuration's server: started here, or at a ``--url``."""

    def __init__(self, name: str, url: str, model: str, pid: int | None = None) -> None:
        self.name, self.url, self.model = name, url, model
        self.pid = pid  # the server's process, when started here

    @property
    def with_connector(self) -> bool:
        return self.name not in WITHOUT_CONNECTOR

    def run(self, workload: AnyWorkload, rate: str, max_in_flight: int,
            seed: int) -> list[Record]:
        """One run after a reset of the server's caches."""
        reset_caches(self.url, self.with_connector)
        return asyncio.run(run_load(self.url, workload, model=self.model,
                                    request_rate=rate_value(rate),
                                    max_in_flight=max_in_flight, seed=seed))

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the server's process group, when started
        here: an idle vLLM server polls, and takes a few percent of a core meanwhile."""
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

    def cpu_seconds(self) -> float | None:
        """CPU seconds so far of the server's process tree (None: not started here)."""
        if self.pid is None:
            return None
        return sum(cpu_seconds_by_name(self.pid).values())


def start_targets(configs: list[str], urls: dict[str, str], specs: dict[str, ServerSpec],
                  workdir: str, timeout_s: float, stack: ExitStack,
                  out: TextIO) -> dict[str, Target]:
    """The configurations' servers, ready (the started ones are stopped by ``stack``)."""
    servers = {}
    for name in configs:
        if name not in urls:
            servers[name] = stack.enter_context(Server(specs[name], workdir))
    for name, server in servers.items():
        seconds = server.wait_ready(timeout_s)
        print(f"server {name} ready after {seconds:.0f} s ({server.url}, log "
              f"{server.log_path})", file=out, flush=True)
    targets = {}
    for name in configs:
        url = urls.get(name) or servers[name].url
        pid = servers[name].proc.pid if name in servers else None
        targets[name] = Target(name, url, served_model(url), pid)
    return targets


def _say(out: TextIO, name: str, label: str, records: list[Record]) -> dict:
    s = summarize(records)
    print(f"  {name:<16} {label:>9}: {s['num_requests']} requests, {s['num_failed']} failed, "
          f"{s['duration_s']:.1f} s, TTFT p90 {s['ttft_ms']['p90'] or 0:,.0f} ms, "
          f"input {s['input_throughput']:,.0f} tokens/s", file=out, flush=True)
    return s


def _auto_rates(throughput: float) -> list[str]:
    rates = sorted({f"{m * throughput:.2g}" for m in RATE_MULTIPLES if m * throughput > 0},
                   key=float)
    return [*rates, "inf"]


class Watched:
    """The runs' side figures: each run's tokens by tier, and the CPU seconds of the
    servers left idle across other configurations' runs."""

    def __init__(self, targets: dict[str, Target], pause_idle: bool = False) -> None:
        self.targets = targets
        self.pause_idle = pause_idle
        self.tiers: dict[str, dict[str, dict[str, int]]] = {name: {} for name in targets}
        self.audit: dict[str, dict[str, dict[str, int]]] = {name: {} for name in targets}
        # idle server -> [its CPU seconds, wall seconds of the runs it sat out]
        self.idle: dict[str, list[float]] = {name: [0.0, 0.0] for name, t in targets.items()
                                             if t.pid is not None}

    def run(self, name: str, label: str, workload: AnyWorkload, rate: str,
            max_in_flight: int, seed: int) -> list[Record]:
        t = self.targets[name]
        t.pause(False)
        others = {n: o.cpu_seconds() for n, o in self.targets.items()
                  if n != name and o.pid is not None}
        if self.pause_idle:
            for n in others:
                self.targets[n].pause(True)
        before = get_metrics(t.url)
        records = t.run(workload, rate, max_in_flight, seed)
        after = get_metrics(t.url)
        self.tiers[name][label] = tier_tokens(before, after)
        if t.with_connector:
            self.audit[name][label] = audit_counts(before, after)
        wall = (max(r.done_s for r in records) - min(r.sent_s for r in records)
                if records else 0.0)
        for n, cpu in others.items():
            now = self.targets[n].cpu_seconds()
            if cpu is not None and now is not None:
                self.idle[n][0] += now - cpu
                self.idle[n][1] += wall
        return records


def measure(args: argparse.Namespace, targets: dict[str, Target], workload: AnyWorkload,
            rates: list[str] | None, out: TextIO) -> dict:
    """Every run's records (``unloaded``, ``sweep`` by rate, ``no_hit``), by configuration;
    ``tiers`` (tokens by tier, by configuration and run) and ``idle_cpu`` beside them."""
    watched = Watched(targets, pause_idle=getattr(args, "pause_idle", False))
    try:
        return _measure(args, watched, targets, workload, rates, out)
    finally:
        for t in targets.values():  # every server continued, to be stopped as usual
            t.pause(False)


def _measure(args: argparse.Namespace, watched: Watched, targets: dict[str, Target],
             workload: AnyWorkload, rates: list[str] | None, out: TextIO) -> dict:
    cap, seed = args.max_in_flight, args.seed
    # A first request per server, not measured (vLLM's first step sets up its kernels).
    warm = unique_prompts(1, 2 * args.block_size + 1, 2, workload.vocab_size, seed + 7)
    for t in targets.values():
        t.run(warm, "inf", 1, seed)
    print("unloaded: one request at a time", file=out, flush=True)
    unloaded = {}
    for name in targets:
        unloaded[name] = watched.run(name, "unloaded", workload, "inf", 1, seed)
        _say(out, name, "1 inflt", unloaded[name])
    sweep: dict[str, dict[str, list[Record]]] = {name: {} for name in targets}
    if rates is None:
        print(f"{BASELINE} at inf: its throughput places the sweep", file=out, flush=True)
        recs = sweep[BASELINE]["inf"] = watched.run(BASELINE, "inf", workload, "inf", cap, seed)
        rates = _auto_rates(_say(out, BASELINE, "inf", recs)["request_throughput"])
    print(f"sweep: {', '.join(rates)} requests/s, at most {cap} in flight", file=out, flush=True)
    order = list(targets)
    for i, rate in enumerate(rates):
        for name in (order if i % 2 == 0 else order[::-1]):
            if rate not in sweep[name]:
                sweep[name][rate] = watched.run(name, rate, workload, rate, cap, seed)
                _say(out, name, rate, sweep[name][rate])
    return {"rates": rates, "unloaded": unloaded, "sweep": sweep,
            "tiers": watched.tiers, "audit": watched.audit, "idle_cpu": watched.idle,
            "no_hit": _no_hit(args, watched, workload.vocab_size, out)}


def _no_hit(args: argparse.Namespace, watched: Watched, vocab_size: int,
            out: TextIO) -> dict | None:
    """ABBA rounds of prompts sharing nothing; the connector's clocks around its runs."""
    targets = watched.targets
    if not args.no_hit_requests or any(n not in targets for n in NO_HIT):
        return None
    w = unique_prompts(args.no_hit_requests, args.no_hit_tokens, args.no_hit_max_tokens,
                       vocab_size, args.seed)
    print(f"no-hit: {w.num_clients} prompts of {args.no_hit_tokens} tokens sharing nothing, "
          f"{args.no_hit_max_tokens} generated each, {args.max_in_flight} in flight",
          file=out, flush=True)
    runs: dict[str, list[list[Record]]] = {n: [] for n in NO_HIT}
    clocks = {side: [0.0, 0.0] for side in STEP_SERIES}  # seconds, steps
    for r in range(args.no_hit_repeat):
        for name in (NO_HIT if r % 2 == 0 else NO_HIT[::-1]):
            t = targets[name]
            t.pause(False)  # paused while the other ran: /metrics would not answer
            before = get_metrics(t.url) if t.with_connector else {}
            runs[name].append(watched.run(name, f"no-hit.{r + 1}", w, "inf",
                                          args.max_in_flight, args.seed))
            _say(out, name, f"no-hit.{r + 1}", runs[name][-1])
            if t.with_connector:
                after = get_metrics(t.url)
                for side, series in STEP_SERIES.items():
                    for k, key in enumerate(series):
                        clocks[side][k] += after.get(key, 0.0) - before.get(key, 0.0)
    return {"runs": runs, "clocks": clocks}


def _ms_per_step(clocks: dict[str, list[float]]) -> dict[str, float | None]:
    return {side: (round(sec / steps * 1e3, 4) if steps else None)
            for side, (sec, steps) in clocks.items()}


def report(args: argparse.Namespace, results: dict, header: dict, out: TextIO) -> dict:
    """Print the tables; the JSON summary."""
    unloaded = {n: summarize(r) for n, r in results["unloaded"].items()}
    sweep = {n: {rate: summarize(r) for rate, r in by_rate.items()}
             for n, by_rate in results["sweep"].items()}
    print("", file=out)
    sweep_table(sweep, unloaded, out)
    base_p90 = unloaded[BASELINE]["ttft_ms"]["p90"] or 0.0
    loaded = loaded_rates(sweep[BASELINE], base_p90, LOADED_FACTOR)
    vs = {rate: compare_at({n: s[rate] for n, s in sweep.items() if rate in s}, BASELINE)
          for rate in results["rates"]}
    print(f"\nagainst {BASELINE} (x: ratio to {BASELINE}'s figure; loaded: {BASELINE}'s TTFT "
          f"p90 >= {LOADED_FACTOR:g}x its unloaded {base_p90:,.0f} ms)", file=out)
    for rate in results["rates"]:
        for name, c in vs[rate].items():
            print(f"  {rate:>6} {'loaded' if rate in loaded else '      '} {name:<16} TTFT p90 "
                  f"x{c['ttft_p90_ratio']} (later turns x{c['later_ttft_p90_ratio']}), ITL p50 "
                  f"x{c['itl_p50_ratio']}, input throughput x{c['input_throughput_ratio']}",
                  file=out)
    # Every run's greedy replies against vLLM alone's unloaded run (one request at a time).
    reference = results["unloaded"][BASELINE]
    outputs = {n: {"unloaded": same_outputs(reference, results["unloaded"][n]),
                   **{rate: same_outputs(reference, r) for rate, r in by_rate.items()}}
               for n, by_rate in results["sweep"].items()}
    num_differing = sum(c["num_differing"] for d in outputs.values() for c in d.values())
    print(f"greedy replies differing from {BASELINE}'s unloaded run: {num_differing} "
          f"(of {sum(c['num_compared'] for d in outputs.values() for c in d.values())} "
          "turns compared)", file=out)
    if FITS in results["unloaded"]:
        fits_ref = results["unloaded"][FITS]
        outputs_vs_fits = {n: {"unloaded": same_outputs(fits_ref, results["unloaded"][n]),
                               **{rate: same_outputs(fits_ref, r) for rate, r in by_rate.items()}}
                           for n, by_rate in results["sweep"].items()}
        num_vs_fits = {n: sum(c["num_differing"] for c in d.values())
                       for n, d in outputs_vs_fits.items()}
        print(f"greedy replies differing from {FITS}'s unloaded run, by configuration: "
              + ", ".join(f"{n} {k}" for n, k in num_vs_fits.items()), file=out)
    else:
        outputs_vs_fits = None
    slo_ms = args.ttft_slo_ms or SLO_FACTOR * base_p90
    goodputs = _goodputs(sweep, slo_ms, args.ttft_slo_ms is None, base_p90, out)
    replies_in_history = not getattr(args, "recorded_replies", False)
    history = {n: {label: history_figures(recs, replies_in_history)
                   for label, recs in [("unloaded", results["unloaded"][n]),
                                       *results["sweep"][n].items()]}
               for n in results["unloaded"]}
    _history_table(history, results.get("tiers") or {}, out)
    audit = (_audit_summary(results.get("audit") or {}, out)
             if getattr(args, "audit_rate", 0.0) else None)
    idle = _idle_summary(results.get("idle_cpu") or {}, getattr(args, "pause_idle", False), out)
    no_hit = _no_hit_summary(results["no_hit"], out)
    if args.plot:
        model = os.path.basename(header["model"].rstrip("/")) or header["model"]
        plot_sweep(sweep, args.plot, f"{model}: {header['workload']}")
        print(f"plot: {args.plot}", file=out)
    return {"bench": "serve", **header, "rates": results["rates"],
            "configs": {n: {"unloaded": unloaded[n], "sweep": sweep[n]} for n in sweep},
            "unloaded_ttft_p90_ms": base_p90, "loaded_rates": loaded,
            "loaded_rate": loaded[0] if loaded else None, "vs_vllm": vs, "outputs": outputs,
            "outputs_identical": num_differing == 0, "outputs_vs_fits": outputs_vs_fits,
            "ttft_slo_ms": round(slo_ms, 3), "goodput": goodputs, "history": history,
            "tiers": results.get("tiers"), "audit": audit, "idle_cpu": idle, "no_hit": no_hit}


def _goodputs(sweep: dict[str, dict[str, dict]], slo_ms: float, default_slo: bool,
              base_p90: float, out: TextIO) -> dict:
    """Each configuration's goodput, against vLLM alone's and ``vllm-fits``'s."""
    rates = {n: goodput(s, slo_ms) for n, s in sweep.items()}
    how = (f"{SLO_FACTOR:g}x {BASELINE}'s unloaded TTFT p90 of {base_p90:,.0f} ms"
           if default_slo else "--ttft-slo-ms")
    print(f"\ngoodput: the highest request rate with TTFT p90 <= {slo_ms:,.0f} ms ({how}) "
          "and no failure, at every lower rate too", file=out)
    result = {}
    for name, g in rates.items():
        vs_base = round(g / rates[BASELINE], 4) if rates[BASELINE] else None
        vs_fits = round(g / rates[FITS], 4) if rates.get(FITS) else None
        result[name] = {"goodput_rps": round(g, 4), "vs_vllm": vs_base, "vs_fits": vs_fits}
        print(f"  {name:<16} {g:7.3g} req/s"
              + (f"  x{vs_base} of {BASELINE}'s" if vs_base is not None else "")
              + (f", {vs_fits:.0%} of {FITS}'s" if vs_fits is not None else ""), file=out)
    return result


def _history_table(history: dict[str, dict[str, dict]], tiers: dict[str, dict[str, dict]],
                   out: TextIO) -> None:
    print("\nlater turns' history (previous prompt + reply): reusable = the part this prompt "
          "starts with, reused = of that, reported cached; retok = history the chat template "
          "re-rendered differently\nprompt tokens by tier (from /metrics): vLLM's prefix "
          "cache, hicache's host tier and third tier, computed; requests vLLM preempted for KV "
          "blocks", file=out)
    head = (f"{'config':<18} {'run':>8} {'history':>8} {'reusable':>8} {'reused':>7} "
            f"{'retok':>6} {'vllm':>8} {'host':>8} {'3rd':>7} {'computed':>8} {'preempt':>7}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for name, by_run in history.items():
        for label in sorted(by_run, key=lambda k: -1.0 if k == "unloaded" else rate_value(k)):
            h, t = by_run[label], tiers.get(name, {}).get(label, {})
            share = "-" if h["reused_share"] is None else f"{h['reused_share']:.0%}"
            retok = ("-" if h["retokenization_loss_share"] is None
                     else f"{h['retokenization_loss_share']:.1%}")
            print(f"{name:<18} {label:>8} {h['history_tokens']:>8,} {h['reusable_tokens']:>8,} "
                  f"{share:>7} {retok:>6} {t.get('vllm_prefix', 0):>8,} {t.get('host', 0):>8,} "
                  f"{t.get('third_tier', 0):>7,} {t.get('computed', 0):>8,} "
                  f"{t.get('preemptions', 0):>7,}", file=out)


def _audit_summary(audit: dict[str, dict[str, dict[str, int]]], out: TextIO) -> dict:
    """The run-time KV audit's counters by configuration (every run's, summed)."""
    keys = ("audited_requests", "audited_pages", "mismatched_pages", "skipped_pages",
            "computed_tokens")
    totals = {n: {k: sum(run.get(k, 0) for run in by_run.values()) for k in keys}
              for n, by_run in audit.items() if by_run}
    print("\nrun-time KV audit (--audit-rate): requests audited, pages compared, mismatches, "
          "pages skipped, hit tokens computed instead (its cost)", file=out)
    for n, t in totals.items():
        print(f"  {n:<16} {t['audited_requests']:>6,} requests {t['audited_pages']:>8,} pages "
              f"{t['mismatched_pages']:>4,} mismatched {t['skipped_pages']:>6,} skipped "
              f"{t['computed_tokens']:>9,} tokens", file=out)
    return {"by_config": totals, "by_run": audit,
            "mismatched_pages": sum(t["mismatched_pages"] for t in totals.values())}


def _idle_summary(idle: dict[str, list[float]], paused: bool, out: TextIO) -> dict:
    """The idle servers' CPU seconds across the runs they sat out."""
    if not idle:
        return {}
    summary = {n: {"cpu_s": round(cpu, 2), "runs_wall_s": round(wall, 2),
                   "cpu_share": round(cpu / wall, 4) if wall else None}
               for n, (cpu, wall) in idle.items()}
    how = "stopped (SIGSTOP)" if paused else "left running (--no-pause-idle)"
    print(f"\nidle servers ({how}), their CPU across the other configurations' runs: "
          + ", ".join(
        f"{n} {s['cpu_s']:.1f} s in {s['runs_wall_s']:.0f} s"
        + (f" ({s['cpu_share']:.1%} of one core)" if s["cpu_share"] is not None else "")
        for n, s in summary.items()), file=out)
    return summary


def _no_hit_summary(no_hit: dict | None, out: TextIO) -> dict | None:
    if no_hit is None:
        return None
    medians = {n: median_run([summarize(r) for r in runs]) for n, runs in no_hit["runs"].items()}
    ratio = compare_at(medians, BASELINE)["vllm+host"]
    same = same_outputs(no_hit["runs"]["vllm"][0], no_hit["runs"]["vllm+host"][0])
    ms = _ms_per_step(no_hit["clocks"])
    print(f"no-hit (medians of {len(no_hit['runs']['vllm'])} runs each): ITL p50 "
          f"{medians['vllm']['itl_ms']['p50']} / {medians['vllm+host']['itl_ms']['p50']} ms "
          f"(x{ratio['itl_p50_ratio']}), output throughput "
          f"{medians['vllm']['output_throughput']} / {medians['vllm+host']['output_throughput']} "
          f"tokens/s (x{ratio['output_throughput_ratio']}); the connector per step: worker "
          f"{ms['worker']} ms, scheduler {ms['scheduler']} ms; replies differing "
          f"{same['num_differing']}", file=out)
    return {"vllm": medians["vllm"], "vllm+host": medians["vllm+host"], **ratio,
            "connector_ms_per_step": ms, "outputs": same}
