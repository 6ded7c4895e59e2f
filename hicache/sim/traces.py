"""Request traces in the shared JSON Lines format: read, write, summarize.

One request per line, in arrival order (see ``docs/workloads.md``)::

    {"id": 0, "session": 3, "prompt": [12, 907, ...], "output": [55, 1, ...]}

``prompt`` is the full token list sent (history included); ``output`` is what the
model produced; an optional ``"t"`` is the arrival time in seconds. The synthetic
workloads that produce such traces are :mod:`hicache.sim.workloads`.

This module knows nothing of caches, pages in memory or replay; the only page
notion here is the page-aligned working set that ``trace stats`` reports.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, NamedTuple

import numpy as np
import numpy.typing as npt

from hicache.checks import check_int, check_seconds

MAX_TOKEN_ID = 2**31 - 1  # token ids are held in int32 arrays


class Request(NamedTuple):
    """One request of a trace; ``prompt``/``output`` are int lists or int32 arrays."""

    id: int  # unique within the trace
    session: int  # the conversation / agent / branch it belongs to
    prompt: Sequence[int] | npt.NDArray[np.int32]  # every token sent, history included
    output: Sequence[int] | npt.NDArray[np.int32]  # tokens generated; cached after it
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
        if low < 0 or high > MAX_TOKEN_ID:
            raise ValueError(f"{where}: '{name}' expected token ids in [0, {MAX_TOKEN_ID}], "
                             f"got {low if low < 0 else high}")
    return value


@contextmanager
def _field(name: str, where: str) -> Iterator[None]:
    """A check of field ``name`` of the line at ``where``: its error, ValueError or
    TypeError alike (a file's content is input, not a caller's type), becomes one
    ValueError naming the line and the field."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: '{name}' {exc}") from None


def _check_int(name: str, value: object, where: str) -> int:
    with _field(name, where):
        return check_int("", value, minimum=-(2**63), maximum=2**63, what="an int",
                         show_value=True)


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
        with _field("t", where):
            t = float(check_seconds("", t))
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
    number and what was expected, on the first malformed line, repeated id or
    bytes that are not UTF-8.
    """
    seen: set[int] = set()
    with open(path, "rb") as f:  # decoded per line: a bad byte is reported at its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:  # a binary or non-UTF-8 file: name it
                raise ValueError(f"{path}:{lineno}: expected UTF-8 text (JSON Lines), got "
                                 f"byte {raw[exc.start]:#04x}") from None
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


def _tokens_json(tokens: Sequence[int] | npt.NDArray[np.int32]) -> str:
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
