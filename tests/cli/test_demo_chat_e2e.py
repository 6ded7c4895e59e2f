"""``hicache demo chat`` end to end: SmolLM2 answering three questions through vLLM's
server alone and with hicache's connector.

vLLM's own prefix cache is emptied before every turn on both servers, so vLLM alone
caches nothing and every cached token on the hicache side is the host tier's (its
``/metrics`` count the same tokens). Needs vLLM and the real model; skipped with the
reason otherwise, failed under ``HICACHE_REQUIRE_VLLM=1`` /
``HICACHE_REQUIRE_REAL_MODEL=1`` (CI). A few minutes on 2 cores, most of it the two
servers starting.
"""

from __future__ import annotations

import json
import subprocess
import sys

from optional import skip_unless

TURNS = 3


@skip_unless("vllm")
@skip_unless("real_model")
def test_chat_on_smollm2_prints_every_turn_and_hicache_serves_the_history(tmp_path):
    cmd = [sys.executable, "-m", "hicache.cli", "demo", "chat", "--model", "smollm2",
           "--turns", str(TURNS), "--max-tokens", "32", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    result = json.loads(lines[0])
    # The text (on stderr with --json): every turn's question, and per server its TTFT,
    # cached share and the start of its reply.
    text = proc.stderr
    assert "vLLM's own prefix cache" in text and "host tier" in text
    for i, turn in enumerate(result["turns"], 1):
        assert f"turn {i}: {turn['question'][:30]}" in text
        for name in ("vllm", "hicache"):
            reply = turn[name]["reply"]
            assert reply.strip() and turn[name]["finish_reason"] in ("stop", "length"), turn
            start = " ".join(reply.split())[:20]
            assert any(line.startswith(f"  {name} ") and " TTFT " in line and "ms  cached" in line
                       and f'"{start}' in line for line in text.splitlines()), (name, start, text)
    assert len(result["turns"]) == TURNS
    first, *later = result["turns"]
    assert first["vllm"]["cached_tokens"] == first["hicache"]["cached_tokens"] == 0
    for turn in later:
        alone, hicache = turn["vllm"], turn["hicache"]
        assert alone["cached_tokens"] == 0, turn  # vLLM's cache emptied before the turn
        assert hicache["cached_share"] > alone["cached_share"], turn
        assert hicache["host_tokens"] == hicache["cached_tokens"] > 0, turn
    summary = result["summary"]
    assert summary["later_turns"] == TURNS - 1
    assert summary["cached_share"]["hicache"] > summary["cached_share"]["vllm"] == 0
    # float32 on the same threads: the same greedy replies with and without hicache.
    assert summary["replies_identical"], result["turns"]
    summary_line = [line for line in text.splitlines() if line.startswith("turns 2-3: ")]
    assert len(summary_line) == 1 and "replies identical on all 3 turns" in summary_line[0]
