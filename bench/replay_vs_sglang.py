"""hicache replay against SGLang's Python RadixCache, same trace, same run.

The regime: bookkeeping only (no KV), the shared replay semantics (match, lock,
evict to fit, insert, unlock) with a page allocator, one request at a time.
Each system replays the same parsed trace ``--repeats`` times, interleaved
(sglang, hicache-python, hicache-native, sglang, ...) so that load on a shared
machine hits them alike; medians are quoted. Only cache and allocator calls are
timed; each system gets the trace in the form it wants (SGLang: lists of ints,
hicache: int32 arrays), converted beforehand.

Needs SGLang installed into .bench-deps (see bench/README.md), except with
``--without-sglang`` (hicache's trees only: the native / Python tree figure).

    .venv/bin/python bench/replay_vs_sglang.py TRACE --page-size 16 --device-tokens 500000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_baseline  # noqa: E402

from hicache.sim.replay import prepare_requests, replay_device  # noqa: E402
from hicache.tree import make_tree  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-tokens", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deps-dir", default=sglang_baseline._DEFAULT_DEPS_DIR)
    parser.add_argument("--trees", default="python,native", help="hicache tree kinds to run")
    parser.add_argument("--without-sglang", action="store_true",
                        help="run hicache's trees only (speedups then against the first tree)")
    args = parser.parse_args(argv)

    hc_requests = prepare_requests(args.trace, args.page_size)
    kinds = [k for k in args.trees.split(",") if k]

    def run_hicache(kind):
        tree = make_tree(kind, args.page_size, "lru")
        r = replay_device(hc_requests, args.page_size, args.device_tokens, tree=tree)
        return r.req_per_s, r.hit_ratio

    systems = {}
    if not args.without_sglang:
        sgl = sglang_baseline.import_sglang(args.deps_dir)
        sgl_requests = sglang_baseline.prepare(args.trace, args.page_size)

        def run_sglang():
            r = sglang_baseline.replay(sgl, sgl_requests, args.page_size, args.device_tokens, "lru")
            return r.req_per_s, r.hit_ratio

        systems["sglang-0.5.23"] = run_sglang
    for kind in kinds:
        systems[f"hicache-{kind}"] = lambda kind=kind: run_hicache(kind)
    for fn in systems.values():  # warm-up: imports, JIT build, allocator first touch
        fn()
    samples: dict[str, list[float]] = {name: [] for name in systems}
    hit: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, fn in systems.items():
            rps, hit[name] = fn()
            samples[name].append(rps)

    base_name = next(iter(systems))
    base = statistics.median(samples[base_name])
    label = "x sglang" if base_name.startswith("sglang") else f"x {kinds[0]}"
    print(f"{'system':<16}{'median req/s':>14}{'min':>9}{'max':>9}{label:>10}{'hit ratio':>11}")
    rows = {}
    for name, xs in samples.items():
        med = statistics.median(xs)
        rows[name] = {"req_per_s": round(med, 1), "speedup": round(med / base, 2),
                      "hit_ratio": round(hit[name], 6)}
        print(f"{name:<16}{med:>14.0f}{min(xs):>9.0f}{max(xs):>9.0f}{med / base:>10.2f}"
              f"{hit[name]:>11.4f}")
    out = {"trace": os.path.basename(args.trace), "page_size": args.page_size,
           "device_tokens": args.device_tokens, "repeats": args.repeats, "systems": rows}
    if {"hicache-python", "hicache-native"} <= samples.keys():
        # Issue 8's figure: native vs Python tree, same run. Per-round ratios pair
        # runs that sat side by side, so slow drifts in machine load cancel out.
        py, nat = samples["hicache-python"], samples["hicache-native"]
        out["native_vs_python"] = round(statistics.median(nat) / statistics.median(py), 2)
        out["native_vs_python_per_round"] = round(
            statistics.median(b / a for a, b in zip(py, nat, strict=True)), 2
        )
        print(f"native / python tree: {out['native_vs_python']:.2f}x (ratio of medians), "
              f"{out['native_vs_python_per_round']:.2f}x (median of per-round ratios)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
