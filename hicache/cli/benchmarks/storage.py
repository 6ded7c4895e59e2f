"""Third-tier page write and read throughput with and without a storage secret.

Regime: ``--total-mib`` MiB of pages of each ``--page-kib`` size, written with one
``set`` call (fresh keys: every page is written) and read back with one ``get_into``
call into preallocated page buffers, on one thread, as the storage worker threads
do. Each repeat runs both modes (no secret, then a secret; the order alternates
per repeat so that machine noise hits both) on the same backend and the same
bytes; the no-secret rows are the baseline. The cost of the secret is one
HMAC-SHA256 pass over each page written and read, so the authenticator's own
throughput on one core is measured too, beside crc32 (which every value carries
with or without a secret) and a contiguous copy of one page.

Backends: ``file`` (a new private directory under ``--dir``, default the system
temp directory: reads come from the page cache, so this measures the CPU side of
the tier, not the disk) and, with ``--mooncake``, also the Mooncake Store on a
loopback master this run starts (needs the ``mooncake`` extra).

Last stdout line: ``{"rows": [{"backend", "op", "secret", "page_kib", "gbps"}, ...],
"auth_gbps_per_core": A, "crc32_gbps_per_core": C, "copy_gbps": M, ...}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib

import numpy as np
import torch

from hicache.cli.args import UsageError, add_json, positive_int
from hicache.cli.benchmarks import standalone_main
from hicache.storage import FileStorage, PageAuthenticator, StorageBackend, make_storage

_SECRET = "hicache-bench-storage-secret-0123456789abcdef"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    parser.add_argument("--page-kib", type=positive_int, nargs="+", default=[256, 1024, 4096],
                        help="page sizes to measure, KiB per page (one page's all-layer KV)")
    parser.add_argument("--total-mib", type=positive_int, default=256,
                        help="MiB written and read by each timed call")
    parser.add_argument("--repeats", type=positive_int, default=4,
                        help="timed runs per row (median); even counts alternate the order")
    parser.add_argument("--dir", default=None,
                        help="parent of the file store's directory (default: the temp directory)")
    parser.add_argument("--mooncake", action="store_true",
                        help="also measure the Mooncake Store on a loopback master")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _per_core(args: argparse.Namespace) -> dict[str, float]:
    """Single-thread GB/s of the authenticator, crc32 and a copy over one page."""
    page = torch.randint(0, 256, (max(args.page_kib) * 1024,), dtype=torch.uint8).numpy()
    view = page.data
    out = np.empty_like(page)
    auth = PageAuthenticator(_SECRET)
    key = hashlib.blake2b(b"page", digest_size=16).hexdigest()
    cases = {
        "auth_gbps_per_core": lambda: auth.tag(key, view),
        "crc32_gbps_per_core": lambda: zlib.crc32(view),
        "copy_gbps": lambda: np.copyto(out, page),
    }
    reps = max(4, (args.total_mib << 20) // len(view))
    result = {}
    for name, fn in cases.items():
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append(time.perf_counter() - start)
        result[name] = round(_gbps(reps * len(view), statistics.median(times)), 2)
    return result


def _keys(tag: str, num: int) -> list[str]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).hexdigest()
            for i in range(num)]


def _measure(backends: dict[bool, StorageBackend], name: str, page_kib: int,
             args: argparse.Namespace) -> list[dict]:
    page_nbytes = page_kib * 1024
    num_pages = (args.total_mib << 20) // page_nbytes
    if num_pages < 1:
        raise UsageError(f"--total-mib: expected at least one page of {page_kib} KiB, "
                         f"got {args.total_mib} MiB")
    gen = torch.Generator().manual_seed(page_kib)
    pages = torch.randint(0, 256, (num_pages, page_nbytes), dtype=torch.uint8, generator=gen)
    out = torch.empty_like(pages)
    src, dst = list(pages), list(out)
    times: dict[tuple[str, bool], list[float]] = {}
    for rep in range(args.repeats + 1):  # the first round warms up, untimed
        order = [False, True] if rep % 2 else [True, False]
        for secret in order:
            store = backends[secret]
            keys = _keys(f"{name}/{page_kib}/{secret}/{rep}", num_pages)
            start = time.perf_counter()
            stored = store.set(keys, src)
            mid = time.perf_counter()
            got = store.get_into(keys, dst)
            end = time.perf_counter()
            if stored != num_pages or got != num_pages or not torch.equal(out, pages):
                raise RuntimeError(f"{name} store kept {stored} and returned {got} of "
                                   f"{num_pages} pages intact")
            store.delete(keys)
            if rep:
                times.setdefault(("write", secret), []).append(mid - start)
                times.setdefault(("read", secret), []).append(end - mid)
    total = num_pages * page_nbytes
    return [
        {"backend": name, "op": op, "secret": secret, "page_kib": page_kib,
         "gbps": round(_gbps(total, statistics.median(secs)), 3)}
        for (op, secret), secs in sorted(times.items())
    ]


def _file_backends(page_nbytes: int, parent: str | None) -> dict[bool, StorageBackend]:
    root = tempfile.mkdtemp(prefix="hicache-bench-storage-", dir=parent)
    return {secret: make_storage(f"file:{root}", page_nbytes=page_nbytes,
                                 secret=_SECRET if secret else None)
            for secret in (False, True)}


def run(args: argparse.Namespace) -> int:
    if args.dir is not None and not os.path.isdir(args.dir):
        raise UsageError(f"--dir: expected an existing directory, got {args.dir!r}")
    rows: list[dict] = []
    master = None
    if args.mooncake:
        try:
            from hicache.testing.mooncake_master import start_mooncake_master
            master = start_mooncake_master(segment_nbytes=(2 * args.total_mib + 64) << 20)
        except ImportError as e:
            raise UsageError(f"--mooncake: {e}") from None
    try:
        for page_kib in args.page_kib:
            page_nbytes = page_kib * 1024
            all_backends = {"file": _file_backends(page_nbytes, args.dir)}
            if master is not None:
                all_backends["mooncake"] = {
                    secret: make_storage(master.spec, page_nbytes=page_nbytes, segment_nbytes=0,
                                         local_buffer_nbytes=(args.total_mib + 16) << 20,
                                         secret=_SECRET if secret else None)
                    for secret in (False, True)
                }
            for name, backends in all_backends.items():
                try:
                    rows += _measure(backends, name, page_kib, args)
                finally:
                    for store in backends.values():
                        store.close()
                    store = backends[False]
                    if isinstance(store, FileStorage):
                        shutil.rmtree(store.root, ignore_errors=True)
    finally:
        if master is not None:
            master.stop()
    result: dict = {"rows": rows, **_per_core(args), "threads": 1,
                    "total_mib": args.total_mib, "repeats": args.repeats}
    base = {(r["backend"], r["op"], r["page_kib"]): r["gbps"] for r in rows if not r["secret"]}
    lines = [f"{'backend':<9}{'op':<6}{'page_kib':>9}{'no secret':>11}{'secret':>9}"
             f"{'ratio':>7}"]
    for r in rows:
        if r["secret"]:
            b = base[(r["backend"], r["op"], r["page_kib"])]
            r["x_no_secret"] = round(r["gbps"] / b, 2)
            lines.append(f"{r['backend']:<9}{r['op']:<6}{r['page_kib']:>9}{b:>11.2f}"
                         f"{r['gbps']:>9.2f}{r['x_no_secret']:>7.2f}")
    if not args.json:
        print("storage bench (GB/s, median of "
              f"{args.repeats}; one thread): HMAC-SHA256 {result['auth_gbps_per_core']} GB/s per "
              f"core, crc32 {result['crc32_gbps_per_core']}, copy {result['copy_gbps']}")
        print("\n".join(lines))
    print(json.dumps(result))
    return 0


main = standalone_main(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
