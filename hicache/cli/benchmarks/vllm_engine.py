"""One configuration of ``hicache bench vllm``, in its own process: vLLM's AsyncLLM, driven.

``python -m hicache.cli.benchmarks.vllm_engine SPEC.json RESULT.json`` builds one
``AsyncLLM`` engine from the spec that :mod:`hicache.cli.benchmarks.vllm` wrote
(model directory, vLLM block budget, optional KV connector), replays the
spec's requests through it the way a server receives them, and writes one
JSON result. It is a separate process per configuration because vLLM starts
its own engine-core process and holds its memory until exit; a fresh process
per configuration also keeps one configuration's caches out of the next one.

How requests are issued (the regime):

* every request goes through ``AsyncLLM.generate`` (vLLM's async engine, the
  one behind its OpenAI-compatible server), as ``TokensPrompt`` token ids;
* the turns of one session run in trace order: a turn is submitted only after
  the previous turn of its session has finished;
* closed loop (``concurrency`` > 0): at most that many requests in flight; a
  freed slot goes to the earliest ready request in trace order; open loop (``request_rate`` > 0): arrivals at that Poisson
  rate (seeded), each still waiting for its session's previous turn;
* greedy sampling, ``ignore_eos``, ``max_tokens`` from the spec, so generated
  tokens can be compared across configurations.

What is recorded, all from vLLM's own metrics: per request, ``RequestOutput.metrics``
(time to first token = first-token iteration time minus arrival, of which the time
queued in the engine core before first scheduled and from then to the first token;
the decode interval) and ``num_cached_tokens``; per engine, a stat logger that sums the
prompt-token breakdown (computed / local prefix cache / external KV transfer)
and the connector's hits per tier (``CacheHitSource``), and keeps the last
connector stats; and the CPU seconds each of the run's processes used over the replay
(:mod:`~hicache.cli.benchmarks.proc_cpu`). One warm-up request (not recorded) runs first.

This module knows nothing of the report or of targets; it imports vLLM.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from hicache.cli.benchmarks.proc_cpu import cpu_seconds_by_name, cpu_seconds_since


class StatsSink:
    """Sums what vLLM's stat loggers are handed, per benchmark run (one engine)."""

    def __init__(self) -> None:
        self.recording = False  # off during the warm-up request
        self.prompt_tokens: defaultdict[str, int] = defaultdict(int)  # computed / local_cache_hit / external_kv_transfer
        self.connector_hits_by_source: defaultdict[object, int] = defaultdict(int)  # CacheHitSource value -> tokens
        self.connector_queries = 0  # tokens the connector was asked about
        self.connector_hits = 0  # tokens it said it had
        self.connector_stats: dict = {}  # kv_connector_stats summed over steps (numbers only)
        self.num_preempted = 0
        self.step_times: list[float] = []  # wall clock (time.time) of each step's outputs
        self.step_computed: list[int] = []  # prompt tokens each of those steps computed

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if not self.recording:
            return
        if iteration_stats is not None:
            self.step_times.append(iteration_stats.iteration_timestamp)
            p = iteration_stats.prompt_token_stats
            self.step_computed.append(p.computed)
            self.prompt_tokens["computed"] += p.computed
            self.prompt_tokens["local_cache_hit"] += p.local_cache_hit
            self.prompt_tokens["external_kv_transfer"] += p.external_kv_transfer
            self.prompt_tokens["total"] += p.total
            self.num_preempted += iteration_stats.num_preempted_reqs
        if scheduler_stats is not None:
            c = scheduler_stats.connector_prefix_cache_stats
            if c is not None:
                self.connector_queries += c.queries
                self.connector_hits += c.hits
                for source, n in c.hits_by_source.items():
                    self.connector_hits_by_source[getattr(source, "value", str(source))] += n
            if scheduler_stats.kv_connector_stats:
                from hicache.integrations.vllm.scheduler.half import SNAPSHOT_STATS

                step = scheduler_stats.kv_connector_stats
                _add_numbers(self.connector_stats, step)
                for key in SNAPSHOT_STATS & step.keys():  # occupancy: the latest, not a sum
                    self.connector_stats[key] = step[key]


def _add_numbers(total: dict, step: dict) -> None:
    """``total += step`` for the numbers of a (nested) dict; other values are dropped.

    Connectors hand vLLM what happened since their last report (bytes, seconds,
    blocks), so the run's totals are the sums.
    """
    for key, value in step.items():
        if isinstance(value, dict):
            _add_numbers(total.setdefault(str(key), {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[str(key)] = total.get(str(key), 0) + value


def _stat_logger_factory(sink: StatsSink):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            sink.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _SinkLogger


def _engine_args(spec: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=spec["model_dir"], skip_tokenizer_init=True, dtype=spec["dtype"],
        enforce_eager=spec["enforce_eager"], block_size=spec["block_size"],
        num_gpu_blocks_override=spec["vllm_blocks"], max_model_len=spec["max_model_len"],
        gpu_memory_utilization=spec["gpu_memory_utilization"], enable_prefix_caching=True,
        seed=spec["seed"], max_num_seqs=max(1, spec["max_num_seqs"]),
        # The same executor for every configuration (with a KV connector vLLM runs its
        # worker in a process of its own; without one it may run it in-process).
        distributed_executor_backend="mp",
    )
    if spec.get("hybrid"):  # a hybrid model: vLLM's hybrid KV cache manager, forced on
        kwargs["disable_hybrid_kv_cache_manager"] = False
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    return AsyncEngineArgs(**kwargs)


async def _generate(engine: Any, rid: str, prompt: list[int], max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, rid):
        final = out
    return final


def _request_record(req: dict, out: Any) -> dict:
    m = out.metrics  # RequestStateStats: vLLM's per-request timestamps
    completion = out.outputs[0]
    num_generated = len(completion.token_ids)
    decode_s = m.last_token_ts - m.first_token_ts
    return {
        "id": req["id"],
        "session": req["session"],
        "prompt_tokens": len(req["prompt"]),
        "cached_tokens": int(out.num_cached_tokens or 0),
        "ttft_s": m.first_token_latency,
        # engine-core clock: waiting in vLLM's queue until first scheduled, then until the
        # first token (the steps that computed the prompt, and those shared with others)
        "queued_s": _span(m, "queued_ts", "scheduled_ts"),
        "prefill_s": _span(m, "scheduled_ts", "first_token_ts"),
        "arrival_s": m.arrival_time,  # time.time(), like the steps' output times
        "decode_step_s": decode_s / (num_generated - 1) if num_generated > 1 else None,
        "output": list(completion.token_ids),
        "preemptions": m.num_preemptions,
    }


def _span(metrics: Any, start: str, end: str) -> float | None:
    """``metrics.end - metrics.start`` (engine-core timestamps), None where vLLM did not
    record both (0.0 is its "not set")."""
    a, b = getattr(metrics, start, 0.0), getattr(metrics, end, 0.0)
    return b - a if a and b else None


class OrderedSlots:
    """At most ``n`` holders; a freed slot goes to the lowest-numbered waiter.

    So ready requests start in trace order, whatever order their sessions' previous
    turns finished in (a plain FIFO semaphore would serve every session's first turn
    before anyone's second one).
    """

    def __init__(self, n: int) -> None:
        self.num_free = n
        self._waiters: list[tuple[int, asyncio.Future]] = []  # heap of (trace index, future)

    async def acquire(self, index: int) -> None:
        if self.num_free > 0:
            self.num_free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (index, fut))
        await fut  # the slot is handed over by release(), not re-counted

    def release(self) -> None:
        if self._waiters:
            heapq.heappop(self._waiters)[1].set_result(None)
        else:
            self.num_free += 1


async def drive(submit: Callable[[dict], Awaitable[dict]], requests: list[dict], *,
                concurrency: int, request_rate: float, seed: int,
                on_done: Callable[[], None] = lambda: None) -> tuple[list[dict], list[str]]:
    """Issue every request the way a server receives them; ``submit(request)`` runs one.

    A request starts once the previous request of its session has finished, and
    then: with ``concurrency`` > 0, when one of that many slots is free (the earliest
    ready request in trace order first); otherwise (``request_rate`` > 0) at its
    Poisson arrival time (seeded), or later if its session's previous turn is still
    running. Returns what ``submit`` returned for the requests that finished, in
    trace order, and the errors of those that failed (a failed turn still releases
    its session's next one).
    """
    if (concurrency > 0) == (request_rate > 0):
        raise ValueError(f"expected one of concurrency > 0 or request_rate > 0, "
                         f"got {concurrency}, {request_rate}")
    slots = OrderedSlots(concurrency) if concurrency > 0 else None
    loop = asyncio.get_running_loop()
    start = loop.time()
    arrivals = None
    if request_rate > 0:
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, len(requests)))
    last_of_session: dict[int, asyncio.Event] = {}
    records: list[dict | None] = [None] * len(requests)

    async def one(i: int, req: dict, after: asyncio.Event | None, done: asyncio.Event) -> None:
        try:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, start + float(arrivals[i]) - loop.time()))
            if after is not None:
                await after.wait()
            if slots is not None:
                await slots.acquire(i)
            try:
                records[i] = await submit(req)
                on_done()
            finally:
                done.set()
                if slots is not None:
                    # Released on the next loop turn: the session's next request, woken
                    # by done, is queued by then and competes for this slot by index.
                    loop.call_soon(slots.release)
        finally:
            done.set()  # also when it failed before submitting

    tasks = []
    for i, req in enumerate(requests):
        done = asyncio.Event()
        tasks.append(asyncio.create_task(one(i, req, last_of_session.get(req["session"]), done)))
        last_of_session[req["session"]] = done
    # A failed request is reported (count and first errors), not fatal to the run.
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [repr(e) for e in outcomes if isinstance(e, BaseException)]
    return [r for r in records if r is not None], errors


async def _run(spec: dict) -> dict:
    from tqdm import tqdm
    from vllm.v1.engine.async_llm import AsyncLLM

    with open(spec["requests_path"]) as f:
        requests = [json.loads(line) for line in f]
    sink = StatsSink()
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(_engine_args(spec),
                                       stat_loggers=[_stat_logger_factory(sink)])
    try:
        start_s = time.perf_counter() - t0
        # Warm-up: one short request of token ids the trace never sends (ids from the
        # top of the vocabulary, a fixed pattern), so kernel set-up is not charged to
        # the first measured request. It leaves one or two blocks in the caches.
        warm = [(spec["vocab_size"] - 1 - i % 7) for i in range(2 * spec["block_size"] + 1)]
        await _generate(engine, "warmup", warm, 2)
        await asyncio.sleep(0.2)  # let the warm-up's stats drain before recording
        sink.recording = True
        cpu_before = cpu_seconds_by_name()
        # The parent's terminal (or its stderr under --json): this process's own stdout
        # and stderr, where vLLM logs, go to the configuration's log file.
        progress_file = os.fdopen(spec["progress_fd"], "w", closefd=False)
        progress = tqdm(total=len(requests), desc=f"{spec['config']:<18}", unit="req",
                        file=progress_file, dynamic_ncols=True, leave=True)
        t1 = time.perf_counter()
        async def submit(req: dict) -> dict:
            out = await _generate(engine, str(req["id"]), req["prompt"], req["max_tokens"])
            return _request_record(req, out)

        records, errors = await drive(submit, requests, concurrency=spec["concurrency"],
                                      request_rate=spec["request_rate"], seed=spec["seed"],
                                      on_done=lambda: progress.update(1))
        wall_s = time.perf_counter() - t1
        progress.close()
        progress_file.flush()
        await asyncio.sleep(0.5)  # the last steps' stats reach the logger asynchronously
        cpu_s = cpu_seconds_since(cpu_before, cpu_seconds_by_name())
    finally:
        engine.shutdown()
    return {
        "config": spec["config"],
        "engine_start_s": start_s,
        "wall_s": wall_s,
        "requests": records,
        "num_failed": len(requests) - len(records),
        "errors": errors[:5],
        "prompt_token_stats": dict(sink.prompt_tokens),
        "connector_queries": sink.connector_queries,
        "connector_hits": sink.connector_hits,
        "connector_hits_by_source": dict(sink.connector_hits_by_source),
        "connector_stats": sink.connector_stats,
        "num_preempted": sink.num_preempted,
        "step_times": sink.step_times,
        "step_computed": sink.step_computed,
        "cpu_seconds": cpu_s,  # per process name, over the replay (proc_cpu)
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m hicache.cli.benchmarks.vllm_engine SPEC.json RESULT.json",
              file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = asyncio.run(_run(spec))
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])  # the parent reads a whole result or none
    return 0


if __name__ == "__main__":
    sys.exit(main())
