"""Backup and load bandwidth for scattered pages, beside a contiguous copy of the same bytes.

Regime: a transfer of ``--total-mib`` MiB made of pages at random (scattered) ids in
both pools, the worst case for a page allocator that has churned for a while. Page
size ``page_kib`` is the bytes one page moves in one copy: one page's K (or V) of one
layer, the row both pools store contiguously (``page_size * heads * head_dim *
itemsize``). The limit is a contiguous ``copy_`` of the same total bytes, measured
in the same run, interleaved with the transfers so that machine noise hits both.
The analytic model: a transfer at the limit takes ``total_bytes / limit`` seconds.

CPU: pools in host memory, thread executor (layer by layer both ways). CUDA (when available, ``--device cuda``): device pool on
the GPU, pinned host pool, CUDA executor; the limits are a pinned contiguous
``cudaMemcpyAsync`` each way, and a pageable one is reported beside it.

Last stdout line: ``{"limit_gbps": L, "rows": [{"op", "page_kib", "gbps"}, ...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hicache.cli import args as cliargs
from hicache.cli.args import UsageError, add_json, nonneg_int, positive_int
from hicache.cli.benchmarks import standalone_main
from hicache.config import KVConfig
from hicache.memory import DevicePool, HostPool
from hicache.transfer import TransferEngine

_HEADS, _HEAD_DIM, _DTYPE = 8, 128, torch.bfloat16  # 2 KiB per token per layer per K/V


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    parser.add_argument("--page-kib", type=positive_int, nargs="+",
                        default=[16, 32, 64, 128, 256, 512, 1024, 2048],
                        help="page sizes to measure, KiB per page over all layers (even numbers)")
    parser.add_argument("--total-mib", type=positive_int, default=128,
                        help="MiB moved by each timed transfer")
    parser.add_argument("--num-layers", type=positive_int, default=4,
                        help="layers of the KV layout (each page is split over them)")
    parser.add_argument("--repeats", type=positive_int, default=6,
                        help="timed runs per row (median); a multiple of 3 rotates evenly")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seeds the page order")
    parser.add_argument("--device", type=cliargs.device,
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="'cpu' or 'cuda[:N]' (default: cuda when available)")
    parser.add_argument("--native", choices=["auto", "on", "off"], default="auto",
                        help="CPU row copier: native C (on), torch gather/scatter (off)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class _Limits:
    """Contiguous copies of ``total_nbytes``, allocated once: the limit(s) for this device."""

    def __init__(self, total_nbytes: int, device: torch.device) -> None:
        self.device = device
        words = total_nbytes // 4
        if device.type == "cpu":
            src = torch.ones(words, dtype=torch.int32)
            dst = torch.zeros(words, dtype=torch.int32)
            self.cases = {"copy": lambda: dst.copy_(src)}
            return
        gpu = torch.ones(words, dtype=torch.int32, device=device)
        pinned = torch.zeros(words, dtype=torch.int32, pin_memory=True)
        pageable = torch.zeros(words, dtype=torch.int32)
        self.cases = {
            "h2d_pinned": lambda: gpu.copy_(pinned, non_blocking=True),
            "d2h_pinned": lambda: pinned.copy_(gpu, non_blocking=True),
            "h2d_pageable": lambda: gpu.copy_(pageable, non_blocking=True),
            "d2h_pageable": lambda: pageable.copy_(gpu, non_blocking=True),
        }
        for fn in self.cases.values():
            _timed(fn, device)  # warm-up

    def measure(self) -> dict[str, float]:
        return {name: _timed(fn, self.device) for name, fn in self.cases.items()}


def _measure_page_size(args, page_kib: int, device: torch.device, gen, limits: _Limits):
    page_size = page_kib * 1024 // (_HEADS * _HEAD_DIM * 2)
    kv = KVConfig(args.num_layers, _HEADS, _HEAD_DIM, _DTYPE, page_size)
    row_nbytes = page_kib * 1024
    num_pages = (args.total_mib << 20) // (row_nbytes * 2 * args.num_layers)
    if num_pages < 1:
        raise ValueError(f"--total-mib: expected at least one page per transfer, got "
                         f"{args.total_mib} MiB for {row_nbytes * 2 * args.num_layers} B pages")
    # Pools twice the transfer so that random ids are scattered, not a permutation.
    device_pool = DevicePool(kv, 2 * num_pages, device=str(device))
    host_pool = HostPool(kv, 2 * num_pages, reserve_nbytes=1 << 30)
    host_pool.buffer.view(torch.uint8).fill_(1)  # first touch outside the timed region
    native = {"auto": None, "on": True, "off": False}[args.native]
    engine = TransferEngine(device_pool, host_pool, native=native)
    device_ids = torch.randperm(2 * num_pages, generator=gen)[:num_pages]
    host_ids = torch.randperm(2 * num_pages, generator=gen)[:num_pages]
    total_nbytes = num_pages * kv.page_nbytes

    def backup():
        engine.backup(device_ids, host_ids).wait()

    def load():
        handle = engine.load(host_ids, device_ids)
        for layer in range(kv.num_layers):
            handle.wait_layer(layer)
        handle.wait()

    times: dict[str, list[float]] = {"backup": [], "load": []}
    limit_times: dict[str, list[float]] = {}
    backup(), load()  # warm-up
    # The op run right after a large copy pays for writing back its dirty cache lines:
    # rotate the order so that every op follows every other one equally often.
    ops = [("limit", None), ("backup", backup), ("load", load)]
    for rep in range(args.repeats):
        for name, fn in ops[rep % 3 :] + ops[: rep % 3]:
            if fn is None:
                for limit_name, secs in limits.measure().items():
                    limit_times.setdefault(limit_name, []).append(secs)
            else:
                times[name].append(_timed(fn, device))
    failed = [h.error for h in engine.poll() if h.error is not None]
    engine.close()
    if failed:
        raise RuntimeError(f"transfer failed during the benchmark: {failed[0]!r}")
    return total_nbytes, times, limit_times


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    rows, all_limits = [], {}
    limit_copies = _Limits(args.total_mib << 20, device)
    lines = [f"{'op':<8}{'page_kib':>9}{'GB/s':>8}{'x limit':>9}"]
    odd = [k for k in args.page_kib if k * 1024 % (_HEADS * _HEAD_DIM * 2)]
    if odd:
        raise UsageError(f"--page-kib: expected multiples of 2, got {odd[0]}")
    for page_kib in args.page_kib:
        total_nbytes, times, limit_times = _measure_page_size(
            args, page_kib, device, gen, limit_copies
        )
        for name, secs in limit_times.items():
            all_limits.setdefault(name, []).extend(total_nbytes / s / 1e9 for s in secs)
        for op, secs in times.items():
            gbps = total_nbytes / statistics.median(secs) / 1e9
            rows.append({"op": op, "page_kib": page_kib, "gbps": round(gbps, 2)})
    limits = {name: round(statistics.median(v), 2) for name, v in all_limits.items()}
    if device.type == "cpu":
        result = {"limit_gbps": limits["copy"], "rows": rows, "device": "cpu"}
        ref = {"backup": limits["copy"], "load": limits["copy"]}
    else:
        result = {
            "limit_gbps": min(limits["h2d_pinned"], limits["d2h_pinned"]),
            "rows": rows, "device": torch.cuda.get_device_name(device), "limits": limits,
        }
        ref = {"backup": limits["d2h_pinned"], "load": limits["h2d_pinned"]}
    result["threads"] = torch.get_num_threads()
    for row in rows:
        row["x_limit"] = round(row["gbps"] / ref[row["op"]], 2)
        lines.append(f"{row['op']:<8}{row['page_kib']:>9}{row['gbps']:>8.2f}{row['x_limit']:>9.2f}")
    if not args.json:
        print(f"transfer bench on {result['device']}: limits (GB/s, median) {limits}")
        print("\n".join(lines))
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
