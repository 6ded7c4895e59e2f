"""Recompute vs reload: what a host-tier hit saves, per prefix length.

For each prefix length, in one run on one machine:

- recompute: prefill of the prefix through :meth:`Model.forward` into device
  pool pages (last-position logits only, as a real prefill);
- reload: :meth:`TransferEngine.load` of the same prefix's KV from host pool
  pages into device pool pages (scattered page ids on both sides), waited to
  completion; the reloaded KV is checked equal to the recomputed one;
- copy limit: one contiguous ``copy_`` of the same bytes, interleaved with the
  reloads, the best a load of them can do; ``fraction`` = copy time / reload
  time. On the CPU both run single-threaded (see the comment in ``measure``).

Medians over ``--repeats`` after one warm-up. On a CPU the "device" pool is host
memory too, so reload is a memory-to-memory copy while recompute runs on two
cores: the ratio is far above a GPU's. The analytic ESTIMATE for full
Llama-3-8B / -70B on H100 / H200 (see :mod:`hicache.sim.costmodel`) is printed
beside the measurement and is never mixed into it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import psutil
import torch

from hicache.cli import args as cliargs
from hicache.cli.args import UsageError, add_json, nonneg_int, positive_int, user_input
from hicache.cli.benchmarks import standalone_main
from hicache.config import resolve_dtype
from hicache.memory import DevicePool, HostPool
from hicache.sim.costmodel import DEFAULT_MFU, GPUS, estimate_table, kv_bytes_per_token
from hicache.sim.model import PRESET_NAMES, Model, preset
from hicache.transfer import TransferEngine

DEFAULT_TOKENS = "128,256,512,1024,2048,4096,8192"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", choices=PRESET_NAMES,
                        help="model shapes (default: small; llama3-8b-layers2 is ~100x slower "
                        "to recompute on a CPU, pass fewer --tokens)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS,
                        help=f"comma-separated prefix lengths (default {DEFAULT_TOKENS})")
    parser.add_argument("--device", type=cliargs.device, default="cpu",
                        help="'cpu' or 'cuda[:N]'")
    parser.add_argument("--dtype", default=None,
                        help="model and KV dtype (default: the preset's, float32)")
    parser.add_argument("--executor", default="auto",
                        choices=["auto", "thread", "cuda", "immediate"],
                        help="transfer executor")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed recompute runs per length")
    parser.add_argument("--reload-repeats", type=positive_int, default=20,
                        help="timed reload and copy runs per length")
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seeds the model weights")
    add_json(parser)


def _parse_tokens(text: str, page_size: int) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--tokens: expected comma-separated ints, got {text!r}") from None
    bad = [v for v in values if v <= 0 or v % page_size]
    if not values or bad:
        raise UsageError(
            f"--tokens: expected positive multiples of the page size {page_size}, got {text!r}"
        )
    return values


def _time_s(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call of ``fn``, including the device work it queued."""
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _median_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    _time_s(fn, device)
    return statistics.median(_time_s(fn, device) for _ in range(repeats))


def _interleaved_median_s(
    fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median wall times of ``fn_a`` and ``fn_b``, run alternately, after one warm-up each."""
    _time_s(fn_a, device)
    _time_s(fn_b, device)
    pairs = [(_time_s(fn_a, device), _time_s(fn_b, device)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def _estimates(tokens: list[int]) -> dict:
    rows = [e._asdict() for n in tokens for e in estimate_table(n)]
    return {
        "label": "ESTIMATE (analytic, not measured): full Llama-3 models, bf16 KV, "
        f"MFU {DEFAULT_MFU:.0%} of dense bf16 peak, PCIe Gen5 x16 at "
        f"{GPUS['H100-SXM'].pcie_gbps:.0f} GB/s effective",
        "rows": rows,
    }


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Run the benchmark; return the JSON-ready result."""
    cfg = preset(args.preset, dtype=args.dtype)
    page_size = args.page_size
    token_counts = _parse_tokens(args.tokens, page_size)
    device = torch.device(args.device)
    kv = cfg.kv_config(page_size)
    max_pages = max(token_counts) // page_size
    gen = torch.Generator().manual_seed(args.seed)

    model = Model(cfg, device=args.device, seed=args.seed)
    device_pool = DevicePool(kv, 2 * max_pages, device=args.device)
    host_pool = HostPool(kv, max_pages)
    engine = TransferEngine(device_pool, host_pool, executor=args.executor)
    # Scattered ids on both tiers: a real allocator never hands out one contiguous run.
    device_perm = torch.randperm(2 * max_pages, generator=gen)
    host_perm = torch.randperm(max_pages, generator=gen)
    prompt = torch.randint(0, cfg.vocab_size, (max(token_counts),), generator=gen)

    log(f"preset {cfg.name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.torch_dtype}), page size {page_size}, KV {kv.token_nbytes} bytes/token, "
        f"device {device}, executor {args.executor}, {torch.get_num_threads()} threads, "
        f"load average {psutil.getloadavg()[0]:.1f}")
    header = (f"{'tokens':>7} {'recompute_ms':>13} {'reload_ms':>10} {'ratio':>8} "
              f"{'copy_ms':>9} {'reload_GB/s':>12} {'copy_GB/s':>10} {'fraction':>9}")
    log(header)
    rows, copy_gbps = [], 0.0
    for num_tokens in token_counts:
        num_pages = num_tokens // page_size
        nbytes = num_pages * kv.page_nbytes
        src_pages, dst_pages = device_perm[:num_pages], device_perm[max_pages:][:num_pages]
        host_pages = host_perm[:num_pages]
        ids = prompt[:num_tokens]

        recompute_s = _median_s(
            lambda: model.forward(ids, src_pages, 0, device_pool, last_only=True),  # noqa: B023
            args.repeats, device,
        )
        backup = engine.backup(src_pages, host_pages)
        backup.wait()
        if backup.error is not None:
            raise RuntimeError(f"backup of {num_pages} pages failed") from backup.error

        def reload(host_pages=host_pages, dst_pages=dst_pages) -> None:
            handle = engine.load(host_pages, dst_pages)
            handle.wait()
            if handle.error is not None:
                raise RuntimeError(f"load of {len(dst_pages)} pages failed") from handle.error

        copy_src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        copy_dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # Interleaved, so that machine noise hits the reload and its limit alike. On the
        # CPU both run on one thread: the thread executor copies on one worker, and a
        # 2-thread copy_ on 2 cores stalls at its OpenMP barrier whenever another
        # process holds a core (medians 20-40x off), while one thread alone already
        # reaches the DRAM bandwidth.
        num_threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)
        try:
            reload_s, copy_s = _interleaved_median_s(
                reload, lambda: copy_dst.copy_(copy_src), args.reload_repeats, device  # noqa: B023
            )
        finally:
            torch.set_num_threads(num_threads)
        engine.poll()
        for layer in range(cfg.num_layers):
            for buf in device_pool.layer(layer):
                assert torch.equal(buf[src_pages], buf[dst_pages]), (
                    f"reloaded KV differs from the recomputed KV at layer {layer}"
                )
        copy_gbps = nbytes / copy_s / 1e9
        row = {
            "tokens": num_tokens,
            "recompute_ms": recompute_s * 1e3,
            "reload_ms": reload_s * 1e3,
            "ratio": recompute_s / reload_s,
            "nbytes": nbytes,
            "copy_ms": copy_s * 1e3,
            "reload_gbps": nbytes / reload_s / 1e9,
            "copy_gbps": copy_gbps,
            "fraction": copy_s / reload_s,
        }
        rows.append(row)
        log(f"{num_tokens:>7} {row['recompute_ms']:>13.2f} {row['reload_ms']:>10.3f} "
            f"{row['ratio']:>8.1f} {row['copy_ms']:>9.3f} {row['reload_gbps']:>12.2f} "
            f"{row['copy_gbps']:>10.2f} {row['fraction']:>9.0%}")
    engine.close()

    estimate = _estimates(token_counts)
    log("")
    log(estimate["label"])
    log(f"{'model':<12} {'gpu':<9} {'tokens':>7} {'recompute_ms':>13} {'reload_ms':>10} "
        f"{'ratio':>6}")
    for e in estimate["rows"]:
        log(f"{e['model']:<12} {e['gpu']:<9} {e['tokens']:>7} {e['recompute_ms']:>13.2f} "
            f"{e['reload_ms']:>10.3f} {e['ratio']:>6.1f}")
    return {
        "preset": cfg.name,
        "dtype": str(cfg.torch_dtype).removeprefix("torch."),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "executor": engine.executor_name,
        "host_pinned": host_pool.pinned,  # a reload from pageable memory is not the link's
        "page_size": page_size,
        "torch_threads": torch.get_num_threads(),
        # Other processes on the machine skew CPU timings; record how busy it was.
        "load_avg_1m": psutil.getloadavg()[0],
        "kv_bytes_per_token": kv_bytes_per_token(cfg),
        # Largest prefix's contiguous copy: the bandwidth a reload is held against.
        "copy_limit_gbps": copy_gbps,
        "rows": rows,
        "estimate": estimate,
    }


def run(args: argparse.Namespace) -> int:
    _parse_tokens(args.tokens, args.page_size)  # checked before the model is built
    if args.dtype is not None:
        with user_input("--dtype"):
            resolve_dtype(args.dtype)
    torch.manual_seed(args.seed)
    result = measure(args, log=(lambda _line: None) if args.json else print)
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
