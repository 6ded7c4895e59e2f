"""``hicache bench serve --audit-rate 1``: every hit the connector finds is computed by
vLLM instead and compared with the pages it would have served, from the host tier and
from a ``file:`` third tier, on real vLLM servers; the report counts them and finds no
mismatch (docs/vllm.md, "Run-time KV audit").

Small enough for CI: the tiny random preset, 4 conversations x 3 turns, ``vllm`` and
``vllm+host+file`` (a host tier a quarter of the conversations, so later turns are
served from both tiers), one rate. Needs vLLM; skipped with the reason otherwise,
failed under ``HICACHE_REQUIRE_VLLM=1`` (CI).
"""

from __future__ import annotations

import json
import subprocess
import sys

from optional import skip_unless


@skip_unless("vllm")
def test_bench_serve_with_every_hit_audited_reports_no_mismatch(tmp_path):
    cmd = [sys.executable, "-m", "hicache.cli", "bench", "serve", "--preset", "tiny",
           "--configs", "vllm,vllm+host+file", "--audit-rate", "1", "--clients", "4",
           "--rounds", "3", "--system-tokens", "64", "--first-tokens", "96",
           "--turn-tokens", "32", "--max-tokens", "8", "--max-in-flight", "4",
           "--request-rates", "inf", "--no-hit-requests", "0", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["audit_rate"] == 1.0
    for name in ("vllm", "vllm+host+file"):
        c = summary["configs"][name]
        for run in (c["unloaded"], c["sweep"]["inf"]):
            assert run["num_requests"] == 12 and run["num_failed"] == 0, run["errors"]
    audit = summary["audit"]
    assert set(audit["by_config"]) == {"vllm+host+file"}  # vLLM alone has no connector
    total = audit["by_config"]["vllm+host+file"]
    # Every later turn's hit was audited: its pages compared, none wrong, its tokens
    # computed (the audit's cost), none loaded from hicache.
    assert total["audited_requests"] > 0 and total["audited_pages"] > 0, audit
    assert total["mismatched_pages"] == 0 and audit["mismatched_pages"] == 0, audit
    assert total["computed_tokens"] > 0
    for run in summary["tiers"]["vllm+host+file"].values():
        assert run["host"] == run["third_tier"] == 0, summary["tiers"]  # nothing served
    # Audited hits are computed: the same greedy replies as vLLM alone.
    assert summary["outputs_identical"], summary["outputs"]
