"""Multi-turn / agentic replay through the engine: no cache vs device cache vs the hierarchy.

Every request of a workload runs through :class:`hicache.sim.engine.Engine`, one at
a time in trace order, in each configuration of :data:`CONFIGS` at the same
device capacity (default: a quarter of the workload's working set, so the
device tier thrashes) with a host tier big enough for the whole working set.
Prompts are taken as given; ``max_new_tokens = len(output)``; generation is
greedy, and the three configurations must produce the same tokens (checked).

Third tier (:data:`STORAGE_CONFIGS`, picked with ``--configs``): the same device
tier over a host tier too small for the working set (``--storage-host-tokens``,
default a quarter of the full host tier), without (``hierarchical-small-host``)
and with (``hierarchical+storage``) a storage tier under it (``--storage SPEC``,
default a fresh temporary ``file:`` store). Requests are announced one ahead
(``Engine.prefetch`` for request i+1 before request i runs, as if it arrived while
i computes), so its stored pages reach host memory in the background; under the
default ``wait_complete`` a request waits only for what has not arrived yet.

What is measured per configuration: TTFT (call to first generated token:
match, load waits and prefill), hit ratios per tier (prompt tokens found on the
device / loaded from the host, over all prompt tokens; "storage" is the part of
the host hits read from the third tier first), prompt tokens computed,
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
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import psutil
import torch

from hicache.cli import args as cliargs
from hicache.cli.args import (
    add_json,
    add_metrics_port,
    nonneg_float,
    nonneg_int,
    positive_int,
    start_metrics,
)
from hicache.cli.benchmarks import standalone_main
from hicache.sim.engine import Engine, GenerateResult
from hicache.sim.model import PRESET_NAMES, Model, preset
from hicache.sim.traces import Request as TraceRequest
from hicache.sim.traces import load_trace, trace_stats
from hicache.sim.workloads import generate


class Request(NamedTuple):
    prompt: np.ndarray  # int64 token ids, taken as given
    max_new_tokens: int  # len(output) of the trace request


class ConfigSpec(NamedTuple):
    """How to build the engine of one configuration (device/host sizes are shared)."""

    mode: str  # Engine mode
    has_host_tier: bool  # receives host_tokens
    options: dict  # further Engine keyword arguments
    small_host: bool = False  # host tier of storage_host_tokens instead of host_tokens
    has_storage: bool = False  # a third tier under the host tier


# Name -> engine recipe: the configurations compared by default (and by the demo).
CONFIGS: dict[str, ConfigSpec] = {
    "none": ConfigSpec("none", False, {}),
    "device": ConfigSpec("device", False, {}),
    "hierarchical": ConfigSpec("hierarchical", True, {"write_policy": "write_through"}),
}

# What a third tier buys where host memory runs out: both run at the same small host tier.
STORAGE_CONFIGS: dict[str, ConfigSpec] = {
    "hierarchical-small-host": ConfigSpec(
        "hierarchical", True, {"write_policy": "write_through"}, small_host=True
    ),
    "hierarchical+storage": ConfigSpec(
        "hierarchical", True, {"write_policy": "write_through"}, small_host=True,
        has_storage=True,
    ),
}

ALL_CONFIGS: dict[str, ConfigSpec] = {**CONFIGS, **STORAGE_CONFIGS}


class StorageSetup(NamedTuple):
    """The third tier's settings for the configurations in :data:`STORAGE_CONFIGS`."""

    host_tokens: int  # the small host tier both storage configurations run with
    spec: str | None = None  # None: a fresh temporary file: store per run, removed after
    prefetch_policy: str = "wait_complete"
    prefetch_timeout_s: float = 0.05
    lookahead: int = 1  # requests announced (Engine.prefetch) before the running one

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
        parser.add_argument(flag, dest=name, type=positive_int, default=default, metavar="N",
                            help=f"{help_text} (default: {default})")


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
                        help="trace file, JSON Lines (format: docs/workloads.md); default: a "
                        "generated agentic workload shaped by the options below")
    add_workload_arguments(parser)
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="replay only the first N requests")
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES,
                        help="model shapes (default: small)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    parser.add_argument("--device-tokens", type=positive_int, default=None,
                        help="device pool capacity in tokens (default: 25%% of the working set, "
                        "at least one request)")
    parser.add_argument("--host-tokens", type=positive_int, default=None,
                        help="host tier capacity in tokens (default: 2x the working set)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {list(ALL_CONFIGS)} (default: "
                        f"{','.join(CONFIGS)})")
    parser.add_argument("--storage", default=None, metavar="SPEC",
                        help="third tier of hierarchical+storage: 'file:DIR' or "
                        "'mooncake://HOST:PORT?metadata=URL' (default: a fresh temporary "
                        "file: store); pages are namespaced per run")
    parser.add_argument("--storage-host-tokens", type=positive_int, default=None, metavar="N",
                        help="host tier of hierarchical-small-host and hierarchical+storage "
                        "(default: 25%% of --host-tokens, at least one request)")
    parser.add_argument("--prefetch-policy", default="wait_complete",
                        choices=["best_effort", "wait_complete", "timeout"],
                        help="how long a request waits for its stored pages (default "
                        "wait_complete: the pages announced ahead are usually there already; "
                        "best_effort recomputes what is still on its way)")
    parser.add_argument("--prefetch-timeout-s", type=nonneg_float, default=0.05, metavar="S",
                        help="wait of the 'timeout' prefetch policy (default 0.05)")
    parser.add_argument("--lookahead", type=nonneg_int, default=1, metavar="N",
                        help="requests announced ahead of the running one, so their stored "
                        "pages are prefetched while it computes (default 1; 0: none)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads (default 1: the other core runs the "
                        "transfer threads, as a GPU's copy engines run beside its SMs)")
    parser.add_argument("--device", type=cliargs.device, default="cpu",
                        help="where the model and the device pool live: 'cpu' or 'cuda[:N]'")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="workload and model weights")
    add_json(parser)
    add_metrics_port(parser)


# ------------------------------------------------------------------ workload
def generated_trace(seed: int, workload: dict | None = None) -> list[TraceRequest]:
    """A trace of ``workload`` (default :data:`DEFAULT_WORKLOAD`) from :mod:`hicache.sim.traces`."""
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
    *,
    lookahead: int = 0,
    namespace: str | None = None,
) -> tuple[list[GenerateResult], float]:
    """Run ``requests`` in order through ``engine``; return the results and the wall time.

    With ``lookahead`` the next requests are announced (:meth:`Engine.prefetch`)
    before each one runs: they count as arrived and queued behind it.
    """
    results = []
    start = time.perf_counter()
    for i, req in enumerate(requests):
        if lookahead:
            # Requests up to i + lookahead have arrived; all but the newest were
            # announced at earlier steps (request 0 is scheduled as it arrives).
            first = 1 if i == 0 else i + lookahead
            for later in requests[first : i + 1 + lookahead]:
                engine.prefetch(later.prompt, namespace)
        result = engine.generate(req.prompt, req.max_new_tokens, namespace)
        results.append(result)
        if progress is not None:
            progress(i + 1, result)
    engine.drain()
    return results, time.perf_counter() - start


def build_engine(
    name: str, model: Model, device_tokens: int, host_tokens: int, page_size: int,
    storage: StorageSetup | None = None, storage_spec: str | None = None,
) -> Engine:
    """The engine of configuration ``name``; storage configurations need ``storage``
    (and ``storage_spec``, the store this run uses)."""
    spec = ALL_CONFIGS[name]
    kwargs = dict(spec.options)
    if spec.small_host or spec.has_storage:
        if storage is None:
            raise ValueError(f"config {name!r}: expected a StorageSetup, got None")
        host_tokens = storage.host_tokens
    if spec.has_host_tier:
        kwargs["host_tokens"] = host_tokens
    if spec.has_storage:
        assert storage is not None and storage_spec is not None, "no store for a storage config"
        kwargs.update(storage=storage_spec, prefetch_policy=storage.prefetch_policy,
                      prefetch_timeout_s=storage.prefetch_timeout_s)
    return Engine(model, spec.mode, device_tokens, page_size=page_size, **kwargs)


def run_configs(
    model: Model,
    requests: Sequence[Request],
    names: Sequence[str],
    device_tokens: int,
    host_tokens: int,
    page_size: int,
    progress: Callable[[str, int, GenerateResult], None] | None = None,
    storage: StorageSetup | None = None,
    metrics=None,
) -> dict[str, ConfigResult]:
    """Replay ``requests`` through each named configuration; check they generate alike.

    Configurations of :data:`STORAGE_CONFIGS` need ``storage``. Each storage run gets
    a fresh store (a temporary directory, removed afterwards) unless ``storage.spec``
    names one; then its requests use a namespace of their own, so pages of earlier
    runs (perhaps of other weights: keys cover the KV layout, not the weights) are
    never hits. ``metrics`` (a :class:`hicache.metrics.CacheMetrics`) exports each
    configuration's cache under its name, updated after every request.
    """
    warm = Engine(model, "none", max_request_tokens(requests[:1], page_size), page_size=page_size)
    warm.generate(requests[0].prompt, requests[0].max_new_tokens)
    warm.close()
    out: dict[str, ConfigResult] = {}
    for name in names:
        temp_dir = namespace = spec = None
        if ALL_CONFIGS[name].has_storage and storage is not None:
            if storage.spec is None:
                temp_dir = tempfile.mkdtemp(prefix="hicache-multiturn-")
                spec = f"file:{temp_dir}"
            else:
                spec = storage.spec
                namespace = f"multiturn-{os.getpid()}-{time.time_ns()}"
        try:
            engine = build_engine(name, model, device_tokens, host_tokens, page_size,
                                  storage, spec)
            tracked = metrics is not None and engine.cache is not None
            if tracked:
                metrics.track(engine.cache, name)
            try:
                on_result = None
                if progress is not None or tracked:
                    def on_result(i: int, r: GenerateResult, name: str = name,
                                  tracked: bool = tracked) -> None:
                        if tracked:
                            metrics.update(name)
                        if progress is not None:
                            progress(name, i, r)
                lookahead = storage.lookahead if storage is not None else 0
                results, wall_s = replay(engine, requests, on_result, lookahead=lookahead,
                                         namespace=namespace)
                engine.check_integrity()
                out[name] = ConfigResult(name, results, wall_s, engine.stats())
            finally:
                if tracked:
                    metrics.untrack(name)
                engine.close()
        finally:
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)
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


def storage_setup(
    args: argparse.Namespace, requests: Sequence[Request], host_tokens: int
) -> StorageSetup:
    """The storage configurations' settings; the small host tier defaults to 25% of the
    full one (whole pages), but holds at least the largest request."""
    small = args.storage_host_tokens
    if small is None:
        small = max(host_tokens // 4 // args.page_size * args.page_size,
                    max_request_tokens(requests, args.page_size))
    elif small < args.page_size:
        raise ValueError(
            f"--storage-host-tokens: expected >= page size ({args.page_size}), got {small}"
        )
    if not args.prefetch_timeout_s >= 0:
        raise ValueError(f"--prefetch-timeout-s: expected >= 0, got {args.prefetch_timeout_s}")
    return StorageSetup(small, args.storage, args.prefetch_policy, args.prefetch_timeout_s,
                        args.lookahead)


def measure(args: argparse.Namespace, log: Callable[[str], None], metrics=None) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_CONFIGS]
    if unknown or not names:
        raise ValueError(
            f"--configs: expected names from {list(ALL_CONFIGS)}, got {args.configs!r}"
        )
    if args.lookahead < 0:
        raise ValueError(f"--lookahead: expected >= 0, got {args.lookahead}")
    requests, ws, device_tokens, host_tokens = prepare(args)
    storage = storage_setup(args, requests, host_tokens)
    cfg = preset(args.preset)
    model = Model(cfg, device=args.device, seed=args.seed)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    log(f"workload: {len(requests)} requests, {prompt_tokens} prompt tokens "
        f"(mean {prompt_tokens / len(requests):.0f}), working set {ws} tokens; "
        f"{args.trace or 'generated ' + json.dumps(workload_from_args(args))}")
    log(f"preset {cfg.name}, page size {args.page_size}, device {device_tokens} tokens "
        f"({device_tokens / ws:.0%} of the working set), host {host_tokens} tokens, "
        f"{torch.get_num_threads()} torch threads, load average {psutil.getloadavg()[0]:.1f}")
    if any(n in STORAGE_CONFIGS for n in names):
        log(f"small host tier {storage.host_tokens} tokens ({storage.host_tokens / ws:.0%} of "
            f"the working set); storage {storage.spec or 'a fresh temporary file: store'}, "
            f"prefetch {storage.prefetch_policy}, lookahead {storage.lookahead}")

    def progress(name: str, i: int, r: GenerateResult) -> None:
        if i == len(requests):
            log(f"  {name}: {i} requests done")

    runs = run_configs(model, requests, names, device_tokens, host_tokens, args.page_size,
                       progress, storage, metrics)
    summaries = {name: summarize(res, requests) for name, res in runs.items()}
    log("")
    for line in format_table(summaries):
        log(line)
    log(conclusion(summaries))
    line = storage_conclusion(summaries)
    if line is not None:
        log(line)
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
        "storage_host_tokens": storage.host_tokens,
        "storage": storage.spec,
        "prefetch_policy": storage.prefetch_policy,
        "lookahead": storage.lookahead,
        "torch_threads": torch.get_num_threads(),
        "load_average": psutil.getloadavg()[0],
        "configs": summaries,
    }


def run(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    metrics = start_metrics(args, "hicache bench multiturn")
    try:
        result = measure(args, log, metrics)
    finally:
        if metrics is not None:
            metrics.close()
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
