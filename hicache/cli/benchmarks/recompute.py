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

A hybrid preset (``tiny-hybrid``, ``small-hybrid``) recomputes its window and linear
layers too (window pages for every page, the state and its checkpoint at the prefix's
end), and a reload moves what a host hit needs: the full pages, each window
component's tail (its last ``ceil((W-1)/page_size)`` pages) and the checkpoint.
``nbytes`` is what a reload moves, ``dense_nbytes`` what storing every window page
would (equal for single-kind models; the table shows both in MB for a hybrid preset).

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
from typing import NamedTuple

import psutil
import torch

from hicache.cache.request_components import StatePages
from hicache.cli import args as cliargs
from hicache.cli.args import UsageError, add_json, nonneg_int, positive_int, user_input
from hicache.cli.benchmarks import standalone_main
from hicache.components import describe_components
from hicache.config import KVConfig, resolve_dtype
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


class _Prefix(NamedTuple):
    """One prefix's device pages: what the forward computes into, what a hit reloads."""

    full: torch.Tensor  # the full-attention pages (the forward's page table)
    components: list[torch.Tensor | StatePages]  # hybrid: the forward's components
    kept: torch.Tensor  # the pages a host hit reloads (every page for single-kind)
    dense: int  # pages if every window page were kept


def _device_pages(kv: KVConfig, num_pages: int) -> int:
    """Device pages one prefix of ``num_pages`` pages computes into."""
    return num_pages + sum(s.width * (num_pages if s.is_window else 2)
                           for s in kv.component_specs)


def _prefix(kv: KVConfig, ids: torch.Tensor, num_pages: int) -> _Prefix:
    """Split ``ids`` (:func:`_device_pages` of them) into a prefix's pages."""
    full = ids[:num_pages]
    kept, dense, off = [full], num_pages, num_pages
    comps: list[torch.Tensor | StatePages] = []
    for spec in kv.component_specs:
        if spec.is_window:
            table = ids[off : off + spec.width * num_pages].view(num_pages, spec.width)
            off += spec.width * num_pages
            tail = min(spec.window_pages(kv.page_size), num_pages)
            comps.append(table)
            kept.append(table[num_pages - tail :].reshape(-1))
            dense += spec.width * num_pages
        else:
            state, checkpoint = ids[off : off + spec.width], ids[off + spec.width :][: spec.width]
            off += 2 * spec.width
            comps.append(StatePages(None, state, {num_pages * kv.page_size: checkpoint}))
            kept.append(checkpoint)
            dense += spec.width
    return _Prefix(full, comps, torch.cat(kept), dense)


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
    max_pages = _device_pages(kv, max(token_counts) // page_size)
    gen = torch.Generator().manual_seed(args.seed)

    model = Model(cfg, device=args.device, seed=args.seed)
    device_pool = DevicePool(kv, 2 * max_pages, device=args.device)
    host_pool = HostPool(kv, max_pages)
    engine = TransferEngine(device_pool, host_pool, executor=args.executor)
    # Scattered ids on both tiers: a real allocator never hands out one contiguous run.
    device_perm = torch.randperm(2 * max_pages, generator=gen)
    host_perm = torch.randperm(max_pages, generator=gen)
    components = (f", components {describe_components(kv.component_specs)}"
                  if kv.component_specs else "")
    prompt = torch.randint(0, cfg.vocab_size, (max(token_counts),), generator=gen)

    log(f"preset {cfg.name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.torch_dtype}), page size {page_size}, KV {kv.token_nbytes} bytes/token"
        f"{components}, "
        f"device {device}, executor {args.executor}, {torch.get_num_threads()} threads, "
        f"load average {psutil.getloadavg()[0]:.1f}")
    header = (f"{'tokens':>7} {'recompute_ms':>13} {'reload_ms':>10} {'ratio':>8} "
              f"{'copy_ms':>9} {'reload_GB/s':>12} {'copy_GB/s':>10} {'fraction':>9}"
              + (f" {'reload_MB':>10} {'dense_MB':>9}" if components else ""))
    log(header)
    rows, copy_gbps = [], 0.0
    for num_tokens in token_counts:
        num_pages = num_tokens // page_size
        prefix = _prefix(kv, device_perm[: _device_pages(kv, num_pages)], num_pages)
        src_pages = prefix.kept
        dst_pages = device_perm[max_pages:][: len(src_pages)]
        host_pages = host_perm[: len(src_pages)]
        nbytes = len(src_pages) * kv.page_nbytes
        ids = prompt[:num_tokens]

        recompute_s = _median_s(
            lambda: model.forward(ids, prefix.full, 0, device_pool, last_only=True,  # noqa: B023
                                  components=prefix.components or None),  # noqa: B023
            args.repeats, device,
        )
        backup = engine.backup(src_pages, host_pages)
        backup.wait()
        if backup.error is not None:
            raise RuntimeError(f"backup of {len(src_pages)} pages failed") from backup.error

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
        for layer in range(kv.num_layers):
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
            "dense_nbytes": prefix.dense * kv.page_nbytes,
            "copy_ms": copy_s * 1e3,
            "reload_gbps": nbytes / reload_s / 1e9,
            "copy_gbps": copy_gbps,
            "fraction": copy_s / reload_s,
        }
        rows.append(row)
        log(f"{num_tokens:>7} {row['recompute_ms']:>13.2f} {row['reload_ms']:>10.3f} "
            f"{row['ratio']:>8.1f} {row['copy_ms']:>9.3f} {row['reload_gbps']:>12.2f} "
            f"{row['copy_gbps']:>10.2f} {row['fraction']:>9.0%}"
            + (f" {nbytes / 1e6:>10.2f} {row['dense_nbytes'] / 1e6:>9.2f}" if components else ""))
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
    with user_input("--page-size"):  # a hybrid model's state must fit a page
        preset(args.preset).kv_config(args.page_size)
    torch.manual_seed(args.seed)
    result = measure(args, log=(lambda _line: None) if args.json else print)
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    sys.exit(main())
