"""ShareGPT's reader and filter (hicache/realdata/sharegpt.py) on small synthetic files.

The packaged file is cut off mid-string; here every cut of a small file (mid-string,
mid-key, mid-number, inside an escape or a multi-byte character, between items) must
give exactly the items that end before it, for buffer sizes small enough that every
item spans several refills.
"""

from __future__ import annotations

import io
import json

import pytest

from hicache.realdata.sharegpt import (
    Chat,
    estimate_tokens,
    iter_items,
    read_conversations,
    read_text,
    select,
)


def _conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


ITEMS = [
    _conv("a_0", ("human", "Hello there"), ("gpt", "Hi! \u00e9t\u00e9 \u2603 \"quoted\"\n")),
    _conv("b_1", ("human", "x" * 40), ("gpt", "y\\z"), ("human", "caf\u00e9 \U0001F600"),
          ("gpt", "ok")),
    {"id": "c_2", "n": 12345, "f": 1.5e3, "conversations": []},
    _conv("d_3", ("human", "last one"), ("gpt", "bye")),
]


def _text(items: list[dict], ensure_ascii: bool) -> tuple[str, list[int]]:
    """The file as json.dump writes it (indented, as the real one), and where each item
    ends (the index just past its closing brace)."""
    parts = ["[\n"]
    ends = []
    for i, item in enumerate(items):
        if i:
            parts.append(",\n")
        parts.append(json.dumps(item, indent=2, ensure_ascii=ensure_ascii))
        ends.append(sum(map(len, parts)))
    parts.append("\n]")
    return "".join(parts), ends


def test_a_whole_file_reads_every_item_and_is_not_truncated():
    text, _ = _text(ITEMS, ensure_ascii=False)
    result = read_text(text)
    assert result.items == ITEMS and not result.truncated
    assert result.chars_read == text.rindex("}") + 1
    assert read_text("").items == [] and not read_text("  ").truncated
    assert read_text("[]").items == [] and not read_text("[ ]").truncated


@pytest.mark.parametrize("ensure_ascii", [False, True])  # escapes (\u00e9) or raw characters
@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_every_cut_keeps_exactly_the_items_before_it(ensure_ascii, chunk):
    text, ends = _text(ITEMS, ensure_ascii)
    for cut in range(len(text)):
        result = read_conversations(io.StringIO(text[:cut]), chunk_chars=chunk)
        whole = sum(end <= cut for end in ends)
        assert result.items == ITEMS[:whole], (cut, text[max(0, cut - 10):cut])
        assert result.truncated == (cut > 0), cut  # no closing bracket: the file was cut
        assert result.chars_read == (ends[whole - 1] if whole else 0)


def test_a_cut_mid_string_like_the_packaged_file():
    text, ends = _text(ITEMS, ensure_ascii=False)
    cut = text.index("last one") + 4  # inside the last item's first string
    result = read_text(text[:cut])
    assert [i["id"] for i in result.items] == ["a_0", "b_1", "c_2"] and result.truncated
    with pytest.raises(json.JSONDecodeError):
        json.loads(text[:cut])  # what json.load does with it


def test_a_malformed_item_before_the_end_is_an_error_not_a_cut():
    text = '[{"id": "a", "conversations": []}, {"id": tru}, ' + '{"id": "b"}, ' * 5 + "]"
    with pytest.raises(ValueError, match=f"malformed item at character {text.index('tru')}"):
        read_text(text)
    with pytest.raises(ValueError, match="expected a JSON array"):
        read_text('{"id": "a"}')
    with pytest.raises(ValueError, match="expected an object"):
        read_text('[{"id": "a"}, 3, {"id": "b"}]')
    # The stream is read lazily: the items before the bad one come out first.
    it = iter_items(io.StringIO(text), chunk_chars=8)
    assert next(it) == {"id": "a", "conversations": []}
    with pytest.raises(ValueError):
        next(it)


def test_a_file_on_disk(tmp_path):
    text, _ = _text(ITEMS, ensure_ascii=False)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:-30], encoding="utf-8")
    result = read_conversations(path)
    assert result.items == ITEMS[:3] and result.truncated
    assert read_conversations(str(path), chunk_chars=3).items == ITEMS[:3]


# ------------------------------------------------------------------ the filter
FILTER_ITEMS = [
    _conv("two", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),
    _conv("open", ("human", "q1"), ("gpt", "a1"), ("human", "q2")),  # last unanswered
    _conv("gpt-first", ("gpt", "a0"), ("human", "q1"), ("gpt", "a1")),
    _conv("system", ("system", "s"), ("human", "q1"), ("gpt", "a1")),
    _conv("repeat", ("human", "q1"), ("human", "q1b"), ("gpt", "a1")),
    _conv("other-role", ("human", "q1"), ("bing", "a1")),
    _conv("empty-turn", ("human", "q1"), ("gpt", "  \n")),
    _conv("none"),
    {"id": "no-key"},
    _conv("long", ("human", "w " * 50), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"),
          ("human", "q3"), ("gpt", "b" * 400)),
    _conv("three", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"),
          ("human", "q3"), ("gpt", "a3")),
]


def _ids(chats: list[Chat]) -> list[str]:
    return [c.id for c in chats]


def test_select_keeps_alternating_human_first_non_empty_chats():
    chats = select(FILTER_ITEMS)
    assert _ids(chats) == ["two", "open", "long", "three"]
    two, open_ = chats[0], chats[1]
    assert two == Chat("two", ("q1", "q2"), ("a1", "a2"))
    assert open_.human == ("q1", "q2") and open_.gpt == ("a1",)  # the last one unanswered


def test_select_counts_human_turns_and_cuts_to_the_first_ones():
    assert _ids(select(FILTER_ITEMS, min_human_turns=2)) == ["two", "open", "long", "three"]
    assert _ids(select(FILTER_ITEMS, min_human_turns=3)) == ["long", "three"]
    first_two = select(FILTER_ITEMS, min_human_turns=2, max_human_turns=2)
    assert [(len(c.human), len(c.gpt)) for c in first_two] == [(2, 2), (2, 1), (2, 2), (2, 2)]
    assert first_two[3] == Chat("three", ("q1", "q2"), ("a1", "a2"))
    assert _ids(select(FILTER_ITEMS, limit=2)) == ["two", "open"]
    assert select(FILTER_ITEMS, limit=0) == []


def test_select_token_budget_per_message_with_a_tokenizer_or_the_estimate():
    # The estimate: 4 characters a token. "long" has a 100-character human turn (25) and
    # a 400-character reply (100) in its third turn.
    assert estimate_tokens("") == 0 and estimate_tokens("abcde") == 2
    assert "long" not in _ids(select(FILTER_ITEMS, max_turn_tokens=99))
    assert "long" in _ids(select(FILTER_ITEMS, max_turn_tokens=100))
    # Only the kept turns count: the long reply is in the third.
    assert "long" in _ids(select(FILTER_ITEMS, max_human_turns=2, max_turn_tokens=25))
    assert "long" not in _ids(select(FILTER_ITEMS, max_human_turns=2, max_turn_tokens=24))
    # A tokenizer: words.
    words = select(FILTER_ITEMS, max_human_turns=2, max_turn_tokens=49,
                   count_tokens=lambda t: len(t.split()))
    assert "long" not in _ids(words) and "two" in _ids(words)


def test_select_refuses_nonsense_bounds():
    with pytest.raises(ValueError, match="min_human_turns"):
        select(FILTER_ITEMS, min_human_turns=0)
    with pytest.raises(ValueError, match="max_human_turns"):
        select(FILTER_ITEMS, min_human_turns=3, max_human_turns=2)
