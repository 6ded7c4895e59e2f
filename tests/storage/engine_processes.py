"""Reference engines in fresh processes (tests/storage only): the second process must
find in the third tier what the first one stored.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

ENGINE_PAGE_SIZE = 16
ENGINE_MAX_NEW_TOKENS = 6

# One engine in a fresh process: generates for each prompt, prints one JSON line.
ENGINE_WORKER_SCRIPT = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from hicache.sim.engine import Engine
from hicache.sim.model import Model, preset

args = json.loads(sys.argv[1])
model = Model(preset("tiny"), seed=args["seed"])
engine = Engine(
    model, "hierarchical", args["device_tokens"], args["host_tokens"], page_size=16,
    storage=args["storage"], prefetch_policy=args["prefetch_policy"],
    storage_options=args.get("storage_options"),
)
if args.get("announce"):  # the requests arrived before the first one is scheduled
    for prompt in args["prompts"]:
        engine.prefetch(prompt)
    engine.drain()
out = []
for prompt in args["prompts"]:
    r = engine.generate(prompt, args["max_new_tokens"])
    engine.check_integrity()
    out.append({"tokens": r.tokens, "device_hit_tokens": r.device_hit_tokens,
                "host_hit_tokens": r.host_hit_tokens, "computed_tokens": r.computed_tokens})
start = time.perf_counter()
engine.close()  # waits for backups and storage writes: the next process sees them
close_s = time.perf_counter() - start
stats = engine.stats()
print(json.dumps({"results": out, "stats": stats, "close_s": close_s}))
"""


def run_engine_process(
    storage: str,
    prompts: list[list[int]],
    *,
    prefetch_policy: str = "best_effort",
    announce: bool = False,
    device_tokens: int = 512,
    host_tokens: int = 1024,
    storage_options: dict | None = None,
    timeout_s: float = 60.0,
) -> dict:
    """Run ``ENGINE_WORKER_SCRIPT`` in a fresh interpreter; return its JSON report."""
    args = {
        "seed": 0, "storage": storage, "prompts": prompts, "prefetch_policy": prefetch_policy,
        "announce": announce, "device_tokens": device_tokens, "host_tokens": host_tokens,
        "max_new_tokens": ENGINE_MAX_NEW_TOKENS, "storage_options": storage_options,
    }
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_WORKER_SCRIPT, json.dumps(args)],
        capture_output=True, text=True, timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shared_prompts(seed: int = 0) -> list[list[int]]:
    """Two prompts over one 160-token system prompt (so they share a prefix)."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(160)]
    return [system + [rng.randrange(32000) for _ in range(40 + 8 * i)] for i in range(2)]


def no_cache_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of each prompt without any cache."""
    from hicache.sim.engine import Engine

    with Engine(model, "none", 512, page_size=ENGINE_PAGE_SIZE) as engine:
        return [engine.generate(p, ENGINE_MAX_NEW_TOKENS).tokens for p in prompts]


def assert_second_process_reuses_first(
    first: dict, second: dict, reference: list[list[int]], prompts: list[list[int]]
) -> None:
    """B hit storage for the prompts only A saw, and all three runs generated alike."""
    assert first["stats"]["storage_write_bytes"] > 0 and first["stats"]["storage_errors"] == 0
    assert first["results"][0]["computed_tokens"] == len(prompts[0]), "the store was not empty"
    s = second["stats"]
    assert s["storage_hit_tokens"] > 0 and s["storage_errors"] == 0
    assert s["host_hit_tokens"] > 0
    b = second["results"]
    # B's device and host tiers started empty: its hits of the first prompt came from storage.
    assert b[0]["device_hit_tokens"] == 0
    assert b[0]["host_hit_tokens"] == (len(prompts[0]) - 1) // ENGINE_PAGE_SIZE * ENGINE_PAGE_SIZE
    assert [r["tokens"] for r in b] == [r["tokens"] for r in first["results"]] == reference
