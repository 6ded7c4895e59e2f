"""Engine over a hybrid model (tiny-hybrid: window, full and linear layers): every cached
mode generates what the uncached one does, under eviction, reloads and failed loads,
on both trees.

The same sessions as tests/sim/test_engine.py (two shared system prompts, three turns);
the device pool is twice as large as there, since a hybrid request also owns its window
pages and its state. Tolerances as there: the linear layers' recurrence runs in chunks
from a checkpoint instead of from the start, which changes float32 rounding only.
"""

from __future__ import annotations

import functools

import pytest
from kv_layouts import TREE_KINDS
from test_engine import MAX_NEW_TOKENS, PAGE_SIZE, assert_same_outputs, run_sessions

from hicache.sim import engine as engine_module
from hicache.sim.engine import Engine, GenerateResult
from hicache.sim.model import Model, preset

DEVICE_TOKENS = 1024  # hybrid requests take about twice the pages: still evicts
HOST_TOKENS = 16384

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid() -> Model:
    return Model(preset("tiny-hybrid"), seed=0)


def make(model: Model, mode: str, **kwargs) -> Engine:
    if mode == "hierarchical":
        kwargs.setdefault("host_tokens", HOST_TOKENS)
    return Engine(model, mode, DEVICE_TOKENS, page_size=PAGE_SIZE, **kwargs)


@pytest.fixture(params=TREE_KINDS)
def tree(request, monkeypatch) -> str:
    """The engine's cache on this tree (the engine itself takes the default, auto)."""
    config = functools.partial(engine_module.CacheConfig, tree=request.param)
    monkeypatch.setattr(engine_module, "CacheConfig", config)
    return request.param


@pytest.fixture(scope="module")
def reference(hybrid) -> list[GenerateResult]:
    with make(hybrid, "none") as engine:
        return run_sessions(engine)


@pytest.mark.parametrize("mode", ["device", "hierarchical"])
def test_cached_modes_match_no_cache(hybrid, reference, mode, tree):
    with make(hybrid, mode) as engine:
        assert engine.cache.config.tree == tree
        results = run_sessions(engine)
        stats = engine.stats()
    assert_same_outputs(results, reference)
    assert stats["device_evicted_tokens"] > 0, "workload too small: the device never evicted"
    # A later turn starts from the checkpoint the earlier one inserted; a session
    # branching off a shared system prompt from the checkpoint its first branch inserted.
    assert stats["device_hit_tokens"] > 0
    if mode == "hierarchical":
        assert stats["host_hit_tokens"] > 0 and stats["loads"] > 0
        assert stats["host_component_pages"] > 0
    for r, ref in zip(results, reference, strict=True):
        assert r.device_hit_tokens + r.host_hit_tokens + r.computed_tokens == ref.computed_tokens
    assert sum(r.host_hit_tokens for r in results) == stats["host_hit_tokens"]


def test_hybrid_requests_hit_less_than_full_matches_but_never_serve_wrong_kv(hybrid, reference):
    """What the cache serves is cut to what every component can: a full-attention match
    of a system prompt without a checkpoint at its end serves nothing the first time."""
    with make(hybrid, "device") as engine:
        results = run_sessions(engine, num_sessions=4, num_turns=1)
    assert [r.device_hit_tokens for r in results] == [0, 0, 0, 0]  # no branch point yet
    with make(hybrid, "device") as engine:
        results = run_sessions(engine, num_sessions=6, num_turns=1)
    assert [r.device_hit_tokens for r in results][4:] == [160, 160]  # now there is


@pytest.mark.parametrize("fail_layer", [0, 1])
def test_failed_load_is_recomputed(hybrid, reference, fail_layer, tree):
    """Every other load fails at ``fail_layer``: the request is cut back to an end every
    component serves and recomputed from there, with the same outputs."""
    with make(hybrid, "hierarchical") as engine:
        copier = engine.cache.transfers.executor._copier
        real_load = copier.load
        calls = {"n": 0}

        def flaky_load(host_ids, device_ids, first, last):
            if first == fail_layer:
                calls["n"] += 1
                if calls["n"] % 2 == 1:
                    raise OSError("injected load failure")
            return real_load(host_ids, device_ids, first, last)

        copier.load = flaky_load
        results = run_sessions(engine)
        stats = engine.stats()
    assert_same_outputs(results, reference)
    assert stats["loads_failed"] > 0
    assert sum(r.num_load_failures for r in results) > 0


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 33, 70])
def test_short_and_page_aligned_prompts(hybrid, prompt_len):
    """The last prompt token is always computed; the second run starts from the
    checkpoint the first inserted (the prompt's whole pages, up to the last token)."""
    prompt = list(range(7, 7 + prompt_len))
    outputs = {}
    for mode in ("none", "device", "hierarchical"):
        with make(hybrid, mode) as engine:
            first = engine.generate(prompt, MAX_NEW_TOKENS)
            again = engine.generate(prompt, MAX_NEW_TOKENS)
            engine.check_integrity()
        assert first.tokens == again.tokens
        if mode != "none":
            assert again.device_hit_tokens == (prompt_len - 1) // PAGE_SIZE * PAGE_SIZE
        outputs[mode] = first.tokens
    assert outputs["none"] == outputs["device"] == outputs["hierarchical"]


# A hit at 16 (a checkpoint there) whose full-attention match reaches 32 (no checkpoint):
# P1 caches [0, 16), P2 [0, 48) with a checkpoint at 48, P3 shares 40 tokens with P2.
P1 = list(range(7, 27))
P2 = P1[:16] + list(range(100, 127))
P3 = P2[:40] + list(range(300, 319))  # 59 tokens: 4 pages with its output
Q = list(range(500, 517))  # one page cached: a page, a window page, a checkpoint


@pytest.fixture(scope="module")
def p3_reference(hybrid) -> list[int]:
    with make(hybrid, "none") as engine:
        return engine.generate(P3, MAX_NEW_TOKENS).tokens


@pytest.mark.parametrize(("pool_pages", "pinned", "hit"), [(11, False, 16), (13, True, 0)])
def test_a_hit_that_leaves_too_few_pages_gives_up_the_extra_checkpoint_then_the_hit(
        hybrid, p3_reference, pool_pages, pinned, hit):
    """P3's hit at 16 holds a page, a window page and a checkpoint; its 3 pages beyond
    take 3 pages, 3 window pages, a state and checkpoints at 64 and at its full match
    (32): 12 pages. With 11 (what request_pages counts for 4 pages) it drops the
    checkpoint at 32 and keeps the hit. With 13 of which a pin on Q holds 3, 11 are too
    many: it computes from the start (10 pages). Same tokens as uncached every time."""
    with Engine(hybrid, "device", pool_pages * PAGE_SIZE, page_size=PAGE_SIZE) as engine:
        for prompt in (P1, P2, Q) if pinned else (P1, P2):
            engine.generate(prompt, MAX_NEW_TOKENS)
        if pinned:
            assert engine.cache.pin(Q[:16]) == 16
        result = engine.generate(P3, MAX_NEW_TOKENS)
        engine.check_integrity()
    assert result.tokens == p3_reference
    assert (result.device_hit_tokens, result.computed_tokens) == (hit, len(P3) - hit)

