"""Multi-turn / agentic replay through the engine: no cache vs device cache vs the hierarchy.

Every request of a workload runs through :class:`hicache.engine.Engine`, one at
a time in trace order, in each configuration of :data:`CONFIGS` at the same
device capacity (default: a quarter of the workload's working set, so the
device tier thrashes) with a host tier big enough for the whole working set.
Prompts are taken as given; ``max_new_tokens = len(output)``; generation is
greedy, and the three configurations must produce the same tokens (checked).

What is measured per configuration: TTFT (call to first generated token:
match, load waits and prefill), hit ratios per tier (prompt tokens found on the
device / loaded from the host, over all prompt tokens), prompt tokens computed,
and requests per second (decode included). A warm-up request runs first on a
throwaway engine so one-time kernel set-up is not charged to the first config.

The regime: on a CPU the "device" pool is host memory too, so a reload is a
memory copy while recompute runs the model on a couple of cores; recompute
costs far more than on a GPU, relative to a load. The computed-token ratio
carries over to a GPU; the TTFT ratio shrinks there (see ``bench recompute``).
A forward of a few dozen tokens also has a fixed cost here (~20-40 ms: the
32k-vocabulary head, per-op overhead), which keeps the TTFT ratio below the
computed-token ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import psutil
import torch

from hicache.engine import Engine, GenerateResult
from hicache.model import PRESET_NAMES, Model, preset
from hicache.traces import Request as TraceRequest
from hicache.traces import generate, load_trace, trace_stats


class Request(NamedTuple):
    prompt: np.ndarray  # int64 token ids, taken as given
    max_new_tokens: int  # len(output) of the trace request


class ConfigSpec(NamedTuple):
    """How to build the engine of one configuration (device/host sizes are shared)."""

    mode: str  # Engine mode
    has_host_tier: bool  # receives host_tokens
    options: dict  # further Engine keyword arguments


# Name -> engine recipe; a new configuration (e.g. a storage tier) is one more entry.
CONFIGS: dict[str, ConfigSpec] = {
    "none": ConfigSpec("none", False, {}),
    "device": ConfigSpec("device", False, {}),
    "hierarchical": ConfigSpec("hierarchical", True, {"write_policy": "write_through"}),
}

# The default workload: agentic sessions over two shared 1k-token system prompts,
# each starting with a 512-token task (retrieved context) and appending a 32-token
# tool result and an 8-token reply per turn; all sessions open at once, interleaved.
# A device tier of 25% of the working set holds about one session: it thrashes.
DEFAULT_WORKLOAD = {
    "kind": "agentic",
    "num_system_prompts": 2,
    "system_tokens": 1024,
    "num_sessions": 8,
    "num_turns": 10,
    "first_turn_tokens": 512,
    "turn_tokens": 32,
    "output_tokens": 8,
}

# (flag, parameter of the agentic generator, help)
_WORKLOAD_OPTIONS = [
    ("--system-prompts", "num_system_prompts", "shared system prompts"),
    ("--system-tokens", "system_tokens", "tokens per system prompt"),
    ("--sessions", "num_sessions", "agent sessions, interleaved"),
    ("--turns", "num_turns", "turns per session"),
    ("--first-turn-tokens", "first_turn_tokens", "task tokens of a session's first turn"),
    ("--turn-tokens", "turn_tokens", "tool-result tokens appended per later turn"),
    ("--output-tokens", "output_tokens", "tokens generated per turn"),
]


def add_workload_arguments(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """Shape options of the generated agentic workload (``defaults`` override the bench's)."""
    for flag, name, help_text in _WORKLOAD_OPTIONS:
        default = defaults.get(name, DEFAULT_WORKLOAD[name])
        parser.add_argument(flag, dest=name, type=int, default=default, metavar="N",
                            help=f"{help_text} (default {default})")


def workload_from_args(args: argparse.Namespace) -> dict:
    """The generator parameters chosen on the command line, checked."""
    shape = {"kind": DEFAULT_WORKLOAD["kind"]}
    for flag, name, _ in _WORKLOAD_OPTIONS:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
        shape[name] = value
    return shape


class ConfigResult(NamedTuple):
    name: str
    results: list[GenerateResult]
    wall_s: float  # whole replay, decode included
    stats: dict  # the cache's counters at the end ({} without a cache)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None,
                        help="JSONL trace (WORKLOADS.md format); default: a generated agentic "
                        "workload")
    add_workload_arguments(parser)
    parser.add_argument("--requests", type=int, default=None,
                        help="replay only the first N requests")
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES,
                        help="model shapes (default: small)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--device-tokens", type=int, default=None,
                        help="device pool capacity in tokens (default: 25%% of the working set, "
                        "at least one request)")
    parser.add_argument("--host-tokens", type=int, default=None,
                        help="host tier capacity in tokens (default: 2x the working set)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {list(CONFIGS)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the other core runs the "
                        "transfer threads, as a GPU's copy engines run beside its SMs)")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]'")
    parser.add_argument("--seed", type=int, default=0, help="workload and model weights")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


# ------------------------------------------------------------------ workload
def generated_trace(seed: int, workload: dict | None = None) -> list[TraceRequest]:
    """A trace of ``workload`` (default :data:`DEFAULT_WORKLOAD`) from :mod:`hicache.traces`."""
    params = dict(DEFAULT_WORKLOAD if workload is None else workload)
    kind = params.pop("kind")
    return generate(kind, seed=seed, **params)


def to_requests(trace: Sequence[TraceRequest]) -> list[Request]:
    """Prompts as given; ``max_new_tokens = len(output)``."""
    return [Request(np.asarray(r.prompt, dtype=np.int64), len(r.output)) for r in trace]


def max_request_tokens(requests: Sequence[Request], page_size: int) -> int:
    """KV tokens of the largest request, rounded up to whole pages."""
    longest = max(len(r.prompt) + r.max_new_tokens - 1 for r in requests)
    return -(-longest // page_size) * page_size


# ------------------------------------------------------------------- replay
def replay(
    engine: Engine,
    requests: Sequence[Request],
    progress: Callable[[int, GenerateResult], None] | None = None,
) -> tuple[list[GenerateResult], float]:
    """Run ``requests`` in order through ``engine``; return the results and the wall time."""
    results = []
    start = time.perf_counter()
    for i, req in enumerate(requests):
        result = engine.generate(req.prompt, req.max_new_tokens)
        results.append(result)
        if progress is not None:
            progress(i + 1, result)
    engine.drain()
    return results, time.perf_counter() - start


def build_engine(
    name: str, model: Model, device_tokens: int, host_tokens: int, page_size: int
) -> Engine:
    spec = CONFIGS[name]
    kwargs = dict(spec.options)
    if spec.has_host_tier:
        kwargs["host_tokens"] = host_tokens
    return Engine(model, spec.mode, device_tokens, page_size=page_size, **kwargs)


def run_configs(
    model: Model,
    requests: Sequence[Request],
    names: Sequence[str],
    device_tokens: int,
    host_tokens: int,
    page_size: int,
    progress: Callable[[str, int, GenerateResult], None] | None = None,
) -> dict[str, ConfigResult]:
    """Replay ``requests`` through each named configuration; check they generate alike."""
    warm = Engine(model, "none", max_request_tokens(requests[:1], page_size), page_size=page_size)
    warm.generate(requests[0].prompt, requests[0].max_new_tokens)
    warm.close()
    out: dict[str, ConfigResult] = {}
    for name in names:
        engine = build_engine(name, model, device_tokens, host_tokens, page_size)
        try:
            on_result = None
            if progress is not None:
                def on_result(i: int, r: GenerateResult, name: str = name) -> None:
                    progress(name, i, r)
            results, wall_s = replay(engine, requests, on_result)
            engine.check_integrity()
            out[name] = ConfigResult(name, results, wall_s, engine.stats())
        finally:
            engine.close()
    first = next(iter(out.values()))
    for res in out.values():
        for i, (a, b) in enumerate(zip(res.results, first.results, strict=True)):
            if a.tokens != b.tokens:
                raise AssertionError(
                    f"request {i}: config {res.name!r} generated {a.tokens[:8]}..., "
                    f"{first.name!r} generated {b.tokens[:8]}...: the cache changed the output"
                )
    return out


def summarize(res: ConfigResult, requests: Sequence[Request]) -> dict:
    """The JSON metrics of one configuration."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ttft_ms = [r.ttft_s * 1e3 for r in res.results]
    device_hit = sum(r.device_hit_tokens for r in res.results)
    host_hit = sum(r.host_hit_tokens for r in res.results)
    return {
        "requests": len(res.results),
        "ttft_mean_ms": statistics.fmean(ttft_ms),
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
        "hit_ratio": (device_hit + host_hit) / prompt_tokens,
        "device_hit_ratio": device_hit / prompt_tokens,
        "host_hit_ratio": host_hit / prompt_tokens,
        "computed_tokens": sum(r.computed_tokens for r in res.results),
        "prompt_tokens": prompt_tokens,
        "req_per_s": len(res.results) / res.wall_s,
        "wall_s": res.wall_s,
        "load_failures": sum(r.num_load_failures for r in res.results),
        "device_evicted_tokens": res.stats.get("device_evicted_tokens", 0),
        "load_gbps": res.stats.get("load_gbps", 0.0),
    }


def format_table(summaries: dict[str, dict]) -> list[str]:
    header = (f"{'config':<14} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'hit':>6} "
              f"{'device':>7} {'host':>6} {'computed':>9} {'req/s':>7}")
    lines = [header, f"{'':<14} {'(ms)':>10} {'(ms)':>8} {'(ms)':>8} {'':>6} {'hit':>7} "
             f"{'hit':>6} {'tokens':>9}"]
    for name, s in summaries.items():
        lines.append(
            f"{name:<14} {s['ttft_mean_ms']:>10.1f} {s['ttft_p50_ms']:>8.1f} "
            f"{s['ttft_p99_ms']:>8.1f} {s['hit_ratio']:>6.1%} {s['device_hit_ratio']:>7.1%} "
            f"{s['host_hit_ratio']:>6.1%} {s['computed_tokens']:>9} {s['req_per_s']:>7.2f}"
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


# ---------------------------------------------------------------------- main
def prepare(args: argparse.Namespace) -> tuple[list[Request], int, int, int]:
    """The requests and the (working set, device, host) token capacities."""
    if args.trace is not None:
        trace = load_trace(args.trace)
    else:
        trace = generated_trace(args.seed, workload_from_args(args))
    if args.requests is not None:
        if args.requests < 1:
            raise ValueError(f"--requests: expected >= 1, got {args.requests}")
        trace = trace[: args.requests]
    if not trace:
        raise ValueError("workload: expected at least one request, got none")
    requests = to_requests(trace)
    ws, device_tokens, host_tokens = capacities(
        trace, requests, args.page_size, args.device_tokens, args.host_tokens
    )
    return requests, ws, device_tokens, host_tokens


def capacities(
    trace: Sequence[TraceRequest],
    requests: Sequence[Request],
    page_size: int,
    device_tokens: int | None = None,
    host_tokens: int | None = None,
) -> tuple[int, int, int]:
    """(working set, device, host) in tokens; defaults: device = 25% of the working set
    (at least the largest request), host = 2x the working set (it never evicts)."""
    ws = trace_stats(trace, page_size).working_set_tokens
    if device_tokens is None:
        device_tokens = max(ws // 4 // page_size * page_size,
                            max_request_tokens(requests, page_size))
    if host_tokens is None:
        host_tokens = max(2 * ws, device_tokens)
    return ws, device_tokens, host_tokens


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"--configs: expected names from {list(CONFIGS)}, got {args.configs!r}")
    requests, ws, device_tokens, host_tokens = prepare(args)
    cfg = preset(args.preset)
    model = Model(cfg, device=args.device, seed=args.seed)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    log(f"workload: {len(requests)} requests, {prompt_tokens} prompt tokens "
        f"(mean {prompt_tokens / len(requests):.0f}), working set {ws} tokens; "
        f"{args.trace or 'generated ' + json.dumps(workload_from_args(args))}")
    log(f"preset {cfg.name}, page size {args.page_size}, device {device_tokens} tokens "
        f"({device_tokens / ws:.0%} of the working set), host {host_tokens} tokens, "
        f"{torch.get_num_threads()} torch threads, load average {psutil.getloadavg()[0]:.1f}")

    def progress(name: str, i: int, r: GenerateResult) -> None:
        if i == len(requests):
            log(f"  {name}: {i} requests done")

    runs = run_configs(model, requests, names, device_tokens, host_tokens, args.page_size,
                       progress)
    summaries = {name: summarize(res, requests) for name, res in runs.items()}
    log("")
    for line in format_table(summaries):
        log(line)
    log(conclusion(summaries))
    return {
        "preset": cfg.name,
        "page_size": args.page_size,
        "trace": args.trace,
        "workload": None if args.trace else workload_from_args(args),
        "seed": args.seed,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "working_set_tokens": ws,
        "device_tokens": device_tokens,
        "host_tokens": host_tokens,
        "torch_threads": torch.get_num_threads(),
        "load_average": psutil.getloadavg()[0],
        "configs": summaries,
    }


def run(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    result = measure(args, log)
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
