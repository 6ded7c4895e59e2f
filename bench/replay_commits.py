"""Replay speed of two checkouts of hicache, interleaved: is a change within N% of before?

Regime: the bookkeeping-only replay of a trace (no KV), native tree, in two
configurations: device-only (``hicache replay`` without a host tier: tree and
allocator) and hierarchical (HiCache with a host tier, C++ lifecycle). One
process per checkout and round, alternating base / new, so machine load hits
both alike; each process replays ``--repeats`` times per configuration.

On a shared machine wall-clock req/s swings 2x between rounds, so every replay
is also timed by the process's own CPU time (``time.process_time``), which
other processes' load disturbs far less. The table gives medians over all
replays; the last stdout line is one JSON object.

    git worktree add /tmp/hicache-base <commit>
    .venv/bin/python bench/replay_commits.py /tmp/foundation.jsonl --base /tmp/hicache-base

The base checkout needs no install: it runs with this interpreter and its own
sources first on ``PYTHONPATH`` (its C++ extension is built on first use). It may
predate the subpackages (``hicache.replay``, ``hicache.native``): the child imports
either layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside each checkout's process: K interleaved repeats of both configurations.
_CHILD = r"""
import json, sys, time
try:
    from hicache.sim import replay as _replay
    try:
        from hicache.tree import make_tree
    except ImportError:  # before hicache.tree exported it
        from hicache.tree.native import make_tree
except ImportError:  # a checkout from before the subpackages: flat modules
    from hicache import replay as _replay
    from hicache.native import make_tree
# prepare_requests was _prepare before the harness left the library
prepare_requests = getattr(_replay, "prepare_requests", None) or _replay._prepare
replay_device, replay_hierarchical = _replay.replay_device, _replay.replay_hierarchical

trace, P, device, host, K = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
requests = prepare_requests(trace, P)
replay_device(requests, P, device, tree=make_tree("native", P, "lru"))  # warm-up
out = {"device": [], "hierarchical": []}
for _ in range(K):
    for name in out:
        c0 = time.process_time()
        if name == "device":
            r = replay_device(requests, P, device, tree=make_tree("native", P, "lru"))
        else:
            r = replay_hierarchical(requests, P, device, host, tree="native")
        cpu = time.process_time() - c0
        out[name].append([r.req_per_s, len(requests) / cpu, r.hit_ratio])
print(json.dumps(out))
"""


def run_child(src: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    argv = [sys.executable, "-c", _CHILD, str(Path(args.trace).resolve()), str(args.page_size), str(args.device_tokens),
            str(args.host_tokens), str(args.repeats)]
    done = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--base", type=Path, required=True, help="checkout of the commit before")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1],
                        help="checkout of the change (default: this one)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-tokens", type=int, default=147_840, help="25%% of foundation")
    parser.add_argument("--host-tokens", type=int, default=592_384)
    parser.add_argument("--repeats", type=int, default=5, help="replays per config and process")
    parser.add_argument("--rounds", type=int, default=5, help="processes per checkout")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for _ in range(args.rounds):
        for label, src in (("base", args.base), ("new", args.new)):
            runs[label].append(run_child(src.resolve(), args))
    summary = {}
    print(f"{'config':<14}{'clock':<6}{'base req/s':>12}{'new req/s':>12}{'new/base':>10}")
    for config in ("device", "hierarchical"):
        hits = {label: {x[2] for r in rs for x in r[config]} for label, rs in runs.items()}
        if hits["base"] != hits["new"]:
            raise SystemExit(f"{config}: hit ratios differ: {hits}")
        for idx, clock in ((0, "wall"), (1, "cpu")):
            med = {label: statistics.median(x[idx] for r in rs for x in r[config])
                   for label, rs in runs.items()}
            ratio = med["new"] / med["base"]
            summary[f"{config}_{clock}"] = {"base": round(med["base"], 1),
                                            "new": round(med["new"], 1), "ratio": round(ratio, 3)}
            print(f"{config:<14}{clock:<6}{med['base']:>12.0f}{med['new']:>12.0f}{ratio:>10.3f}")
    summary["replays_per_config"] = args.repeats * args.rounds
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
