"""What handing a load to the copy thread costs vLLM's model runner (CPU backend).

The vLLM connector's worker half (``hicache.integrations.vllm.worker.half.WorkerHalf``) alone,
with ``medium``-preset KV shapes (8 layers, 12 KV heads of 64, blocks of 32 tokens,
float32, vLLM's CPU layout): each of ``--loads`` steps calls ``start_loads`` for
``--blocks`` blocks, as ``start_load_kv`` does, then keeps the calling thread busy for
``--forward-ms`` (a stand-in for the forward the copy runs under), then waits for the
load. The calling thread is pinned to CPU 0 (vLLM's compute core); with ``--executor
thread`` the copy thread runs on CPU 1 (the core vLLM keeps free), with ``manual``
nothing is woken and nothing copied (the bookkeeping alone).

Printed: ``start_loads`` wall time (median, mean) and CPU time (median) in ms. On a
machine whose CPU 1 is busy, the thread executor's mean exceeds its median: the
model runner waits for the copy thread whenever the OS preempts it on CPU 1 while it
holds the GIL. Linux, 2 CPUs or more. Last line: one JSON object.

    python bench/load_handoff.py [--executor thread|manual] [--loads 60] [--blocks 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.plan import LoadOp, StepPlan
from hicache.integrations.vllm.worker.half import WorkerHalf

NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM = 8, 148, 32, 12, 64  # medium, CPU layout
NUM_HOST_PAGES = 700


def run(executor: str, num_loads: int, num_blocks: int, forward_ms: float) -> dict:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    kv = {f"l{i}": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
          for i in range(NUM_LAYERS)}
    extra = {"host_tokens": NUM_HOST_PAGES * BLOCK, "executor": executor,
             "host_reserve_gb": 0}
    if executor == "thread":
        extra["copy_cpus"] = [1]
    worker = WorkerHalf(ConnectorConfig.from_extra(extra), kv, num_blocks=NUM_BLOCKS,
                        block_size=BLOCK, num_host_pages=NUM_HOST_PAGES)
    walls, cpus = [], []
    try:
        for step in range(num_loads):
            blocks = list(range(num_blocks))
            pages = [(step * num_blocks + j) % NUM_HOST_PAGES for j in blocks]
            plan = StepPlan(loads=[LoadOp(f"r{step}", blocks, pages)],
                            blocks=[(f"r{step}", blocks, True)])
            worker.begin_step(plan)
            start, start_cpu = time.perf_counter(), time.thread_time()
            worker.start_loads(plan)
            walls.append(time.perf_counter() - start)
            cpus.append(time.thread_time() - start_cpu)
            busy_until = time.perf_counter() + forward_ms / 1e3
            while time.perf_counter() < busy_until:  # the forward, holding the GIL
                pass
            if executor == "manual":  # nothing copies: drop the load unfinished
                for transfer in worker.transfers.executor.pending():
                    worker.transfers.executor.fail(transfer, RuntimeError("not copied"))
            worker.end_step(plan)
            worker.load_errors()
            worker.finished({f"r{step}"})
    finally:
        worker.close()
    ms = [w * 1e3 for w in walls]
    return {"executor": executor, "loads": num_loads, "blocks": num_blocks,
            "load_nbytes": num_blocks * worker.host_pool.page_nbytes,
            "start_loads_median_ms": round(statistics.median(ms), 3),
            "start_loads_mean_ms": round(statistics.mean(ms), 3),
            "start_loads_max_ms": round(max(ms), 3),
            "start_loads_cpu_median_ms": round(statistics.median(cpus) * 1e3, 3),
            "loadavg_1min": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=("thread", "manual"), default="thread")
    parser.add_argument("--loads", type=int, default=60, help="steps that load (default 60)")
    parser.add_argument("--blocks", type=int, default=20, help="blocks per load (default 20)")
    parser.add_argument("--forward-ms", type=float, default=20.0,
                        help="busy time after each start_loads (default 20)")
    args = parser.parse_args(argv)
    if args.loads < 1 or not 1 <= args.blocks <= NUM_BLOCKS or args.forward_ms < 0:
        parser.error(f"expected --loads >= 1, 1 <= --blocks <= {NUM_BLOCKS}, --forward-ms "
                     f">= 0, got {args.loads}, {args.blocks}, {args.forward_ms}")
    if len(os.sched_getaffinity(0) & {0, 1}) < 2:
        parser.error("expected CPUs 0 and 1 available to this process")
    out = run(args.executor, args.loads, args.blocks, args.forward_ms)
    print(f"{out['executor']}: start_loads of {out['load_nbytes'] / 2**20:.1f} MiB, "
          f"{out['loads']} loads: wall median {out['start_loads_median_ms']:.3f} ms, mean "
          f"{out['start_loads_mean_ms']:.3f} ms, max {out['start_loads_max_ms']:.3f} ms; CPU "
          f"median {out['start_loads_cpu_median_ms']:.3f} ms (load average "
          f"{out['loadavg_1min']})", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
