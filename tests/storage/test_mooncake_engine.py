"""Engine over Mooncake Store: two processes share a prefix; the store dies mid-run.

A real ``mooncake_master`` runs on loopback with a segment holder
(``start_mooncake_master(segment_nbytes=...)``), so stored pages outlive the
process that wrote them; clients lend no memory (``segment_nbytes=0``).

Skipped when the optional extra is not installed, unless HICACHE_REQUIRE_MOONCAKE=1
(CI sets it after .ci/install_mooncake.sh), in which case a missing package fails.
"""

from __future__ import annotations

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
from optional import need

from hicache.sim.engine import Engine
from hicache.sim.model import Model, preset

need("mooncake")

from hicache.testing.mooncake_master import start_mooncake_master  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    handle = start_mooncake_master(
        segment_nbytes=64 << 20, log_dir=tmp_path_factory.mktemp("mooncake-engine")
    )
    yield handle
    handle.stop()


def test_mooncake_second_process_gets_storage_hits_for_prompts_only_the_first_saw(
    master, model
):
    spec = f"{master.spec}&segment_nbytes=0"  # pages live in the master's segment holder
    prompts = shared_prompts(seed=11)  # tokens no other test stores: keys of their own
    first = run_engine_process(spec, prompts)
    second = run_engine_process(spec, prompts, prefetch_policy="wait_complete")
    assert_second_process_reuses_first(first, second, no_cache_tokens(model, prompts), prompts)


def test_mooncake_models_with_one_kv_layout_never_read_each_others_pages(master, model):
    """Two models of one preset (same KV layout), other weights, one Mooncake Store: the
    second gets no page of the first; a new object with the first's weights gets them."""
    spec = f"{master.spec}&segment_nbytes=0"
    prompt = shared_prompts(seed=12)[0]  # tokens no other test stores
    whole = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
    other = Model(preset("tiny"), seed=1)
    with Engine(model, "hierarchical", 512, 1024, page_size=PAGE_SIZE, storage=spec) as a:
        first = a.generate(prompt, MAX_NEW_TOKENS)
    assert a.stats()["storage_write_bytes"] > 0 and a.stats()["storage_errors"] == 0
    with Engine(other, "hierarchical", 512, 1024, page_size=PAGE_SIZE, storage=spec,
                prefetch_policy="wait_complete") as b:
        r = b.generate(prompt, MAX_NEW_TOKENS)
        b.check_integrity()
    s = b.stats()
    assert (s["storage_prefetches"], s["storage_hit_tokens"], r.host_hit_tokens) == (0, 0, 0)
    assert r.tokens == no_cache_tokens(other, [prompt])[0] != first.tokens
    with Engine(Model(preset("tiny"), seed=0), "hierarchical", 512, 1024, page_size=PAGE_SIZE,
                storage=spec, prefetch_policy="wait_complete") as c:
        again = c.generate(prompt, MAX_NEW_TOKENS)
        c.check_integrity()
    assert c.stats()["storage_hit_tokens"] == again.host_hit_tokens == whole
    assert again.tokens == first.tokens


def test_mooncake_master_killed_mid_run_engine_keeps_serving(tmp_path, model):
    """The store dies under a running engine: requests are still served from the device
    and host tiers, storage errors are counted, and greedy outputs stay exact."""
    rng = random.Random(3)
    system = [rng.randrange(32000) for _ in range(160)]
    prompts = [system + [rng.randrange(32000) for _ in range(24 + 8 * i)] for i in range(4)]
    reference = no_cache_tokens(model, prompts + prompts[:2])
    with start_mooncake_master(segment_nbytes=16 << 20, log_dir=tmp_path) as own:
        # A long breaker: after the first failure every op fails at once, so the request
        # path pays the client library's retries (seconds) only once.
        engine = Engine(model, "hierarchical", 512, 1024, page_size=PAGE_SIZE,
                        storage=own.spec, storage_options={"segment_nbytes": 0,
                                                           "retry_after_s": 60.0})
        try:
            tokens = [engine.generate(p, MAX_NEW_TOKENS).tokens for p in prompts[:2]]
            engine.drain()
            before = engine.stats()
            assert before["storage_write_bytes"] > 0 and before["storage_errors"] == 0
            own.kill_master()
            results = [engine.generate(p, MAX_NEW_TOKENS) for p in prompts[2:] + prompts[:2]]
            engine.drain()
            engine.check_integrity()
            after = engine.stats()
        finally:
            start = time.monotonic()
            engine.close()
            close_s = time.monotonic() - start
    assert tokens + [r.tokens for r in results] == reference
    assert after["storage_errors"] > 0, "the writes after the kill did not fail"
    assert after["storage_write_bytes"] == before["storage_write_bytes"]
    # Served from the device and host tiers: the shared system prompt, then both
    # earlier prompts again (whole pages of prompt[:-1]).
    for r in results[:2]:
        assert r.device_hit_tokens + r.host_hit_tokens >= len(system) // PAGE_SIZE * PAGE_SIZE
    for r, p in zip(results[2:], prompts[:2], strict=True):
        assert r.device_hit_tokens + r.host_hit_tokens == (len(p) - 1) // PAGE_SIZE * PAGE_SIZE
    assert after["loads_failed"] == 0
    assert close_s < 20.0  # the client library's unmount retries, bounded
