"""Synthetic workloads: the trace kinds of ``docs/workloads.md``, each built from a seed alone.

The same trace can then be replayed through hicache and through other systems. Token
ids are uniform in ``[0, vocab_size)``: two unrelated runs of tokens never share a
page, so every hit a replay reports comes from the structure of the workload.
Generators return :class:`~hicache.sim.traces.Request` lists; writing them out is
:func:`hicache.sim.traces.write_trace`.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from hicache.sim.traces import MAX_TOKEN_ID, Request


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
            or not 1 <= vocab_size <= MAX_TOKEN_ID + 1:
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
