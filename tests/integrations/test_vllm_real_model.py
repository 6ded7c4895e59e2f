"""A real model and a real conversation through ``vllm serve`` and ``/v1/chat/completions``.

SmolLM2-135M-Instruct (converted from its package's GGUF, float32: docs/real_model.md)
behind two servers started concurrently as docs/vllm.md documents them, one with the
HiCacheConnector and one without, the same CPU settings and the same reserved core
(``VLLM_CPU_NUM_OF_RESERVED_CPU``: vLLM reserves one more for a KV connector unless
told, and a different thread count changes replies). A three-turn ShareGPT chat,
greedy replies that stop on the model's own EOS (or the max_tokens cap), each reply
joining the history as a client's does:

* vLLM alone, its prefix cache holding everything (``fits``): the reference;
* vLLM alone, its prefix cache emptied before each turn (everything recomputed);
* with the connector, vLLM's cache emptied before each turn: the later turns' history
  comes from hicache's host tier (``cached_tokens`` in the usage, and the connector's
  own counters on ``/metrics``).

Replies, under the contract in docs/vllm.md ("Which replies are identical, and to
what"): in float32 identical in all three; in bfloat16 (the same servers again, in that
dtype) hicache's identical to ``fits``' (both read the KV vLLM wrote), recomputing free
to differ. The model also answers a plain question sensibly (a check on the conversion
itself).

Needs vLLM and the real model (skipped without, unless ``HICACHE_REQUIRE_VLLM=1`` /
``HICACHE_REQUIRE_REAL_MODEL=1``); about two minutes a dtype on 2 cores, most of it the two
servers starting.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optional import need

need("vllm")
need("real_model")

from vllm_servers import Server, chat_example, connector_config, start_all  # noqa: E402

from hicache.realdata import cached_model, load_chats  # noqa: E402

BLOCK = 32
TURNS = 3
MAX_TOKENS = 48
MAX_TURN_TOKENS = 160  # each ShareGPT message kept: short turns keep the test quick
ARGS = ["--enforce-eager", "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--num-gpu-blocks-override", "96", "--max-num-seqs", "2"]
# The same for both servers: one core kept off the worker (vLLM would otherwise reserve
# it only for the server with a connector, where cores are to spare).
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def model() -> str:
    directory = cached_model("smollm2")
    assert directory is not None  # need("real_model") checked it
    return str(directory)


@pytest.fixture(scope="module")
def chat() -> list[str]:
    """The first ShareGPT chat of at least 3 human turns with every message short."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_model("smollm2")))
    chats = load_chats(min_human_turns=TURNS, max_human_turns=TURNS,
                       max_turn_tokens=MAX_TURN_TOKENS, limit=1, download=False,
                       count_tokens=lambda t: len(tokenizer(t)["input_ids"]))
    assert chats, "no ShareGPT chat passes the filter"
    return list(chats[0].human)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def servers(model, dtype, tmp_path_factory):
    root: Path = tmp_path_factory.mktemp(f"real-model-{dtype}")
    args = [*ARGS, "--dtype", dtype]
    started = {
        "alone": Server(root, model, "alone", None, args=args, env=ENV),
        "hicache": Server(root, model, "hicache",
                          connector_config({"host_tokens": 256 * BLOCK}), args=args, env=ENV),
    }
    start_all(list(started.values()))
    try:
        yield started
    finally:
        for s in started.values():
            s.stop()


def converse(server: Server, turns: list[str], reset: bool) -> list[dict]:
    """The chat, one human turn at a time, each greedy reply joining the history;
    ``reset`` empties vLLM's own prefix cache before each turn."""
    messages: list[dict] = []
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        if reset:
            server.reset()
        response = chat_example.post(f"{server.url}/v1/chat/completions", {
            "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0.0})
        choice = response["choices"][0]
        reply = choice["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        usage = response["usage"]
        out.append({"reply": reply, "finish": choice["finish_reason"],
                    "prompt": usage["prompt_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    or 0})
    return out


@pytest.fixture(scope="module")
def runs(servers, chat):
    out = {"fits": converse(servers["alone"], chat, reset=False),
           "recompute": converse(servers["alone"], chat, reset=True),
           "hicache": converse(servers["hicache"], chat, reset=True)}
    print(json.dumps(out))  # the figures, for docs/real_model.md (pytest -s)
    return out


def test_replies_identical_to_vllm_with_everything_cached_and_to_recomputing(runs, dtype):
    replies = {name: [t["reply"] for t in turns] for name, turns in runs.items()}
    # hicache serves the KV vLLM wrote, bit for bit: the replies of vLLM reading it from
    # its own cache. Recomputed history matches it exactly in float32 only.
    assert replies["hicache"] == replies["fits"]
    if dtype == "float32":
        assert replies["fits"] == replies["recompute"]
    assert all(r.strip() for r in replies["fits"])
    assert [t["prompt"] for t in runs["hicache"]] == [t["prompt"] for t in runs["fits"]]


def test_later_turns_are_served_from_hicache(runs, servers):
    from prom_check import sample

    hicache, recompute, fits = runs["hicache"], runs["recompute"], runs["fits"]
    assert [t["cached"] for t in recompute] == [0] * TURNS  # vLLM's cache was emptied
    assert hicache[0]["cached"] == 0
    for before, turn in zip(hicache[:-1], hicache[1:], strict=True):
        # Each turn's prompt starts with the previous one (its whole blocks were saved to
        # the host tier); the previous reply, re-rendered by the chat template, may not.
        assert turn["cached"] >= before["prompt"] // BLOCK * BLOCK > 0, hicache
        assert turn["cached"] <= (turn["prompt"] - 1) // BLOCK * BLOCK
    assert [t["cached"] for t in fits[1:]] == [t["cached"] for t in hicache[1:]]
    text = servers["hicache"].metrics()
    assert sample(text, "vllm:hicache_hit_tokens_total", tier="host") >= sum(
        t["cached"] for t in hicache)


def test_the_model_answers_sensibly(servers):
    response = chat_example.post(f"{servers['hicache'].url}/v1/chat/completions", {
        "model": "tiny", "max_tokens": 24, "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    choice = response["choices"][0]
    print(json.dumps(choice["message"]["content"]))
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop"  # ended on its own EOS
