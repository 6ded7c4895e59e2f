"""The engine side of ``bench multiturn`` and ``demo``: configurations, sizes, the replay.

A configuration (:data:`CONFIGS`, :data:`STORAGE_CONFIGS`) is a recipe for an
:class:`hicache.sim.engine.Engine` at shared device/host capacities;
:func:`run_configs` replays the same requests, one at a time in trace order,
through each, and checks that every configuration generated the same tokens. What
the results mean is :mod:`hicache.cli.benchmarks.multiturn_report`; the command
line is :mod:`hicache.cli.benchmarks.multiturn`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hicache.config import KVConfig
from hicache.sim.engine import Engine, GenerateResult, request_pages
from hicache.sim.model import Model
from hicache.sim.traces import Request as TraceRequest
from hicache.sim.traces import trace_stats


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


class ConfigResult(NamedTuple):
    name: str
    results: list[GenerateResult]
    wall_s: float  # whole replay, decode included
    stats: dict  # the cache's counters at the end ({} without a cache)


def to_requests(trace: Sequence[TraceRequest]) -> list[Request]:
    """Prompts as given; ``max_new_tokens = len(output)``."""
    return [Request(np.asarray(r.prompt, dtype=np.int64), len(r.output)) for r in trace]


def max_request_tokens(requests: Sequence[Request], page_size: int,
                       kv: KVConfig | None = None) -> int:
    """Device tokens (pages x page size) of the largest request: its KV rounded up to
    whole pages, and for a hybrid model's ``kv`` its component pages too."""
    longest = max(len(r.prompt) + r.max_new_tokens - 1 for r in requests)
    num_pages = -(-longest // page_size)
    return (num_pages if kv is None else request_pages(kv, num_pages)) * page_size


def capacities(
    trace: Sequence[TraceRequest],
    requests: Sequence[Request],
    page_size: int,
    device_tokens: int | None = None,
    host_tokens: int | None = None,
    kv: KVConfig | None = None,
) -> tuple[int, int, int]:
    """(working set, device, host) in tokens; defaults: device = 25% of the working set
    (at least the largest request, for a hybrid model's ``kv`` with its component
    pages: a request's window pages cover all it computes; the engine fits a hit's
    locked prefix beside them or computes from the start), host = 2x the working set
    (it never evicts)."""
    ws = trace_stats(trace, page_size).working_set_tokens
    if device_tokens is None:
        largest = max_request_tokens(requests, page_size, kv)
        device_tokens = max(ws // 4 // page_size * page_size, largest)
    if host_tokens is None:
        host_tokens = max(2 * ws, device_tokens)
    return ws, device_tokens, host_tokens


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
    warm = Engine(model, "none", max_request_tokens(requests[:1], page_size,
                                                    model.kv_config(page_size)),
                  page_size=page_size)
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
