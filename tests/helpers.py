"""What the test modules share: KV layouts, cache factories, one request through a cache,
quiescence checks, and the plumbing of the tests that run engines or vLLM in processes.

Importable from every folder (``from helpers import ...``): pytest puts this directory on
``sys.path`` for ``tests/conftest.py``. Fixtures live in ``conftest.py``; test modules
import from here, never from each other.

Three ways to serve a request, by how much of the KV they touch:

* :func:`serve`: bookkeeping only (pages and the tree; no KV written or read);
* :func:`serve_kv`: KV given by :func:`expected_kv`, read back bitwise; loads waited for
  with ``h.wait()`` (executors that copy on their own);
* :func:`serve_manual`: the manual executor; this request's loads completed here, KV
  written and verified with :mod:`hicache.sim.kvcheck`, integrity checked.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.cache import HiCache, PrefixHandle
from hicache.config import CacheConfig, KVConfig
from hicache.sim import kvcheck
from hicache.transfer import TransferKind
from hicache.tree import IOStatus
from hicache.tree.native import native_available

TREE_KINDS = ["python"] + (["native"] if native_available() else [])

P = 2  # tokens per page
# float32, 2 layers, 1 head of 4: small enough to write each token's KV by formula.
KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=P)
# float16, 2 heads: the layout of the manual-executor scenarios (kvcheck's patterns).
KV_F16 = KVConfig(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", page_size=P)
# One layer, one head of 2: bookkeeping scenarios, where the KV's size does not matter.
KV_TINY = KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=P)


# ------------------------------------------------------------------ integrity


def assert_no_leaks(cache: HiCache) -> None:
    """At quiescence: invariants hold, nothing in flight or held, every page accounted for."""
    cache.check_integrity()
    P = cache.page_size
    s = cache.stats()
    assert s["transfers_in_flight"] == 0 and s["live_requests"] == 0
    assert s["device_pages_used"] == s["device_cached_tokens"] // P, "device pages leaked"
    assert s["host_pages_used"] == s["host_cached_tokens"] // P, "host pages leaked"
    for node in cache.tree.nodes():
        assert node.lock_ref == 0 and node.host_lock_ref == 0, f"lock leaked on {node}"
        assert node.io_status is IOStatus.NONE, f"IO left in flight on {node}"
    assert cache.tree.device_protected_tokens == 0 and cache.tree.host_protected_tokens == 0


def pages(*ids: int) -> torch.Tensor:
    """Page ids as the int64 tensor the tree and the pools take."""
    return torch.tensor(ids, dtype=torch.int64)


def seq(first: int, num_pages: int) -> list[int]:
    """``num_pages`` whole pages of distinct tokens ``first, first + 1, ...``."""
    return list(range(first, first + num_pages * P))


# ------------------------------------------------------- bookkeeping requests


def bookkeeping(tree: str, lifecycle: str = "auto", *, kv: KVConfig = KV_TINY,
                device_tokens: int = 16, host_tokens: int | None = 32, **kw) -> HiCache:
    """A cache without KV tensors (``allocate_kv=False``): tree, allocators and lifecycle.

    ``host_tokens=None``: no host tier. A lifecycle other than ``auto`` must be the one
    the cache runs (a parametrized test would otherwise test the other one silently).
    """
    cfg = CacheConfig(kv, device_tokens=device_tokens, host_tokens=host_tokens,
                      allocate_kv=False, tree=tree, lifecycle=lifecycle, **kw)
    cache = HiCache(cfg)
    assert lifecycle == "auto" or cache.lifecycle == lifecycle
    return cache


def serve(cache: HiCache, tokens, ns: str | None = None, *, finish_loads: bool = False,
          may_refuse: bool = False, skip_cached: bool = False) -> bool:
    """One request's bookkeeping: match, allocate past the prefix, insert, release.

    No KV is written or checked. ``finish_loads``: wait for the prefix's loads (and poll)
    before allocating; with KV a load must land before the insert. ``may_refuse``: a
    refused allocation skips the insert and returns False instead of failing.
    ``skip_cached``: a full hit allocates and inserts nothing (an insert would run the
    write policy again). Returns whether the request was cached.
    """
    h = cache.match(tokens, ns)
    if finish_loads:
        assert cache.finish_loads(h)
    num_new = len(tokens) - h.prefix_len
    ok = True
    if num_new or not skip_cached:
        ok = cache.alloc(h, num_new) is not None
        assert ok or may_refuse, f"alloc of {num_new} tokens refused"
        if ok:
            cache.insert(h, tokens)
    cache.release(h)
    return ok


# --------------------------------------------------- KV by formula, read back


def expected_kv(tokens: list[int], layer: int) -> torch.Tensor:
    """K of each position under :data:`KV`: a function of the token, its position and the
    layer; V is ``-K``."""
    pos = torch.arange(len(tokens), dtype=torch.float32)
    tok = torch.tensor(tokens, dtype=torch.float32)
    base = tok * 1000 + pos * 10 + layer * 1_000_000
    return base[:, None, None] + torch.arange(4, dtype=torch.float32)[None, None, :]


def compute(cache: HiCache, h: PrefixHandle, tokens: list[int]) -> None:
    """Play the model: allocate pages past the prefix and write the KV of those tokens."""
    start = h.prefix_len
    pages = cache.alloc(h, len(tokens) - start)
    assert pages is not None
    table = h.page_table()
    for layer in range(KV.num_layers):
        k = expected_kv(tokens, layer)
        # whole pages from the first computed page on (start is page-aligned)
        first, n_pages = start // P, -(-len(tokens) // P) - start // P
        rows = torch.zeros(n_pages * P, 1, 4)
        rows[: len(tokens) - start] = k[start:]
        cache.device_pool.write_pages(layer, table[first : first + n_pages], rows, -rows)


def read_prefix(cache: HiCache, h: PrefixHandle, tokens: list[int]) -> None:
    """Assert the device pages of h's prefix hold exactly the KV of ``tokens``."""
    table = h.page_table()[: h.prefix_len // P]
    for layer in range(KV.num_layers):
        h.wait_layer(layer)
        k, v = cache.device_pool.read_pages(layer, table)
        want = expected_kv(tokens[: h.prefix_len], layer)
        assert torch.equal(k, want), f"layer {layer}: K differs"
        assert torch.equal(v, -want), f"layer {layer}: V differs"


def serve_kv(cache: HiCache, tokens: list[int], namespace=None) -> PrefixHandle:
    """One request with KV: wait for the prefix, check it bitwise, compute the rest, insert."""
    h = cache.match(tokens, namespace)
    h.wait()
    read_prefix(cache, h, tokens)
    compute(cache, h, tokens)
    cache.insert(h, tokens)
    cache.release(h)
    return h


def finish_transfers(cache: HiCache) -> None:
    """Complete what a manual executor holds, then wait for every transfer."""
    if cache.transfers.executor_name == "manual":
        for t in cache.transfers.executor.pending():
            cache.transfers.executor.complete(t)
    cache.wait_all()


def assert_quiescent(cache: HiCache) -> None:
    finish_transfers(cache)
    assert_no_leaks(cache)


# ------------------------------------------- the manual executor, kvcheck's KV


def make_cache(device_pages: int = 8, host_pages: int = 16, policy: str = "write_through",
               executor: str = "manual", **kw) -> HiCache:
    """A :data:`KV_F16` cache on the manual executor: a copy runs only when a test says so.

    (``executor``: another one, for the race scenarios run on real threads or streams.)"""
    cfg = CacheConfig(
        KV_F16, device_tokens=device_pages * P, host_tokens=host_pages * P, executor=executor,
        host_reserve_nbytes=0, write_policy=policy, **kw,
    )
    return HiCache(cfg)


def pending(cache: HiCache, kind: TransferKind | None = None):
    return [t for t in cache.transfers.executor.pending() if kind is None or t.kind is kind]


def complete(cache: HiCache, kind: TransferKind | None = None) -> None:
    """Finish every pending transfer of ``kind`` (all kinds: None), then apply them."""
    for t in pending(cache, kind):
        assert cache.transfers.executor.complete(t), f"{t} is waiting on a fence"
    cache.poll()


def verify_prefix(cache: HiCache, h, tokens, ns=None) -> None:
    assert kvcheck.verify_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, ns) == []


def serve_manual(cache: HiCache, tokens, ns=None, *, complete_loads: bool = True):
    """One whole request: match, load (completed here), verify, compute the rest, insert."""
    before = pending(cache, TransferKind.LOAD)
    h = cache.match(tokens, ns)
    if complete_loads:  # only the loads this match started
        for load in pending(cache, TransferKind.LOAD):
            if load not in before:
                cache.transfers.executor.complete(load)
    assert cache.finish_loads(h), h.load_error
    verify_prefix(cache, h, tokens, ns)
    rest = len(tokens) - h.prefix_len
    assert cache.alloc(h, rest) is not None
    kvcheck.write_kv(cache.device_pool, h.page_table(), tokens, h.prefix_len, len(tokens), ns)
    cache.insert(h, tokens)
    verify_prefix(cache, h, tokens, ns)
    cache.release(h)
    cache.check_integrity()


def evict_all_device(cache: HiCache) -> None:
    """Push every unlocked node off the device through the public API.

    Backups in flight (write-through, or write-back evictions) are completed first
    when they hold pages back.
    """
    for _ in range(2):
        h = cache.match([])
        pages = cache.alloc(h, cache.config.num_device_pages * P)
        cache.release(h)
        if pages is not None:
            return
        complete(cache, TransferKind.BACKUP)
    raise AssertionError("could not free the whole device")


def settle(cache: HiCache) -> None:
    """Drive to quiescence and check everything: integrity, KV, zero leaked pages."""
    while pending(cache):
        complete(cache)
    assert_no_leaks(cache)
    assert kvcheck.verify_cache(cache) == []


def host_only(cache: HiCache, tokens, ns=None) -> None:
    """Cache ``tokens`` on both tiers, then push them off the device."""
    serve_manual(cache, tokens, ns)
    complete(cache, TransferKind.BACKUP)
    evict_all_device(cache)
    m = cache.tree.match_prefix(tokens, ns)
    assert (m.device_len, m.host_len) == (0, len(tokens) // P * P)


# ------------------------------------------------- two trees, one observation


FORMS = ("list", "np32", "np64", "t32", "t64")


def as_form(tokens: list[int], form: str):
    """``tokens`` as one of the :data:`FORMS` the public API accepts."""
    if form == "np32":
        return np.array(tokens, dtype=np.int32)
    if form == "np64":
        return np.array(tokens, dtype=np.int64)
    if form == "t32":
        return torch.tensor(tokens, dtype=torch.int32)
    if form == "t64":
        return torch.tensor(tokens, dtype=torch.int64)
    return list(tokens)


def snapshot(tree) -> list[tuple]:
    """Everything observable about every node, in nodes() order."""
    out = []
    for n in tree.nodes():
        dev = n.device_indices
        host = n.host_indices
        out.append(
            (
                n.id,
                n.parent.id,
                n.namespace,
                n.key,
                n.num_tokens,
                None if dev is None else dev.tolist(),
                None if host is None else host.tolist(),
                n.lock_ref,
                n.host_lock_ref,
                n.io_status,
                n.hit_count,
                n.last_access,
                n.created,
                n.priority,
                n.on_device,
                n.on_host,
                sorted(n.children),
            )
        )
    return out


# ------------------------------------------ reference engines in fresh processes


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


# ---------------------------------------------------- vLLM in fresh processes


VLLM_DRIVER = Path(__file__).parent / "integrations" / "vllm_driver.py"
VLLM_REQUIRED = os.environ.get("HICACHE_REQUIRE_VLLM") == "1"


def vllm_available() -> bool:
    """Whether vLLM imports; with ``HICACHE_REQUIRE_VLLM=1`` a failed import raises."""
    try:
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        if VLLM_REQUIRED:
            raise
        return False
    return True


def run_vllm(*args: str, **env_vars: str) -> subprocess.Popen:
    """Start ``tests/integrations/vllm_driver.py ARGS`` (stdout and stderr in one pipe),
    with ``env_vars`` added to its environment."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", **env_vars)
    return subprocess.Popen(
        [sys.executable, str(VLLM_DRIVER), *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env,
    )


def vllm_result(proc: subprocess.Popen, timeout: int = 900) -> dict:
    """The driver's last JSON line, after it exited 0; its whole output under ``"log"``."""
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"vLLM driver failed:\n{out[-6000:]}"
    return {**json.loads(lines[-1]), "log": out}


def host_takeable_by_definition(tree) -> int:
    """Host tokens host eviction can take, recomputed from the nodes alone.

    Host eviction takes a host copy once no child has one (and it is not host-locked
    and has no IO in flight). So a host copy can be taken, leaf by leaf, unless a
    host-locked copy or one with IO in flight sits in the chain of host copies below it.
    """
    def held(node) -> bool:
        if node.host_indices is None:
            return False
        if node.host_lock_ref or node.io_status is not IOStatus.NONE:
            return True
        return any(held(c) for c in node.children.values())

    return sum(n.num_tokens for n in tree.nodes() if n.host_indices is not None and not held(n))


# ------------------------------------------------------------------------ CUDA


CUDA_AVAILABLE = torch.cuda.is_available()
# Parametrize a test over the devices its tensors live on: "cpu" always runs; "cuda" is
# marked `cuda` (bench/gpu_suite.sh selects those) and skips without a GPU.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not CUDA_AVAILABLE, reason="needs a CUDA device")]),
]


def stall_stream(stream, seconds: float) -> None:
    """Queue at least ``seconds`` of spinning on a CUDA ``stream``: what is queued after
    it waits.

    Holds a copy in flight on purpose (a CUDA stream has no "pause"). The spin counts
    GPU clock cycles; they are converted at the faster of the measured clock and 2 GHz,
    so a clock still ramping up from idle makes the spin longer, never shorter. Callers
    assert what must still be in flight rather than trust the duration.
    """
    cycles = int(seconds * _cycles_per_s(stream.device))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


_CYCLES_PER_S: dict = {}


def _cycles_per_s(device) -> float:
    if device not in _CYCLES_PER_S:
        cycles = 50_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            torch.cuda._sleep(cycles)  # warm-up: clocks ramp up from idle
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
        measured = cycles / (start.elapsed_time(end) / 1e3)
        _CYCLES_PER_S[device] = max(measured, 2.0e9)
    return _CYCLES_PER_S[device]
