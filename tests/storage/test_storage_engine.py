"""Engine over the file storage tier: two processes share a prefix; outputs stay exact.

The two-process tests run each engine in a fresh interpreter
(``engine_processes.ENGINE_WORKER_SCRIPT``):
process A generates and exits after ``Engine.close`` flushed its storage writes;
process B starts with an empty device and host tier, so every prefix hit it gets
came from storage. Greedy tokens are compared exactly with A's and with a no-cache
run in this process (same preset and seed: same weights).
"""

from __future__ import annotations

import json
import random
import time

import pytest
from engine_processes import ENGINE_MAX_NEW_TOKENS as MAX_NEW_TOKENS
from engine_processes import ENGINE_PAGE_SIZE as PAGE_SIZE
from engine_processes import (
    assert_second_process_reuses_first,
    no_cache_tokens,
    run_engine_process,
    shared_prompts,
)
from kv_layouts import KV
from leak_checks import assert_quiescent
from serving import read_prefix, serve_kv

from hicache.cache import HiCache
from hicache.cli.benchmarks import multiturn
from hicache.config import CacheConfig
from hicache.sim.engine import Engine
from hicache.sim.model import Model, preset

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PROMPTS = shared_prompts()


@pytest.fixture(scope="module")
def first_process(tmp_path_factory) -> tuple[str, dict]:
    """Process A's store (after A exited) and its report."""
    spec = f"file:{tmp_path_factory.mktemp('shared-store')}"
    return spec, run_engine_process(spec, PROMPTS)


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort"])
def test_second_process_gets_storage_hits_for_prompts_only_the_first_saw(
    first_process, model, policy
):
    spec, first = first_process
    # best_effort: the requests are announced on arrival and their pages land before
    # the first is scheduled; wait_complete: each request waits for its own read.
    second = run_engine_process(
        spec, PROMPTS, prefetch_policy=policy, announce=policy == "best_effort"
    )
    assert_second_process_reuses_first(first, second, no_cache_tokens(model, PROMPTS), PROMPTS)


def test_engine_with_storage_and_a_small_host_tier_matches_no_cache(tmp_path, model):
    """Interleaved sessions whose histories outgrow the host tier come back from storage."""
    rng = random.Random(1)
    systems = [[rng.randrange(32000) for _ in range(96)] for _ in range(2)]
    history = {s: list(systems[s % 2]) for s in range(4)}
    prompts = []
    engines = {
        "none": Engine(model, "none", 512, page_size=PAGE_SIZE),
        "storage": Engine(model, "hierarchical", 384, 384, page_size=PAGE_SIZE,
                          storage=f"file:{tmp_path}", prefetch_policy="wait_complete"),
    }
    try:
        for _ in range(3):
            for s in range(4):
                prompt = history[s] + [rng.randrange(32000) for _ in range(24)]
                outs = {name: e.generate(prompt, MAX_NEW_TOKENS) for name, e in engines.items()}
                engines["storage"].check_integrity()
                assert outs["storage"].tokens == outs["none"].tokens, f"session {s}"
                history[s] = prompt + outs["none"].tokens
                prompts.append(prompt)
        engines["storage"].drain()
        engines["storage"].check_integrity()
        stats = engines["storage"].stats()
    finally:
        for e in engines.values():
            e.close()
    assert stats["host_evicted_tokens"] > 0, "workload too small: the host tier never evicted"
    assert stats["storage_hit_tokens"] > 0 and stats["storage_errors"] == 0
    assert stats["loads_failed"] == 0


def test_prefetch_keeps_the_host_only_prefix_it_extends(tmp_path):
    """Regression: making room for fetched pages evicted the cached prefix they extend
    (the oldest host-only leaf), so the read was discarded and the prompt recomputed."""
    x = [1, 1, 2, 2, 3, 3, 4, 4]  # 4 pages of 2 tokens
    y = [7, 7, 8, 8, 9, 9, 5, 5]
    cfg = dict(storage=f"file:{tmp_path}", executor="thread", prefetch_policy="wait_complete",
               model_id="test-model")
    with HiCache(CacheConfig(KV, device_tokens=16, host_tokens=16, **cfg)) as writer:
        serve_kv(writer, x)
    cache = HiCache(CacheConfig(KV, device_tokens=8, host_tokens=12, **cfg))
    serve_kv(cache, x[:4])
    serve_kv(cache, y)  # x[:4] leaves the device; the host tier (6 pages) is now full
    cache.wait_all()
    before = cache.stats()["storage_hit_tokens"]
    h = cache.match(x)
    assert (h.device_len, h.host_len) == (0, 8), "the fetched pages were not used"
    read_prefix(cache, h, x)
    cache.release(h)
    assert cache.stats()["storage_hit_tokens"] - before == 4  # x[4:] came from storage
    assert_quiescent(cache)
    cache.close()


def test_models_with_one_kv_layout_sharing_a_store_never_mix_pages(tmp_path, model):
    """Two models of the same preset (so the same KV layout) with different weights
    share one directory: the second computes everything itself and generates what it
    generates without a cache; the first model's weights, in a new object, hit."""
    other = Model(preset("tiny"), seed=1)
    assert other.kv_config(PAGE_SIZE) == model.kv_config(PAGE_SIZE)
    prompt = PROMPTS[0]
    whole = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
    with Engine(model, "hierarchical", 512, 1024, storage=f"file:{tmp_path}") as a:
        first = a.generate(prompt, MAX_NEW_TOKENS)
    assert a.stats()["storage_write_bytes"] > 0
    with Engine(other, "hierarchical", 512, 1024, storage=f"file:{tmp_path}",
                prefetch_policy="wait_complete") as b:
        r = b.generate(prompt, MAX_NEW_TOKENS)
        b.check_integrity()
    s = b.stats()
    assert (s["storage_prefetches"], s["storage_hit_tokens"], r.host_hit_tokens) == (0, 0, 0)
    assert r.computed_tokens == len(prompt)
    assert r.tokens == no_cache_tokens(other, [prompt])[0]
    assert r.tokens != first.tokens  # the two models really differ
    with Engine(Model(preset("tiny"), seed=0), "hierarchical", 512, 1024,
                storage=f"file:{tmp_path}", prefetch_policy="wait_complete") as c:
        again = c.generate(prompt, MAX_NEW_TOKENS)
        c.check_integrity()
    assert c.stats()["storage_hit_tokens"] == again.host_hit_tokens == whole
    assert again.tokens == first.tokens


def test_engine_prefetch_announces_a_request(tmp_path, model):
    prompt = PROMPTS[0]
    with Engine(model, "hierarchical", 512, 1024, storage=f"file:{tmp_path}") as a:
        a.generate(prompt, MAX_NEW_TOKENS)
    with Engine(model, "hierarchical", 512, 1024, storage=f"file:{tmp_path}") as b:
        assert b.prefetch(prompt) is True
        b.drain()  # the pages arrived before the request is scheduled
        assert b.prefetch(prompt) is False  # nothing left that only storage holds
        r = b.generate(prompt, MAX_NEW_TOKENS)
        b.check_integrity()
    assert r.host_hit_tokens == (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
    with Engine(model, "hierarchical", 512, 1024) as plain:
        assert plain.prefetch(prompt) is False  # no storage tier: nothing to announce


def test_close_flushes_storage_writes(tmp_path, model):
    """Everything computed before close() is in storage afterwards, even when close()
    comes right after the last request (its backups still in flight)."""
    with Engine(model, "hierarchical", 512, 1024, storage=f"file:{tmp_path}") as engine:
        for prompt in PROMPTS:
            engine.generate(prompt, MAX_NEW_TOKENS)
    stats = engine.stats()
    assert stats["storage_writes"] > 0 and stats["storage_errors"] == 0
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    cached_pages = stats["host_cached_tokens"] // PAGE_SIZE
    page_nbytes = model.kv_config(PAGE_SIZE).page_nbytes
    assert stats["storage_write_bytes"] == cached_pages * page_nbytes
    assert len(files) >= cached_pages


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "device", "storage": "file:/tmp/x"}, ValueError, "only the 'hierarchical'"),
        ({"mode": "none", "storage": "file:/tmp/x"}, ValueError, "only the 'hierarchical'"),
        ({"mode": "hierarchical", "storage": "ftp://x"}, ValueError, "storage spec"),
        ({"mode": "hierarchical", "storage": "file:/tmp/x", "prefetch_policy": "eager"},
         ValueError, "prefetch_policy"),
        ({"mode": "hierarchical", "storage": "file:/tmp/x", "storage_options": [1]},
         TypeError, "storage_options: expected dict"),
        ({"mode": "hierarchical", "storage": "file:/tmp/x", "storage_options": {"bogus": 1}},
         ValueError, "bogus"),
    ],
)
def test_bad_storage_arguments(model, kwargs, error, match):
    mode = kwargs.pop("mode")
    with pytest.raises(error, match=match):
        Engine(model, mode, 512, page_size=PAGE_SIZE, **kwargs)


TINY_BENCH = ["--preset", "tiny", "--sessions", "4", "--turns", "3", "--system-prompts", "2",
              "--system-tokens", "128", "--first-turn-tokens", "64", "--json"]


def test_bench_multiturn_third_tier_recovers_what_a_small_host_tier_loses(capsys):
    start = time.monotonic()
    assert multiturn.main([*TINY_BENCH, "--configs",
                           "hierarchical,hierarchical-small-host,hierarchical+storage",
                           "--storage-host-tokens", "256",
                           "--prefetch-policy", "wait_complete"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["storage_host_tokens"] == 256 < result["working_set_tokens"]
    full, small, stored = (result["configs"][n] for n in
                           ("hierarchical", "hierarchical-small-host", "hierarchical+storage"))
    assert small["host_evicted_tokens"] > 0, "the small host tier never evicted"
    assert small["storage_hit_tokens"] == 0 and stored["storage_hit_tokens"] > 0
    assert stored["computed_tokens"] < small["computed_tokens"]
    assert full["computed_tokens"] <= stored["computed_tokens"]
    assert stored["storage_errors"] == 0
    assert time.monotonic() - start < 60


def test_bench_multiturn_rejects_bad_storage_options(capsys):
    # A user's mistake: one line on stderr and exit status 2.
    assert multiturn.main([*TINY_BENCH, "--configs", "hierarchical+storage",
                           "--storage-host-tokens", "3"]) == 2
    assert "--storage-host-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # refused by the parser
        multiturn.main([*TINY_BENCH, "--lookahead", "-1"])
    assert exc.value.code == 2 and "--lookahead" in capsys.readouterr().err
