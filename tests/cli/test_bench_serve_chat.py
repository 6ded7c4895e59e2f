"""``hicache bench serve --workload sharegpt`` end to end: SmolLM2 answering ShareGPT's
conversations through vLLM's chat completions, with and without hicache.

Small enough for CI: 2 conversations x 3 human turns, ``vllm`` and ``vllm+host`` only,
one rate, no no-hit comparison; vLLM's KV cache (9 blocks of 32 tokens) holds one
conversation's longest sequence, so vLLM alone evicts what the other conversation needs
and the host tier serves it. Needs vLLM and the real model and dataset; skipped with the
reason otherwise, failed under ``HICACHE_REQUIRE_VLLM=1`` / ``HICACHE_REQUIRE_REAL_MODEL=1``
(CI).
"""

from __future__ import annotations

import json
import subprocess
import sys

from optional import skip_unless


@skip_unless("vllm")
@skip_unless("real_model")
def test_sharegpt_chats_on_smollm2_reuse_history_from_the_host_tier(tmp_path):
    cmd = [sys.executable, "-m", "hicache.cli", "bench", "serve", "--model", "smollm2",
           "--workload", "sharegpt", "--clients", "2", "--rounds", "3", "--max-tokens", "32",
           "--configs", "vllm,vllm+host", "--request-rates", "inf", "--max-in-flight", "2",
           "--vllm-blocks", "9", "--no-hit-requests", "0", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    summary = json.loads(lines[0])
    assert summary["workload_name"] == "sharegpt" and summary["rates"] == ["inf"]
    for name in ("vllm", "vllm+host"):
        c = summary["configs"][name]
        for run in (c["unloaded"], c["sweep"]["inf"]):
            assert run["num_requests"] == 6 and run["num_failed"] == 0, run["errors"]
        history = summary["history"][name]["unloaded"]
        assert history["num_turns"] == 4 and history["reusable_tokens"] > 0
        # The chat template re-renders SmolLM2's replies (EOS included) almost as
        # generated: far under the 5% of the history.
        assert history["retokenization_loss_share"] < 0.05, history
        assert summary["goodput"][name]["goodput_rps"] >= 0
    # One request at a time, the conversations take turns: vLLM alone's 9 blocks lose
    # each one's history to the other; the host tier serves it.
    alone, host = (summary["history"][n]["unloaded"] for n in ("vllm", "vllm+host"))
    assert host["reused_tokens"] > alone["reused_tokens"], (alone, host)
    tiers = summary["tiers"]["vllm+host"]["unloaded"]
    assert tiers["host"] > 0 and tiers["third_tier"] == 0
    assert summary["tiers"]["vllm"]["unloaded"]["host"] == 0
    # float32 on one set of cores: the same greedy replies with and without hicache.
    assert summary["outputs_identical"], summary["outputs"]
    # The idle server is stopped while the other runs: no CPU taken from it.
    for idle in summary["idle_cpu"].values():
        assert idle["cpu_s"] < 0.5, summary["idle_cpu"]
