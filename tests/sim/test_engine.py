"""Engine: the three modes agree token for token under eviction, reloads and failed loads.

Tolerance on logits: float32 weights, activations and KV. A reloaded prefix is
bitwise the KV that was computed (the copy moves bytes), but the three modes
prefill different chunks: ``none`` runs the whole prompt in one causal call,
the cached modes run only the uncached suffix against the prefix read from the
pool (an explicit mask instead of ``is_causal``, matmuls of other shapes). Only
float32 summation order differs: measured max |diff| ~2e-6 on logits up to ~5.
``ATOL = RTOL = 1e-4`` leaves headroom and still catches any real mistake (a
stale or wrong page moves logits by O(1)). Greedy tokens must match exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from hicache.sim.engine import Engine, GenerateResult
from hicache.sim.model import Model

ATOL = RTOL = 1e-4
PAGE_SIZE = 16
DEVICE_TOKENS = 512  # < 2 sessions' prompts: the device tier must evict
HOST_TOKENS = 16384  # holds the whole workload
MAX_NEW_TOKENS = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(model: Model, mode: str, **kwargs) -> Engine:
    if mode == "hierarchical":
        kwargs.setdefault("host_tokens", HOST_TOKENS)
    return Engine(model, mode, DEVICE_TOKENS, page_size=PAGE_SIZE, **kwargs)


def run_sessions(
    engine: Engine, num_sessions: int = 6, num_turns: int = 3, seed: int = 0
) -> list[GenerateResult]:
    """Interleaved multi-turn sessions over 2 shared system prompts.

    Each turn's prompt is the session's history (previous prompt and reply)
    plus a new 24-token user turn, so later turns hit earlier ones' KV.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(160)] for _ in range(2)]
    history = {s: list(systems[s % 2]) for s in range(num_sessions)}
    results = []
    for _ in range(num_turns):
        for s in range(num_sessions):
            prompt = history[s] + [rng.randrange(32000) for _ in range(24)]
            r = engine.generate(prompt, MAX_NEW_TOKENS, keep_logits=True)
            engine.check_integrity()
            history[s] = prompt + r.tokens
            results.append(r)
    engine.drain()
    engine.check_integrity()
    return results


@pytest.fixture(scope="module")
def reference(model) -> list[GenerateResult]:
    with make_engine(model, "none") as engine:
        return run_sessions(engine)


def assert_same_outputs(results: list[GenerateResult], reference: list[GenerateResult]) -> None:
    assert [r.tokens for r in results] == [r.tokens for r in reference]
    for r, ref in zip(results, reference, strict=True):
        torch.testing.assert_close(r.logits, ref.logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mode", ["device", "hierarchical"])
def test_cached_modes_match_no_cache(model, reference, mode):
    with make_engine(model, mode) as engine:
        results = run_sessions(engine)
        stats = engine.stats()
    assert_same_outputs(results, reference)
    assert stats["device_evicted_tokens"] > 0, "workload too small: the device never evicted"
    assert stats["device_hit_tokens"] > 0
    if mode == "hierarchical":
        assert stats["host_hit_tokens"] > 0 and stats["loads"] > 0
        assert stats["loads_failed"] == 0
    else:
        assert stats["host_hit_tokens"] == 0
    # Per-request accounting adds up to the prompt.
    for r, ref in zip(results, reference, strict=True):
        prompt_len = ref.computed_tokens
        assert r.device_hit_tokens + r.host_hit_tokens + r.computed_tokens == prompt_len
    assert sum(r.host_hit_tokens for r in results) == stats["host_hit_tokens"]


def test_hierarchy_computes_fewer_tokens_than_device_only(model):
    computed = {}
    for mode in ("device", "hierarchical"):
        with make_engine(model, mode) as engine:
            computed[mode] = sum(r.computed_tokens for r in run_sessions(engine))
    assert computed["hierarchical"] < computed["device"]


@pytest.mark.parametrize("fail_layer", [0, 1])
def test_failed_load_is_recomputed(model, reference, fail_layer):
    """Every other load fails at ``fail_layer`` (layers before it have landed)."""
    with make_engine(model, "hierarchical") as engine:
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
    # the prefixes of failed loads are loaded again in place (a request still held them)
    assert stats["loads"] + stats["loads_reloaded"] > stats["loads_failed"], (
        "no load succeeded: nothing reloaded"
    )


def test_backups_overlap_the_next_request(model):
    """Write-through backups are submitted at insert and complete in the background."""
    with make_engine(model, "hierarchical") as engine:
        engine.generate(list(range(100, 200)), 4)
        assert engine.stats()["backups"] > 0
        engine.drain()
        engine.check_integrity()
        stats = engine.stats()
    assert stats["transfers_in_flight"] == 0 and stats["backup_bytes"] > 0


def test_request_larger_than_device_pool(model):
    with make_engine(model, "device") as engine:
        with pytest.raises(ValueError, match="33 device pages"):
            engine.generate(list(range(1, 520)), 10)  # 528 tokens of KV > 512
        engine.check_integrity()  # the refused request left nothing behind


def test_uncached_mode_frees_pages(model):
    with make_engine(model, "none") as engine:
        r = engine.generate(list(range(1, 40)), 3)
        engine.check_integrity()
    assert r.computed_tokens == 39 and r.device_hit_tokens == r.host_hit_tokens == 0
    assert len(r.tokens) == 3 and r.ttft_s <= r.total_s


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "disk"}, "mode: expected one of"),
        ({"mode": "hierarchical", "executor": "manual"}, "executor: expected"),
        ({"mode": "hierarchical", "executor": "immediate"}, "executor: expected"),
        ({"mode": "device", "host_tokens": 1024}, "only the 'hierarchical' mode"),
    ],
)
def test_bad_arguments(model, kwargs, match):
    mode = kwargs.pop("mode")
    with pytest.raises(ValueError, match=match):
        Engine(model, mode, DEVICE_TOKENS, **kwargs)


def test_bad_requests(model):
    with make_engine(model, "device") as engine:
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.generate([1, 2, 3], 0)
        with pytest.raises(ValueError, match="non-empty"):
            engine.generate([], 3)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.generate([1, 2, 40000], 3)
        engine.check_integrity()


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 33])
def test_short_and_page_aligned_prompts(model, prompt_len):
    """The last prompt token is always computed, even when the whole prompt is cached."""
    prompt = list(range(7, 7 + prompt_len))
    outputs = {}
    for mode in ("none", "device", "hierarchical"):
        with make_engine(model, mode) as engine:
            first = engine.generate(prompt, 3)
            again = engine.generate(prompt, 3)
            engine.check_integrity()
        assert first.tokens == again.tokens
        assert again.computed_tokens >= 1
        if mode != "none":
            assert again.device_hit_tokens == (prompt_len - 1) // PAGE_SIZE * PAGE_SIZE
        outputs[mode] = first.tokens
    assert outputs["none"] == outputs["device"] == outputs["hierarchical"]
