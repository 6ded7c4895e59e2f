"""Backup and load bandwidth for scattered pages, beside a contiguous copy of the same bytes.

Regime: a transfer of ``--total-mib`` MiB made of pages at random (scattered) ids in
both pools, the worst case for a page allocator that has churned for a while. Page
size ``page_kib`` is the bytes one page moves in one copy: one page's K (or V) of one
layer, the row both pools store contiguously (``page_size * heads * head_dim *
itemsize``); a whole page is ``2 * --num-layers`` such rows. The limit is a contiguous
copy of the same total bytes, measured in the same run, interleaved with the
transfers so that machine noise hits both; ``x_limit`` is a row's bandwidth over it.
The analytic model: a transfer at the limit takes ``total_bytes / limit`` seconds.

Modes (``--modes``): ``load`` (host to device, each layer waited for as a model
would), ``backup`` (device to host), ``both`` (a backup and a load submitted
together, on disjoint pages: what a serving engine does while it saves one request
and loads another; bandwidth counts the bytes of both, and the limit is both
contiguous copies running at once).

CPU: pools in host memory, thread executor (layer by layer both ways); the limits are
``copy_`` (one thread), and two ``copy_`` in two threads for ``both``. CUDA (when
available, ``--device cuda``): device pool on the GPU, pinned host pool, CUDA
executor; the limits are a pinned contiguous ``cudaMemcpyAsync`` each way
(``h2d_pinned``, ``d2h_pinned``), both at once on two streams (``both_pinned``), and
a pageable copy each way reported beside them.

Last stdout line: ``{"limit_gbps": L, "limits": {...}, "rows": [{"op", "page_kib",
"page_nbytes", "gbps", "x_limit"}, ...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.cli import args as cliargs
from hicache.cli.args import UsageError, add_json, nonneg_int, positive_int
from hicache.cli.benchmarks import standalone_main
from hicache.config import KVConfig
from hicache.memory import DevicePool, HostPool
from hicache.transfer import TransferEngine

_HEADS, _HEAD_DIM, _DTYPE = 8, 128, torch.bfloat16  # 2 KiB per token per layer per K/V
MODES = ("load", "backup", "both")
# The limit each mode's bandwidth is held against, per device type.
_REFERENCE = {
    "cpu": {"load": "copy", "backup": "copy", "both": "copy_both"},
    "cuda": {"load": "h2d_pinned", "backup": "d2h_pinned", "both": "both_pinned"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    parser.add_argument("--page-kib", type=positive_int, nargs="+",
                        default=[16, 32, 64, 128, 256, 512, 1024, 2048],
                        help="page sizes to measure: KiB of one page's K (or V) in one layer, "
                        "the unit copied contiguously (even numbers)")
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
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="what to measure: load, backup, both at once (default: all)")


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
    """Contiguous copies of ``total_nbytes``, allocated once: the limit(s) for this device.

    Each case returns the bytes it moved (``both`` moves ``total_nbytes`` each way).
    """

    def __init__(self, total_nbytes: int, device: torch.device) -> None:
        self.device = device
        words = total_nbytes // 4
        if device.type == "cpu":
            src = torch.ones(words, dtype=torch.int32)
            dst = torch.zeros(words, dtype=torch.int32)
            src2 = torch.ones(words, dtype=torch.int32)
            dst2 = torch.zeros(words, dtype=torch.int32)

            def both_cpu() -> None:  # one copy per thread, as the thread executor runs them
                other = threading.Thread(target=lambda: dst2.copy_(src2))
                other.start()
                dst.copy_(src)
                other.join()

            self.cases = {"copy": (lambda: dst.copy_(src), total_nbytes),
                          "copy_both": (both_cpu, 2 * total_nbytes)}
            return
        gpu = torch.ones(words, dtype=torch.int32, device=device)
        gpu2 = torch.ones(words, dtype=torch.int32, device=device)
        pinned = torch.zeros(words, dtype=torch.int32, pin_memory=True)
        pinned2 = torch.zeros(words, dtype=torch.int32, pin_memory=True)
        pageable = torch.zeros(words, dtype=torch.int32)
        h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both() -> None:  # one cudaMemcpyAsync each way, on two streams at once
            with torch.cuda.stream(h2d_stream):
                gpu.copy_(pinned, non_blocking=True)
            with torch.cuda.stream(d2h_stream):
                pinned2.copy_(gpu2, non_blocking=True)

        self.cases = {
            "h2d_pinned": (lambda: gpu.copy_(pinned, non_blocking=True), total_nbytes),
            "d2h_pinned": (lambda: pinned.copy_(gpu, non_blocking=True), total_nbytes),
            "both_pinned": (both, 2 * total_nbytes),
            "h2d_pageable": (lambda: gpu.copy_(pageable, non_blocking=True), total_nbytes),
            "d2h_pageable": (lambda: pageable.copy_(gpu, non_blocking=True), total_nbytes),
        }
        for fn, _ in self.cases.values():
            _timed(fn, device)  # warm-up

    def measure(self) -> dict[str, float]:
        """GB/s of each case, once."""
        return {name: nbytes / _timed(fn, self.device) / 1e9
                for name, (fn, nbytes) in self.cases.items()}


def _measure_page_size(args, page_kib: int, device: torch.device, gen, limits: _Limits):
    """Median seconds of each mode at one page size, and the limits measured between them."""
    page_size = page_kib * 1024 // (_HEADS * _HEAD_DIM * 2)
    kv = KVConfig(args.num_layers, _HEADS, _HEAD_DIM, _DTYPE, page_size)
    row_nbytes = page_kib * 1024
    num_pages = (args.total_mib << 20) // (row_nbytes * 2 * args.num_layers)
    if num_pages < 1:
        raise UsageError(f"--total-mib: expected at least one page per transfer, got "
                         f"{args.total_mib} MiB for {row_nbytes * 2 * args.num_layers} B pages")
    # Pools twice the transfer so that random ids are scattered, not a permutation; in
    # "both" the backup and the load take the two disjoint halves of each permutation.
    device_pool = DevicePool(kv, 2 * num_pages, device=str(device))
    host_pool = HostPool(kv, 2 * num_pages, reserve_nbytes=1 << 30)
    host_pool.buffer.view(torch.uint8).fill_(1)  # first touch outside the timed region
    native = {"auto": None, "on": True, "off": False}[args.native]
    engine = TransferEngine(device_pool, host_pool, native=native)
    device_perm = torch.randperm(2 * num_pages, generator=gen)
    host_perm = torch.randperm(2 * num_pages, generator=gen)
    device_ids, host_ids = device_perm[:num_pages], host_perm[:num_pages]
    other_device, other_host = device_perm[num_pages:], host_perm[num_pages:]
    total_nbytes = num_pages * kv.page_nbytes

    def wait_load(handle) -> None:
        for layer in range(kv.num_layers):  # as a model would, layer by layer
            handle.wait_layer(layer)
        handle.wait()

    def backup() -> None:
        engine.backup(device_ids, host_ids).wait()

    def load() -> None:
        wait_load(engine.load(host_ids, device_ids))

    def both() -> None:
        saving = engine.backup(device_ids, host_ids)
        wait_load(engine.load(other_host, other_device))
        saving.wait()

    modes = {"backup": backup, "load": load, "both": both}
    timed = [(m, modes[m]) for m in MODES if m in args.modes]
    ops: list[tuple[str, Callable[[], None] | None]] = [("limit", None), *timed]
    times: dict[str, list[float]] = {name: [] for name, _ in timed}
    limit_gbps: dict[str, list[float]] = {}
    for _, op in timed:
        op()  # warm-up
    # The op run right after a large copy pays for writing back its dirty cache lines:
    # rotate the order so that every op follows every other one equally often.
    for rep in range(args.repeats):
        k = rep % len(ops)
        for name, fn in ops[k:] + ops[:k]:
            if fn is None:
                for limit_name, gbps in limits.measure().items():
                    limit_gbps.setdefault(limit_name, []).append(gbps)
            else:
                times[name].append(_timed(fn, device))
    failed = [h.error for h in engine.poll() if h.error is not None]
    engine.close()
    if failed:
        raise RuntimeError(f"transfer failed during the benchmark: {failed[0]!r}")
    return total_nbytes, kv.page_nbytes, times, limit_gbps


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    all_limits: dict[str, list[float]] = {}
    limit_copies = _Limits(args.total_mib << 20, device)
    lines = [f"{'op':<8}{'page_kib':>9}{'GB/s':>8}{'x limit':>9}"]
    odd = [k for k in args.page_kib if k * 1024 % (_HEADS * _HEAD_DIM * 2)]
    if odd:
        raise UsageError(f"--page-kib: expected multiples of 2, got {odd[0]}")
    for page_kib in args.page_kib:
        total_nbytes, page_nbytes, times, limit_gbps = _measure_page_size(
            args, page_kib, device, gen, limit_copies
        )
        for name, values in limit_gbps.items():
            all_limits.setdefault(name, []).extend(values)
        for op, secs in times.items():
            moved = 2 * total_nbytes if op == "both" else total_nbytes
            gbps = moved / statistics.median(secs) / 1e9
            rows.append({"op": op, "page_kib": page_kib, "page_nbytes": page_nbytes,
                         "gbps": round(gbps, 2)})
    limits = {name: round(statistics.median(v), 2) for name, v in all_limits.items()}
    reference = _REFERENCE[device.type]
    if device.type == "cpu":
        result = {"limit_gbps": limits["copy"], "device": "cpu"}
    else:
        result = {"limit_gbps": min(limits["h2d_pinned"], limits["d2h_pinned"]),
                  "device": torch.cuda.get_device_name(device)}
    result.update(limits=limits, reference=reference, rows=rows,
                  total_mib=args.total_mib, num_layers=args.num_layers,
                  threads=torch.get_num_threads())
    for row in rows:
        row["x_limit"] = round(row["gbps"] / limits[reference[row["op"]]], 2)
        lines.append(f"{row['op']:<8}{row['page_kib']:>9}{row['gbps']:>8.2f}{row['x_limit']:>9.2f}")
    if not args.json:
        print(f"transfer bench on {result['device']}: limits (GB/s, median) {limits}")
        print("\n".join(lines))
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
