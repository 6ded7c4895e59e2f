"""Request traces in the shared JSON Lines format: read, write, generate, summarize.

One request per line, in arrival order (see ``docs/workloads.md``)::

    {"id": 0, "session": 3, "prompt": [12, 907, ...], "output": [55, 1, ...]}

``prompt`` is the full token list sent (history included); ``output`` is what the
model produced; an optional ``"t"`` is the arrival time in seconds.

The generators build the workload kinds of ``docs/workloads.md`` from a seed alone, so
the same trace can be replayed through hicache and through other systems. Token
ids are uniform in ``[0, vocab_size)``: two unrelated runs of tokens never share
a page, so every hit a replay reports comes from the structure of the workload.

This module knows nothing of caches, pages in memory or replay; the only page
notion here is the page-aligned working set that ``trace stats`` reports.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, NamedTuple

import numpy as np

from hicache.cli.args import TRACE_HELP, add_json, nonneg_float, nonneg_int, positive_int

_MAX_TOKEN_ID = 2**31 - 1  # token ids are held in int32 arrays


class Request(NamedTuple):
    """One request of a trace; ``prompt``/``output`` are int lists or int32 arrays."""

    id: int  # unique within the trace
    session: int  # the conversation / agent / branch it belongs to
    prompt: Sequence[int]  # every token sent, history included
    output: Sequence[int]  # tokens generated; cached after the request
    t: float | None = None  # arrival time in seconds, if the trace has one


# ----------------------------------------------------------------------------- reading


def _check_tokens(name: str, value: object, where: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: '{name}' expected a list of token ids, "
                         f"got {type(value).__name__}")
    if value:
        types = set(map(type, value))
        if types != {int}:
            bad = sorted(t.__name__ for t in types - {int})
            raise ValueError(f"{where}: '{name}' expected int token ids, got {', '.join(bad)}")
        low, high = min(value), max(value)
        if low < 0 or high > _MAX_TOKEN_ID:
            raise ValueError(f"{where}: '{name}' expected token ids in [0, {_MAX_TOKEN_ID}], "
                             f"got {low if low < 0 else high}")
    return value


def _check_int(name: str, value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: '{name}' expected an int, got {value!r}")
    return value


def _parse_line(line: str, where: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: expected one JSON object per line, got invalid JSON "
                         f"({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("id", "session", "prompt", "output") if k not in obj]
    if missing:
        raise ValueError(f"{where}: expected fields id, session, prompt, output; "
                         f"missing {', '.join(missing)}")
    t = obj.get("t")
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t < 0:
            raise ValueError(f"{where}: 't' expected a finite number >= 0, got {t!r}")
        t = float(t)
    return Request(
        _check_int("id", obj["id"], where),
        _check_int("session", obj["session"], where),
        _check_tokens("prompt", obj["prompt"], where),
        _check_tokens("output", obj["output"], where),
        t,
    )


def iter_trace(path: str) -> Iterator[Request]:
    """Yield the requests of a JSON Lines trace, token lists as Python lists.

    Blank lines are skipped. Raises ``ValueError`` naming the file, the line
    number and what was expected, on the first malformed line or repeated id.
    """
    seen: set[int] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            req = _parse_line(line, where)
            if req.id in seen:
                raise ValueError(f"{where}: expected a unique 'id', got {req.id} again")
            seen.add(req.id)
            yield req


def load_trace(path: str) -> list[Request]:
    """All requests of a trace, token lists as Python lists (see :func:`iter_trace`)."""
    return list(iter_trace(path))


def load_trace_arrays(path: str) -> list[Request]:
    """All requests with ``prompt`` and ``output`` converted once to int32 numpy arrays.

    A replay that times cache operations parses beforehand with this, so that no
    JSON or list conversion lands inside the timed loop.
    """
    return [
        req._replace(prompt=np.asarray(req.prompt, dtype=np.int32),
                     output=np.asarray(req.output, dtype=np.int32))
        for req in iter_trace(path)
    ]


# ----------------------------------------------------------------------------- writing


def _tokens_json(tokens: Sequence[int]) -> str:
    items = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
    return "[" + ", ".join(map(str, items)) + "]"


def format_request(req: Request) -> str:
    """One JSON Lines record (no newline), field order id, session, prompt, output[, t]."""
    text = (f'{{"id": {int(req.id)}, "session": {int(req.session)}, '
            f'"prompt": {_tokens_json(req.prompt)}, "output": {_tokens_json(req.output)}')
    if req.t is not None:
        text += f', "t": {float(req.t)!r}'
    return text + "}"


def write_trace(requests: Iterable[Request], file: str | IO[str]) -> int:
    """Write requests as JSON Lines to a path or an open text stream; returns the count."""
    if isinstance(file, str):
        with open(file, "w", encoding="utf-8") as f:
            return write_trace(requests, f)
    count = 0
    for req in requests:
        file.write(format_request(req) + "\n")
        count += 1
    return count


# ----------------------------------------------------------------------------- generators


def _lengths(rng: np.random.Generator, mean_len: int, jitter: float, n: int) -> np.ndarray:
    """``n`` lengths uniform in ``mean_len * [1 - jitter, 1 + jitter]`` (exact when 0)."""
    if jitter == 0.0 or mean_len == 0:
        return np.full(n, mean_len, dtype=np.int64)
    low = max(0, round(mean_len * (1 - jitter)))
    high = round(mean_len * (1 + jitter))
    return rng.integers(low, high + 1, size=n)


def _interleave(rng: np.random.Generator, streams: list[list[tuple]],
                concurrency: int) -> list[tuple]:
    """Merge per-session request streams, each kept in order, into one arrival order.

    At most ``concurrency`` sessions (0: all) are open at a time; each step picks
    an open session uniformly and takes its next request; a finished session is
    replaced by the next waiting one, in session order.
    """
    width = len(streams) if concurrency <= 0 else min(concurrency, len(streams))
    waiting = iter(range(width, len(streams)))
    active = list(range(width))
    cursor = [0] * len(streams)
    merged: list[tuple] = []
    while active:
        slot = int(rng.integers(len(active)))
        s = active[slot]
        merged.append(streams[s][cursor[s]])
        cursor[s] += 1
        if cursor[s] == len(streams[s]):
            nxt = next(waiting, None)
            if nxt is None:
                active[slot] = active[-1]
                active.pop()
            else:
                active[slot] = nxt
    return merged


def _to_requests(rng: np.random.Generator, items: Iterable[tuple], rate: float) -> list[Request]:
    """Number ``(session, prompt, output)`` items in order; Poisson arrivals when rate > 0."""
    reqs = [Request(i, s, p, o) for i, (s, p, o) in enumerate(items)]
    if rate > 0:
        times = np.cumsum(rng.exponential(1.0 / rate, size=len(reqs)))
        reqs = [r._replace(t=round(float(t), 6)) for r, t in zip(reqs, times, strict=True)]
    return reqs


def _sessions(rng: np.random.Generator, vocab_size: int, prefixes: list[np.ndarray],
              prefix_of: np.ndarray, turns_of: np.ndarray, first_turn_tokens: int,
              turn_tokens: int, output_tokens: int, jitter: float) -> list[list[tuple]]:
    """Per-session streams where turn k+1's prompt = turn k's prompt + output + new tokens."""
    streams = []
    for s, (pi, num_turns) in enumerate(zip(prefix_of, turns_of, strict=True)):
        lens_in = _lengths(rng, turn_tokens, jitter, int(num_turns))
        lens_in[0] = _lengths(rng, first_turn_tokens, jitter, 1)[0]
        lens_out = _lengths(rng, output_tokens, jitter, int(num_turns))
        history = prefixes[pi]
        stream = []
        for k in range(int(num_turns)):
            prompt = np.concatenate((history, rng.integers(0, vocab_size, lens_in[k],
                                                           dtype=np.int32)))
            output = rng.integers(0, vocab_size, lens_out[k], dtype=np.int32)
            stream.append((s, prompt, output))
            history = np.concatenate((prompt, output))
        streams.append(stream)
    return streams


def make_agentic(*, seed: int = 0, vocab_size: int = 32000, num_system_prompts: int = 8,
                 system_tokens: int = 512, num_sessions: int = 40, num_turns: int = 4,
                 first_turn_tokens: int = 64, turn_tokens: int = 64, output_tokens: int = 64,
                 concurrency: int = 0, jitter: float = 0.0, rate: float = 0.0) -> list[Request]:
    """Agent loops: a few long shared system prompts (+ tool schemas), many sessions
    appending (tool result, thought) turns, sessions interleaved.

    Session ``s`` uses system prompt ``s % num_system_prompts``; its first turn adds
    ``first_turn_tokens`` (the task), every later one ``turn_tokens`` after the
    previous output. The defaults give the shape of the sample trace of ``docs/workloads.md``.
    """
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab_size, system_tokens, dtype=np.int32)
               for _ in range(num_system_prompts)]
    prefix_of = np.arange(num_sessions) % num_system_prompts
    turns_of = np.full(num_sessions, num_turns)
    streams = _sessions(rng, vocab_size, systems, prefix_of, turns_of, first_turn_tokens,
                        turn_tokens, output_tokens, jitter)
    return _to_requests(rng, _interleave(rng, streams, concurrency), rate)


def make_multiturn(*, seed: int = 0, vocab_size: int = 32000, num_clients: int = 64,
                   min_rounds: int = 5, max_rounds: int = 10, system_tokens: int = 256,
                   user_tokens: int = 128, output_tokens: int = 128, concurrency: int = 0,
                   jitter: float = 0.25, rate: float = 0.0) -> list[Request]:
    """Multi-turn chat: one shared system prompt, each client's history growing per
    round (``min_rounds..max_rounds`` rounds per client), clients interleaved."""
    if not 1 <= min_rounds <= max_rounds:
        raise ValueError(f"rounds: expected 1 <= min_rounds <= max_rounds, "
                         f"got {min_rounds}, {max_rounds}")
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_tokens, dtype=np.int32)
    turns_of = rng.integers(min_rounds, max_rounds + 1, size=num_clients)
    streams = _sessions(rng, vocab_size, [system], np.zeros(num_clients, dtype=np.int64),
                        turns_of, user_tokens, user_tokens, output_tokens, jitter)
    return _to_requests(rng, _interleave(rng, streams, concurrency), rate)


def make_fewshot(*, seed: int = 0, vocab_size: int = 32000, num_questions: int = 2000,
                 num_example_blocks: int = 1, example_tokens: int = 4096,
                 question_tokens: int = 64, output_tokens: int = 16, jitter: float = 0.25,
                 rate: float = 0.0) -> list[Request]:
    """Few-shot: long example blocks, each shared by many short one-shot questions
    (one session per question; each question picks a block uniformly)."""
    rng = np.random.default_rng(seed)
    blocks = [rng.integers(0, vocab_size, example_tokens, dtype=np.int32)
              for _ in range(num_example_blocks)]
    block_of = rng.integers(num_example_blocks, size=num_questions)
    q_lens = _lengths(rng, question_tokens, jitter, num_questions)
    o_lens = _lengths(rng, output_tokens, jitter, num_questions)
    items = ((q, np.concatenate((blocks[block_of[q]],
                                 rng.integers(0, vocab_size, q_lens[q], dtype=np.int32))),
              rng.integers(0, vocab_size, o_lens[q], dtype=np.int32))
             for q in range(num_questions))
    return _to_requests(rng, list(items), rate)


def make_longdoc(*, seed: int = 0, vocab_size: int = 32000, num_docs: int = 16,
                 min_doc_tokens: int = 4096, max_doc_tokens: int = 16384,
                 questions_per_doc: int = 4, instruction_tokens: int = 64,
                 question_tokens: int = 48, output_tokens: int = 64, jitter: float = 0.25,
                 rate: float = 0.0) -> list[Request]:
    """Long-document QA: a shared instruction, then one of ``num_docs`` documents,
    then a question; the questions of all documents arrive in random order.
    Session = document index."""
    if not 0 <= min_doc_tokens <= max_doc_tokens:
        raise ValueError(f"doc tokens: expected 0 <= min <= max, "
                         f"got {min_doc_tokens}, {max_doc_tokens}")
    rng = np.random.default_rng(seed)
    instruction = rng.integers(0, vocab_size, instruction_tokens, dtype=np.int32)
    doc_lens = rng.integers(min_doc_tokens, max_doc_tokens + 1, size=num_docs)
    docs = [np.concatenate((instruction, rng.integers(0, vocab_size, n, dtype=np.int32)))
            for n in doc_lens]
    pairs = [(d, q) for d in range(num_docs) for q in range(questions_per_doc)]
    order = rng.permutation(len(pairs))
    items = []
    for i in order:
        d, _ = pairs[i]
        question = rng.integers(0, vocab_size, _lengths(rng, question_tokens, jitter, 1)[0],
                                dtype=np.int32)
        output = rng.integers(0, vocab_size, _lengths(rng, output_tokens, jitter, 1)[0],
                              dtype=np.int32)
        items.append((d, np.concatenate((docs[d], question)), output))
    return _to_requests(rng, items, rate)


def make_mcts(*, seed: int = 0, vocab_size: int = 32000, num_trees: int = 1,
              root_tokens: int = 4096, branching: int = 8, depth: int = 3,
              step_tokens: int = 32, output_tokens: int = 128, order: str = "bfs",
              rate: float = 0.0) -> list[Request]:
    """Tree search: each tree is one long root context; every node below it is a
    request whose prompt = parent prompt + parent output + its own step tokens.
    ``branching`` children per node down to ``depth``; nodes of one tree come in
    ``bfs`` or ``dfs`` order, trees interleaved. Session = tree index."""
    if order not in ("bfs", "dfs"):
        raise ValueError(f"order: expected 'bfs' or 'dfs', got {order!r}")
    rng = np.random.default_rng(seed)
    streams = []
    for tree in range(num_trees):
        root = rng.integers(0, vocab_size, root_tokens, dtype=np.int32)
        stream: list[tuple] = []
        frontier = deque([(root, 0)])  # (prompt, depth): popped left for BFS, right for DFS
        while frontier:
            prompt, d = frontier.popleft() if order == "bfs" else frontier.pop()
            output = rng.integers(0, vocab_size, output_tokens, dtype=np.int32)
            stream.append((tree, prompt, output))
            if d < depth:
                context = np.concatenate((prompt, output))
                children = [(np.concatenate((context, rng.integers(0, vocab_size, step_tokens,
                                                                   dtype=np.int32))), d + 1)
                            for _ in range(branching)]
                frontier.extend(children if order == "bfs" else children[::-1])
        streams.append(stream)
    return _to_requests(rng, _interleave(rng, streams, 0), rate)


def make_noreuse(*, seed: int = 0, vocab_size: int = 32000, num_requests: int = 1000,
                 min_prompt_tokens: int = 512, max_prompt_tokens: int = 2048,
                 output_tokens: int = 64, rate: float = 0.0) -> list[Request]:
    """No reuse: independent random prompts, one session each (nothing to hit)."""
    if not 0 <= min_prompt_tokens <= max_prompt_tokens:
        raise ValueError(f"prompt tokens: expected 0 <= min <= max, "
                         f"got {min_prompt_tokens}, {max_prompt_tokens}")
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_prompt_tokens, max_prompt_tokens + 1, size=num_requests)
    items = [(i, rng.integers(0, vocab_size, n, dtype=np.int32),
              rng.integers(0, vocab_size, output_tokens, dtype=np.int32))
             for i, n in enumerate(lens)]
    return _to_requests(rng, items, rate)


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "agentic": make_agentic,
    "multiturn": make_multiturn,
    "fewshot": make_fewshot,
    "longdoc": make_longdoc,
    "mcts": make_mcts,
    "noreuse": make_noreuse,
}
# Each generator's keyword defaults, for the command line's help.
GENERATOR_DEFAULTS: dict[str, dict[str, object]] = {
    kind: {name: p.default for name, p in inspect.signature(fn).parameters.items()}
    for kind, fn in GENERATORS.items()
}

# Named shapes. "foundation" is the benchmark trace of the foundation issue: 5 shared
# 3k-token system prompts, 300 sessions x 10 turns = 3,000 requests whose prompts grow
# from 4,096 to 4,960 tokens (3,072 system + 1,024 task + 9 x (64 tool + 32 reply)).
PRESETS: dict[str, dict[str, dict[str, int | float]]] = {
    "agentic": {
        "sample": {},
        "foundation": {"num_system_prompts": 5, "system_tokens": 3072, "num_sessions": 300,
                       "num_turns": 10, "first_turn_tokens": 1024, "turn_tokens": 64,
                       "output_tokens": 32},
    },
}


def generate(kind: str, **params: int | float | str) -> list[Request]:
    """Build a trace of ``kind`` (a key of :data:`GENERATORS`) from keyword shape options."""
    if kind not in GENERATORS:
        raise ValueError(f"kind: expected one of {sorted(GENERATORS)}, got {kind!r}")
    vocab_size = params.get("vocab_size", 32000)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not 1 <= vocab_size <= _MAX_TOKEN_ID + 1:
        raise ValueError(f"vocab_size: expected an int in [1, 2**31], got {vocab_size!r}")
    for name, value in params.items():
        if name in ("order", "jitter", "rate"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    if not 0.0 <= float(params.get("jitter", 0.0)) < 1.0:
        raise ValueError(f"jitter: expected a fraction in [0, 1), got {params['jitter']!r}")
    if float(params.get("rate", 0.0)) < 0:
        raise ValueError(f"rate: expected requests/s >= 0, got {params['rate']!r}")
    requests = GENERATORS[kind](**params)
    if not requests:
        zeros = [f"{k}={v}" for k, v in params.items() if k not in ("seed", "rate") and v == 0]
        raise ValueError(
            f"{kind}: expected a trace of at least one request, got none"
            + (f" (from {', '.join(zeros)})" if zeros else "")
        )
    return requests


# ----------------------------------------------------------------------------- statistics


class TraceStats(NamedTuple):
    num_requests: int
    num_sessions: int
    prompt_tokens: int  # sum of prompt lengths
    output_tokens: int
    min_prompt_len: int
    max_prompt_len: int
    page_size: int
    working_set_tokens: int  # distinct page-aligned prefixes of prompt+output, in tokens
    ideal_hit_tokens: int  # hits of a replay with unbounded capacity

    @property
    def mean_prompt_len(self) -> float:
        return self.prompt_tokens / self.num_requests if self.num_requests else 0.0

    @property
    def ideal_hit_ratio(self) -> float:
        return self.ideal_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def trace_stats(requests: Sequence[Request], page_size: int = 16) -> TraceStats:
    """Sizes of a trace, its page-aligned working set and its unbounded-cache hits.

    The working set counts each distinct page-aligned prefix page of every
    ``prompt + output`` once: what a cache that never evicts would hold after the
    replay of ``docs/workloads.md``. Prefix pages are identified by a chained hash of
    their bytes (a false match needs a 64-bit collision).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    seen: set[int] = set()
    hit_total = prompt_total = output_total = 0
    min_len, max_len = sys.maxsize, 0
    page_nbytes = 4 * page_size
    for req in requests:
        prompt = np.asarray(req.prompt, dtype=np.int32)
        full = np.concatenate((prompt, np.asarray(req.output, dtype=np.int32)))
        num_prompt_pages = len(prompt) // page_size
        data = full[: len(full) // page_size * page_size].tobytes()
        chain = 0
        matching = True
        for i, off in enumerate(range(0, len(data), page_nbytes)):
            chain = hash((chain, data[off: off + page_nbytes]))
            if chain in seen:
                if matching and i < num_prompt_pages:
                    hit_total += page_size
            else:
                matching = False
                seen.add(chain)
        prompt_total += len(prompt)
        output_total += len(req.output)
        min_len, max_len = min(min_len, len(prompt)), max(max_len, len(prompt))
    return TraceStats(
        num_requests=len(requests),
        num_sessions=len({r.session for r in requests}),
        prompt_tokens=prompt_total,
        output_tokens=output_total,
        min_prompt_len=min_len if requests else 0,
        max_prompt_len=max_len,
        page_size=page_size,
        working_set_tokens=len(seen) * page_size,
        ideal_hit_tokens=hit_total,
    )


# ----------------------------------------------------------------------------- CLI

# (flag, parameter, type, help) per kind; every default comes from the generator.
_OPTIONS: dict[str, list[tuple[str, str, type, str]]] = {
    "agentic": [
        ("--num-system-prompts", "num_system_prompts", int, "shared system prompts"),
        ("--system-tokens", "system_tokens", int, "tokens per system prompt (+ tool schemas)"),
        ("--sessions", "num_sessions", int, "agent sessions"),
        ("--turns", "num_turns", int, "turns per session"),
        ("--first-turn-tokens", "first_turn_tokens", int, "task tokens of the first turn"),
        ("--turn-tokens", "turn_tokens", int, "new tool-result/user tokens per later turn"),
        ("--output-tokens", "output_tokens", int, "tokens generated per turn"),
        ("--concurrency", "concurrency", int, "sessions open at once (0: all)"),
        ("--jitter", "jitter", float, "relative spread of every length (0: exact)"),
    ],
    "multiturn": [
        ("--clients", "num_clients", int, "chat clients (sessions)"),
        ("--min-rounds", "min_rounds", int, "fewest rounds per client"),
        ("--max-rounds", "max_rounds", int, "most rounds per client"),
        ("--system-tokens", "system_tokens", int, "shared system prompt tokens"),
        ("--user-tokens", "user_tokens", int, "user tokens per round"),
        ("--output-tokens", "output_tokens", int, "reply tokens per round"),
        ("--concurrency", "concurrency", int, "clients open at once (0: all)"),
        ("--jitter", "jitter", float, "relative spread of every length"),
    ],
    "fewshot": [
        ("--questions", "num_questions", int, "questions (one request each)"),
        ("--example-blocks", "num_example_blocks", int, "distinct example blocks"),
        ("--example-tokens", "example_tokens", int, "tokens per example block"),
        ("--question-tokens", "question_tokens", int, "tokens per question"),
        ("--output-tokens", "output_tokens", int, "answer tokens"),
        ("--jitter", "jitter", float, "relative spread of question/answer lengths"),
    ],
    "longdoc": [
        ("--docs", "num_docs", int, "documents"),
        ("--min-doc-tokens", "min_doc_tokens", int, "shortest document"),
        ("--max-doc-tokens", "max_doc_tokens", int, "longest document"),
        ("--questions-per-doc", "questions_per_doc", int, "questions per document"),
        ("--instruction-tokens", "instruction_tokens", int, "shared instruction tokens"),
        ("--question-tokens", "question_tokens", int, "tokens per question"),
        ("--output-tokens", "output_tokens", int, "answer tokens"),
        ("--jitter", "jitter", float, "relative spread of question/answer lengths"),
    ],
    "mcts": [
        ("--trees", "num_trees", int, "independent search trees"),
        ("--root-tokens", "root_tokens", int, "tokens of each root context"),
        ("--branching", "branching", int, "children per node"),
        ("--depth", "depth", int, "levels below the root"),
        ("--step-tokens", "step_tokens", int, "new tokens per child"),
        ("--output-tokens", "output_tokens", int, "tokens generated per node"),
        ("--order", "order", str, "node order within a tree: bfs or dfs"),
    ],
    "noreuse": [
        ("--requests", "num_requests", int, "requests"),
        ("--min-prompt-tokens", "min_prompt_tokens", int, "shortest prompt"),
        ("--max-prompt-tokens", "max_prompt_tokens", int, "longest prompt"),
        ("--output-tokens", "output_tokens", int, "tokens generated per request"),
    ],
}


# One line per kind for `trace make --help` (a generator's docstring is for the API).
_KIND_HELP = {
    "agentic": "agent loops: shared system prompts, sessions appending tool results and thoughts",
    "multiturn": "chat: a shared system prompt, per-client history growing round by round",
    "fewshot": "one long example block shared by many short questions",
    "longdoc": "long documents, several questions each, documents interleaved",
    "mcts": "tree search: a root context expanded into branches of branches",
    "noreuse": "random prompts that share nothing (the cache must not slow these down)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hicache trace make KIND ...`` and ``hicache trace stats FILE``."""
    sub = parser.add_subparsers(dest="trace_command", required=True, metavar="{make,stats}")
    make = sub.add_parser(
        "make", help="generate a trace (JSON Lines to stdout or -o FILE)",
        description="Generate a synthetic trace of one workload kind from a seed. Format and "
        "kinds: docs/workloads.md.",
    )
    kinds = make.add_subparsers(dest="kind", required=True, metavar="KIND")
    for kind, options in _OPTIONS.items():
        p = kinds.add_parser(kind, help=_KIND_HELP[kind], description=_KIND_HELP[kind] + ".")
        p.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
        p.add_argument("--vocab", dest="vocab_size", type=positive_int, default=32000,
                       help="token ids are drawn from [0, VOCAB)")
        p.add_argument("--rate", type=nonneg_float, default=0.0,
                       help="add Poisson arrival times 't' at this many requests/s (0: none)")
        p.add_argument("-o", "--output", dest="out", default="-",
                       help="output file ('-': stdout)")
        if kind in PRESETS:
            p.add_argument("--preset", choices=sorted(PRESETS[kind]),
                           help="a named shape; explicit options override it")
        for flag, dest, typ, help_text in options:
            kw = {"choices": ["bfs", "dfs"]} if dest == "order" else {}
            typ = nonneg_float if typ is float else nonneg_int if typ is int else typ
            default = GENERATOR_DEFAULTS[kind].get(dest)
            p.add_argument(flag, dest=dest, type=typ, default=None, **kw,
                           help=f"{help_text} (default: {default})")
    stats = sub.add_parser("stats", help="sizes, working set and ideal hit ratio of a trace",
                           description="Sizes, working set and ideal hit ratio of a trace.")
    stats.add_argument("trace", help=TRACE_HELP)
    stats.add_argument("--page-size", type=positive_int, default=16, help="tokens per page")
    add_json(stats)


def _make_params(args: argparse.Namespace) -> dict[str, int | float | str]:
    params: dict[str, int | float | str] = dict(PRESETS.get(args.kind, {}).get(
        getattr(args, "preset", None) or "", {}))
    for _, dest, _, _ in _OPTIONS[args.kind]:
        value = getattr(args, dest)
        if value is not None:
            params[dest] = value
    params.update(seed=args.seed, vocab_size=args.vocab_size, rate=args.rate)
    return params


def run(args: argparse.Namespace) -> int:
    if args.trace_command == "make":
        requests = generate(args.kind, **_make_params(args))  # ValueError: one line, exit 2
        if args.out == "-":
            write_trace(requests, sys.stdout)
        else:
            write_trace(requests, args.out)
        return 0
    s = trace_stats(load_trace(args.trace), args.page_size)
    if args.json:
        print(json.dumps({
            "requests": s.num_requests, "sessions": s.num_sessions,
            "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
            "min_prompt_len": s.min_prompt_len, "max_prompt_len": s.max_prompt_len,
            "page_size": s.page_size, "working_set_tokens": s.working_set_tokens,
            "ideal_hit_tokens": s.ideal_hit_tokens,
            "ideal_hit_ratio": round(s.ideal_hit_ratio, 6),
        }))
        return 0
    rows = [
        ("requests", s.num_requests), ("sessions", s.num_sessions),
        ("prompt tokens", s.prompt_tokens), ("output tokens", s.output_tokens),
        ("prompt length min/mean/max",
         f"{s.min_prompt_len} / {s.mean_prompt_len:.0f} / {s.max_prompt_len}"),
        (f"working set (page {s.page_size}), tokens", s.working_set_tokens),
        ("ideal hit ratio (unbounded cache)", f"{s.ideal_hit_ratio:.4f}"),
    ]
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    return 0
