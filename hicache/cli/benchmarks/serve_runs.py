"""The runs of ``hicache bench serve`` and what they add up to.

:func:`start_targets` starts every configuration's server at once (their start-up
overlaps; none is measured while another starts) or takes the ``--url`` given;
:func:`measure` runs, in this order, each configuration unloaded, vLLM alone at
``inf`` (which places an ``auto`` sweep), the sweep (rate by rate, the order of
configurations reversed at every rate so a drift of the machine weighs on all alike),
then the no-hit comparison in ABBA rounds; :func:`report` prints the table and
returns the JSON summary. The command line is :mod:`hicache.cli.benchmarks.serve`.
"""

from __future__ import annotations

import argparse
import asyncio
from contextlib import ExitStack
from typing import TextIO

from hicache.cli.benchmarks.serve_client import Record, run_load
from hicache.cli.benchmarks.serve_report import (
    compare_at,
    loaded_rates,
    median_run,
    plot_sweep,
    rate_value,
    same_outputs,
    summarize,
    sweep_table,
)
from hicache.cli.benchmarks.serve_server import (
    Server,
    ServerSpec,
    get_metrics,
    reset_caches,
    served_model,
)
from hicache.cli.benchmarks.serve_workload import Workload, unique_prompts

BASELINE = "vllm"
NO_HIT = ("vllm", "vllm+host")  # the no-hit comparison: vLLM alone, and with the connector
RATE_MULTIPLES = (0.5, 1.0, 1.5, 2.0)  # of vLLM alone's throughput at inf (an auto sweep)
LOADED_FACTOR = 3.0  # the comparison rate: vLLM alone's TTFT p90 >= 3x unloaded
# The connector's own clocks on vLLM's /metrics (its worker and scheduler hooks).
STEP_SERIES = {side: (f'vllm:hicache_connector_seconds_total{{side="{side}"}}',
                      f'vllm:hicache_connector_steps_total{{side="{side}"}}')
               for side in ("worker", "scheduler")}


class Target:
    """A configuration's server: started here, or at a ``--url``."""

    def __init__(self, name: str, url: str, model: str) -> None:
        self.name, self.url, self.model = name, url, model

    @property
    def with_connector(self) -> bool:
        return self.name != BASELINE

    def run(self, workload: Workload, rate: str, max_in_flight: int, seed: int) -> list[Record]:
        """One run after a reset of the server's caches."""
        reset_caches(self.url, self.with_connector)
        return asyncio.run(run_load(self.url, workload, model=self.model,
                                    request_rate=rate_value(rate),
                                    max_in_flight=max_in_flight, seed=seed))


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
        targets[name] = Target(name, url, served_model(url))
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


def measure(args: argparse.Namespace, targets: dict[str, Target], workload: Workload,
            rates: list[str] | None, out: TextIO) -> dict:
    """Every run's records (``unloaded``, ``sweep`` by rate, ``no_hit``), by configuration."""
    cap, seed = args.max_in_flight, args.seed
    # A first request per server, not measured (vLLM's first step sets up its kernels).
    warm = unique_prompts(1, 2 * args.block_size + 1, 2, workload.vocab_size, seed + 7)
    for t in targets.values():
        t.run(warm, "inf", 1, seed)
    print("unloaded: one request at a time", file=out, flush=True)
    unloaded = {}
    for name, t in targets.items():
        unloaded[name] = t.run(workload, "inf", 1, seed)
        _say(out, name, "1 inflt", unloaded[name])
    sweep: dict[str, dict[str, list[Record]]] = {name: {} for name in targets}
    if rates is None:
        print(f"{BASELINE} at inf: its throughput places the sweep", file=out, flush=True)
        recs = sweep[BASELINE]["inf"] = targets[BASELINE].run(workload, "inf", cap, seed)
        rates = _auto_rates(_say(out, BASELINE, "inf", recs)["request_throughput"])
    print(f"sweep: {', '.join(rates)} requests/s, at most {cap} in flight", file=out, flush=True)
    order = list(targets)
    for i, rate in enumerate(rates):
        for name in (order if i % 2 == 0 else order[::-1]):
            if rate not in sweep[name]:
                sweep[name][rate] = targets[name].run(workload, rate, cap, seed)
                _say(out, name, rate, sweep[name][rate])
    return {"rates": rates, "unloaded": unloaded, "sweep": sweep,
            "no_hit": _no_hit(args, targets, workload.vocab_size, out)}


def _no_hit(args: argparse.Namespace, targets: dict[str, Target], vocab_size: int,
            out: TextIO) -> dict | None:
    """ABBA rounds of prompts sharing nothing; the connector's clocks around its runs."""
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
            before = get_metrics(t.url) if t.with_connector else {}
            runs[name].append(t.run(w, "inf", args.max_in_flight, args.seed))
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
    no_hit = _no_hit_summary(results["no_hit"], out)
    if args.plot:
        plot_sweep(sweep, args.plot, f"{header['model']}: {header['workload']}")
        print(f"plot: {args.plot}", file=out)
    return {"bench": "serve", **header, "rates": results["rates"],
            "configs": {n: {"unloaded": unloaded[n], "sweep": sweep[n]} for n in sweep},
            "unloaded_ttft_p90_ms": base_p90, "loaded_rates": loaded,
            "loaded_rate": loaded[0] if loaded else None, "vs_vllm": vs, "outputs": outputs,
            "outputs_identical": num_differing == 0, "no_hit": no_hit}


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
