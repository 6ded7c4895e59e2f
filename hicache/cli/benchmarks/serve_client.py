"""Clients of ``hicache bench serve``: streamed completions over HTTP, timed at the client.

:func:`stream_completion` sends one ``POST /v1/completions`` to an OpenAI-compatible
server (token ids in, ``stream: true``, ``return_token_ids``, usage with
``prompt_tokens_details.cached_tokens`` in the last chunk) and stamps every streamed
chunk on arrival: time to first token is the first chunk carrying tokens, less the time
the request was sent; inter-token latency is the gap between chunks (spread evenly
over the tokens of a chunk that carries several). The HTTP is the standard library's
asyncio streams (HTTP/1.1, one connection per request, chunked or plain bodies), so a
client needs nothing installed and costs the server's machine little.

:func:`run_load` drives a :class:`~hicache.cli.benchmarks.serve_workload.Workload`
the way SGLang's ``bench_multiturn`` does: every client's next turn waits in one queue
of ready turns (first turns in client order); a sender takes the turn at the head at
Poisson arrivals of ``request_rate`` (``inf``: as soon as there is one) and sends it
when fewer than ``max_in_flight`` requests are in flight; a reply puts the client's
next round at the back of the queue. With ``duration_s`` clients start a new
conversation after their last round and sending stops after ``duration_s`` (a soak);
otherwise every client runs one conversation. Timing starts at the send, so time
spent in the queue of ready turns is not in a TTFT (it is the load the cap keeps away).

A chat turn (a :class:`~hicache.cli.benchmarks.serve_workload.Turn` with messages)
goes to ``POST /v1/chat/completions`` instead (:func:`stream_chat`): greedy, up to
``max_tokens``, ending where the model's EOS ends it (no ``ignore_eos``: a reply
shorter than ``max_tokens`` is a whole reply), with vLLM's ``return_token_ids``: the
first chunk carries the rendered prompt's ``prompt_token_ids``, every later chunk its
choice's ``token_ids``, so a chat's record holds token ids as a completion's does.

This module knows nothing of vLLM or of the report.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

from hicache.cli.benchmarks.serve_workload import AnyWorkload, Turn


@dataclass
class Record:
    """One request as the client saw it (times in seconds, ``time.monotonic``)."""

    client: int
    conversation: int
    round_no: int
    prompt: list[int]
    sent_s: float = 0.0
    done_s: float = 0.0
    output: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one gap per token after the first
    cached_tokens: int = 0
    error: str | None = None  # None: answered in full
    messages: list[dict[str, str]] | None = None  # a chat turn's (prompt: the server's ids)
    reply_text: str = ""  # a chat reply's text
    finish_reason: str | None = None  # a chat reply's ("stop": EOS, "length": max_tokens)

    @property
    def turn(self) -> Turn:
        return Turn(self.prompt, self.messages)


class ServerError(Exception):
    """The server answered with an error status or a malformed stream."""


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: de-chunked, or up to Content-Length or EOF."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ServerError("the connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()  # the empty trailer line
                return
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            yield data[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def _events(body: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """Server-sent events' ``data:`` payloads as JSON, until ``[DONE]``."""
    buf = b""
    async for chunk in body:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    yield json.loads(data)
                except ValueError:
                    raise ServerError(f"a malformed event: {data[:200]!r}") from None


async def stream_completion(url: str, body: dict, record: Record, timeout_s: float) -> None:
    """Send ``body`` (``stream`` and usage options are added) to ``url``'s
    ``/v1/completions`` and fill ``record`` (times, output, cached tokens; ``error`` on
    any failure, never raised). The reply must be ``max_tokens`` long (``ignore_eos``)."""
    await _stream(url, "/v1/completions", body, record, timeout_s, chat=False)


async def stream_chat(url: str, body: dict, record: Record, timeout_s: float) -> None:
    """Send ``body`` (messages; ``stream``, usage and ``return_token_ids`` are added) to
    ``url``'s ``/v1/chat/completions`` and fill ``record``: times, the prompt's and the
    reply's token ids, the reply's text and finish reason, cached tokens; ``error`` on any
    failure (no token ids, no finish reason, more than ``max_tokens``), never raised."""
    await _stream(url, "/v1/chat/completions", body, record, timeout_s, chat=True)


async def _stream(url: str, path: str, body: dict, record: Record, timeout_s: float, *,
                  chat: bool) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps({**body, "stream": True, "return_token_ids": True,
                          "stream_options": {"include_usage": True}}).encode()
    request = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
               "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    record.sent_s = time.monotonic()
    writer: asyncio.StreamWriter | None = None

    async def exchange() -> None:
        nonlocal writer
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request + payload)
        await writer.drain()
        status_line = await reader.readline()
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
        if status != 200:
            text = b"".join([c async for c in _read_body(reader, headers)])
            raise ServerError(f"HTTP {status}: {text[:300].decode(errors='replace')}")
        last = None
        async for event in _events(_read_body(reader, headers)):
            now = time.monotonic()
            if "error" in event:
                raise ServerError(f"error event: {str(event['error'])[:300]}")
            if chat and event.get("prompt_token_ids") is not None:
                record.prompt = [int(t) for t in event["prompt_token_ids"]]
            for choice in event.get("choices") or []:
                if chat:
                    record.reply_text += (choice.get("delta") or {}).get("content") or ""
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                tokens = choice.get("token_ids") or []
                if not tokens:
                    continue
                if last is None:
                    record.ttft_s = now - record.sent_s
                else:
                    record.itl_s += [(now - last) / len(tokens)] * len(tokens)
                if last is None and len(tokens) > 1:
                    record.itl_s += [0.0] * (len(tokens) - 1)
                last = now
                record.output += tokens
            usage = event.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = int(details.get("cached_tokens") or 0)
        if chat:
            if not record.prompt:
                raise ServerError("no prompt_token_ids in the stream (a server without "
                                  "return_token_ids?)")
            if record.finish_reason is None or not record.output:
                raise ServerError(f"the stream ended without a finish_reason or tokens "
                                  f"({len(record.output)} tokens)")
            if len(record.output) > body["max_tokens"]:
                raise ServerError(f"expected at most {body['max_tokens']} tokens, got "
                                  f"{len(record.output)}")
        elif len(record.output) != body["max_tokens"]:
            raise ServerError(f"expected {body['max_tokens']} tokens, got {len(record.output)}")

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except (OSError, ServerError, ValueError, asyncio.TimeoutError,
            asyncio.IncompleteReadError) as e:
        record.error = f"{type(e).__name__}: {e}"[:500]
    finally:
        record.done_s = time.monotonic()
        if writer is not None:
            writer.close()


async def send_turn(url: str, rec: Record, *, model: str, max_tokens: int,
                    timeout_s: float) -> None:
    """Send ``rec``'s turn: its messages as a chat (greedy, ending on EOS), else its
    token ids as a completion (greedy, ``ignore_eos``)."""
    if rec.messages is not None:
        await stream_chat(url, {"model": model, "messages": rec.messages,
                                "max_tokens": max_tokens, "temperature": 0.0}, rec, timeout_s)
    else:
        await stream_completion(url, {"model": model, "prompt": rec.prompt,
                                      "max_tokens": max_tokens, "temperature": 0.0,
                                      "ignore_eos": True}, rec, timeout_s)


async def run_load(url: str, workload: AnyWorkload, *, model: str, request_rate: float,
                   max_in_flight: int, seed: int = 0, duration_s: float | None = None,
                   timeout_s: float = 600.0,
                   on_done: Callable[[Record], None] = lambda r: None) -> list[Record]:
    """Run ``workload`` against ``url``; every request's :class:`Record`, in send order.

    A failed turn ends its client's conversation (its next prompt would need the reply).
    """
    if not (request_rate > 0):
        raise ValueError(f"request_rate: expected > 0 (or inf), got {request_rate}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight: expected an int >= 1, got {max_in_flight}")
    rng = np.random.default_rng(seed)
    ready: deque[tuple[int, int, int, Turn]] = deque(
        (c, 0, 0, workload.first_turn(c)) for c in range(workload.num_clients))
    wake = asyncio.Event()
    slots = asyncio.Semaphore(max_in_flight)
    records: list[Record] = []
    tasks: set[asyncio.Task] = set()
    num_running = 0  # sent, and not yet queued their next turn
    start = time.monotonic()

    async def one(rec: Record) -> None:
        nonlocal num_running
        try:
            await send_turn(url, rec, model=model, max_tokens=workload.max_tokens,
                            timeout_s=timeout_s)
        finally:
            slots.release()
        on_done(rec)
        if rec.error is None:
            nxt = rec.round_no + 1
            if nxt < workload.num_rounds:
                ready.append((rec.client, rec.conversation, nxt, workload.next_turn(
                    rec.client, rec.conversation, nxt, rec.turn, rec.output, rec.reply_text)))
            elif duration_s is not None:
                conv = rec.conversation + 1
                ready.append((rec.client, conv, 0, workload.first_turn(rec.client, conv)))
        num_running -= 1
        wake.set()

    while True:
        if duration_s is not None and time.monotonic() - start >= duration_s:
            break
        if math.isfinite(request_rate):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        while not ready:
            if not num_running:  # nothing in flight, nothing ready: every conversation ended
                break
            wake.clear()
            await wake.wait()
        if not ready:
            break
        await slots.acquire()
        client, conv, round_no, turn = ready.popleft()
        rec = Record(client, conv, round_no, list(turn.prompt), messages=turn.messages)
        records.append(rec)
        num_running += 1
        task = asyncio.create_task(one(rec))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return records


async def replay(url: str, records: list[Record], *, model: str, max_tokens: int,
                 max_in_flight: int, timeout_s: float = 600.0) -> list[Record]:
    """Send the prompts of ``records`` again (at most ``max_in_flight`` at a time, as fast
    as they are answered); new records under the same (client, conversation, round)."""
    slots = asyncio.Semaphore(max_in_flight)
    out = [Record(r.client, r.conversation, r.round_no, list(r.prompt), messages=r.messages)
           for r in records]

    async def one(rec: Record) -> None:
        async with slots:
            await send_turn(url, rec, model=model, max_tokens=max_tokens, timeout_s=timeout_s)

    await asyncio.gather(*(one(r) for r in out))
    return out
