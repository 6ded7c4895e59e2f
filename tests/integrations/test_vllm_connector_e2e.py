"""HiCacheConnector inside real vLLM (CPU backend), end to end.

Three engines, each in its own process (vLLM spawns processes, see
tests/integrations/vllm_driver.py), on a tiny random Llama saved to a temporary directory:

* baseline: vLLM alone, a multi-turn workload whose working set (~90 blocks) is
  several times vLLM's KV cache (24 blocks);
* connector: the same workload with hicache's host tier and a ``file:`` third
  tier, then a prompt, ``reset_prefix_cache()`` and the prompt again; vLLM keeps a
  core off its worker here (on a machine with two or more), so the connector copies
  on a copy thread pinned to it;
* replay: a second process on the same ``file:`` directory, no core kept off the
  worker, so the connector copies between forwards.

Skipped without vLLM, unless ``HICACHE_REQUIRE_VLLM=1`` (CI), where a missing or
broken install fails instead.
"""

from __future__ import annotations

import os
import re

import pytest
from helpers import VLLM_REQUIRED, run_vllm, vllm_available, vllm_result

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm]') not installed",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = str(root / "model")
    storage = f"file:{root / 'store'}"
    proc = run_vllm("make-model", model)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    baseline = run_vllm("run", model, "multiturn", "--no-connector")
    spare = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} if (os.cpu_count() or 1) >= 2 else {}
    connector = run_vllm("run", model, "multiturn,reset", "--storage", storage,
                         HICACHE_LOG_LEVEL="INFO", **spare)
    results = {"baseline": vllm_result(baseline), "connector": vllm_result(connector)}
    results["replay"] = vllm_result(run_vllm("run", model, "replay", "--storage", storage,
                                             HICACHE_LOG_LEVEL="INFO",
                                             VLLM_CPU_NUM_OF_RESERVED_CPU="0"))
    return results


def test_copies_run_on_the_core_vllm_keeps_free_else_between_forwards(runs):
    if (os.cpu_count() or 1) >= 2:
        assert re.search(r"hicache worker: thread executor on CPUs \[\d+\]",
                         runs["connector"]["log"])
    assert "hicache worker: sync executor" in runs["replay"]["log"]


def _reachable_hits(prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    """Per request, the prompt tokens whose KV some earlier request computed, in whole
    blocks, leaving the last prompt token to compute: what a cache that loses nothing
    can serve. An earlier request computed KV for its prompt and all but its last output."""
    computed: list[list[int]] = []
    hits = []
    for prompt, out in zip(prompts, outputs, strict=True):
        best = 0
        for seq in computed:
            n = 0
            while n < min(len(seq), len(prompt)) and seq[n] == prompt[n]:
                n += 1
            best = max(best, n)
        hits.append(min(best, len(prompt) - 1) // 32 * 32)
        computed.append(prompt + out[:-1])
    return hits


def test_multiturn_outputs_identical_and_more_tokens_cached(runs):
    base, hc = runs["baseline"]["multiturn"], runs["connector"]["multiturn"]
    assert hc["prompts"] == base["prompts"]
    assert hc["outputs"] == base["outputs"]  # greedy: KV loaded from hicache is the KV
    # vLLM's own cache holds 24 blocks, the working set several times that: vLLM alone
    # recomputes evicted prefixes; with hicache's host tier (large enough here) every
    # block any earlier request computed comes back.
    reachable = _reachable_hits(hc["prompts"], hc["outputs"])
    assert hc["cached_per_request"] == reachable
    assert base["cached_tokens"] < sum(reachable) * 3 // 4


def test_reset_prefix_cache_then_served_from_host_tier(runs):
    r = runs["connector"]["reset"]
    assert r["reset_ok"]
    assert r["second"] == r["first"]
    # every whole block but the last token's: vLLM's own cache was emptied
    assert r["cached_after"] == (r["prompt_tokens"] - 1) // 32 * 32


def test_second_process_hits_the_file_tier(runs):
    r = runs["replay"]["replay"]
    assert r["cached_tokens"] == (r["prompt_tokens"] - 1) // 32 * 32
    assert r["output"] == runs["baseline"]["multiturn"]["outputs"][0]


def test_connector_stats_aggregate_and_reduce():
    from hicache.integrations.vllm import HiCacheConnector, HiCacheConnectorStats

    a = HiCacheConnectorStats(data={"load_bytes": 4_000_000_000, "load_seconds": 1.0})
    b = HiCacheConnector.build_kv_connector_stats({"load_bytes": 2_000_000_000, "load_seconds": 1.0})
    assert not a.is_empty() and HiCacheConnectorStats().is_empty()
    reduced = a.aggregate(b).reduce()
    assert reduced["load_bytes"] == 6_000_000_000 and reduced["load_gbps"] == 3.0
    assert reduced["save_gbps"] == 0.0 and reduced["hook_ms_per_step"] == 0.0
    c = HiCacheConnectorStats(data={"steps": 40, "hook_seconds": 0.02})
    assert c.aggregate(HiCacheConnectorStats(data={"steps": 10, "hook_seconds": 0.03})) \
        .reduce()["hook_ms_per_step"] == 1.0
