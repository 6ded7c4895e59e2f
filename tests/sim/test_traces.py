"""Trace format (read/write/validate), the six generators, stats and the CLI."""

from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest

from hicache.cli import trace as trace_cli
from hicache.sim import traces, workloads
from hicache.sim.traces import Request, load_trace, load_trace_arrays, trace_stats
from hicache.sim.workloads import generate

SMALL = {
    "agentic": {"num_system_prompts": 2, "system_tokens": 40, "num_sessions": 5, "num_turns": 3,
                "first_turn_tokens": 20, "turn_tokens": 8, "output_tokens": 6},
    "multiturn": {"num_clients": 4, "min_rounds": 2, "max_rounds": 4, "system_tokens": 30,
                  "user_tokens": 10, "output_tokens": 10},
    "fewshot": {"num_questions": 12, "num_example_blocks": 2, "example_tokens": 64,
                "question_tokens": 8, "output_tokens": 4},
    "longdoc": {"num_docs": 3, "min_doc_tokens": 50, "max_doc_tokens": 90,
                "questions_per_doc": 3, "instruction_tokens": 5, "question_tokens": 6,
                "output_tokens": 7},
    "mcts": {"root_tokens": 48, "branching": 3, "depth": 2, "step_tokens": 5,
             "output_tokens": 9, "num_trees": 2},
    "noreuse": {"num_requests": 10, "min_prompt_tokens": 5, "max_prompt_tokens": 30,
                "output_tokens": 3},
}


def _as_lists(reqs: list[Request]) -> list[tuple]:
    return [(r.id, r.session, list(map(int, r.prompt)), list(map(int, r.output)), r.t)
            for r in reqs]


def _by_session(reqs: list[Request]) -> dict[int, list[Request]]:
    out: dict[int, list[Request]] = {}
    for r in reqs:
        out.setdefault(r.session, []).append(r)
    return out


@pytest.mark.parametrize("kind", sorted(workloads.GENERATORS))
def test_every_kind_writes_valid_lines_that_round_trip(kind, tmp_path):
    reqs = generate(kind, seed=3, vocab_size=1000, **SMALL[kind])
    path = tmp_path / "t.jsonl"
    assert traces.write_trace(reqs, str(path)) == len(reqs) > 0
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        assert set(obj) == {"id", "session", "prompt", "output"}
        assert all(0 <= tok < 1000 for tok in obj["prompt"] + obj["output"])
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert _as_lists(load_trace(str(path))) == _as_lists(reqs)
    arrays = load_trace_arrays(str(path))
    assert all(r.prompt.dtype == np.int32 and r.output.dtype == np.int32 for r in arrays)
    assert _as_lists(arrays) == _as_lists(reqs)


@pytest.mark.parametrize("kind", sorted(workloads.GENERATORS))
def test_generators_are_deterministic_for_a_seed(kind):
    a = generate(kind, seed=7, **SMALL[kind])
    b = generate(kind, seed=7, **SMALL[kind])
    c = generate(kind, seed=8, **SMALL[kind])
    assert _as_lists(a) == _as_lists(b)
    assert _as_lists(a) != _as_lists(c)


def test_agentic_defaults_match_the_shared_sample_shape():
    reqs = generate("agentic", seed=0)
    assert len(reqs) == 160 and len(_by_session(reqs)) == 40
    assert sorted({len(r.prompt) for r in reqs}) == [576, 704, 832, 960]
    assert {len(r.output) for r in reqs} == {64}
    assert len({tuple(r.prompt[:512]) for r in reqs}) == 8


def test_agentic_turns_extend_history_and_sessions_interleave():
    reqs = generate("agentic", seed=1, **SMALL["agentic"])
    sessions = _by_session(reqs)
    assert len(sessions) == 5 and all(len(s) == 3 for s in sessions.values())
    for sid, turns in sessions.items():
        # session s uses system prompt s % 2
        assert list(turns[0].prompt[:40]) == list(sessions[sid % 2][0].prompt[:40])
        assert len(turns[0].prompt) == 40 + 20
        for prev, nxt in zip(turns, turns[1:], strict=False):
            history = list(prev.prompt) + list(prev.output)
            assert list(nxt.prompt[: len(history)]) == history
            assert len(nxt.prompt) == len(history) + 8
    order = [r.session for r in reqs]
    assert order != sorted(order), "sessions should interleave"


def test_agentic_concurrency_bounds_open_sessions():
    reqs = generate("agentic", seed=2, concurrency=2, **SMALL["agentic"])
    seen, done, counts = set(), set(), {}
    for r in reqs:
        seen.add(r.session)
        counts[r.session] = counts.get(r.session, 0) + 1
        if counts[r.session] == 3:
            done.add(r.session)
        assert len(seen - done) <= 2


def test_foundation_preset_shape():
    preset = workloads.PRESETS["agentic"]["foundation"]
    assert preset["num_sessions"] * preset["num_turns"] == 3000
    first = preset["system_tokens"] + preset["first_turn_tokens"]
    last = first + (preset["num_turns"] - 1) * (preset["turn_tokens"] + preset["output_tokens"])
    assert (first, last) == (4096, 4960)
    small = dict(preset, num_sessions=6)
    reqs = generate("agentic", seed=0, **small)
    assert len(reqs) == 60
    assert {len(r.prompt) for r in reqs} == set(range(4096, 4961, 96))
    assert len({tuple(r.prompt[:3072]) for r in reqs}) == 5


def test_multiturn_rounds_in_range_and_one_system_prompt():
    reqs = generate("multiturn", seed=0, **SMALL["multiturn"])
    sessions = _by_session(reqs)
    assert all(2 <= len(s) <= 4 for s in sessions.values())
    assert len({tuple(r.prompt[:30]) for r in reqs}) == 1
    for turns in sessions.values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            history = list(prev.prompt) + list(prev.output)
            assert list(nxt.prompt[: len(history)]) == history


def test_fewshot_questions_share_blocks():
    reqs = generate("fewshot", seed=0, **SMALL["fewshot"])
    blocks = {tuple(r.prompt[:64]) for r in reqs}
    assert len(blocks) == 2 and len(_by_session(reqs)) == 12
    assert all(4 <= len(r.prompt) - 64 <= 12 for r in reqs)  # 8 +- 25 %


def test_longdoc_questions_share_their_document():
    reqs = generate("longdoc", seed=0, **SMALL["longdoc"])
    sessions = _by_session(reqs)
    assert len(sessions) == 3 and all(len(s) == 3 for s in sessions.values())
    instruction = {tuple(r.prompt[:5]) for r in reqs}
    assert len(instruction) == 1
    for turns in sessions.values():
        # instruction (5) + document (>= 50) shared by all of its questions
        assert len({tuple(t.prompt[:55]) for t in turns}) == 1
    firsts = [turns[0].prompt for turns in sessions.values()]
    assert len({tuple(p[:6]) for p in firsts}) == 3, "documents differ after the instruction"


def test_mcts_children_extend_parent_context():
    reqs = generate("mcts", seed=0, **SMALL["mcts"])
    assert len(reqs) == 2 * (1 + 3 + 9)
    for tree in _by_session(reqs).values():
        contexts = {tuple(list(r.prompt) + list(r.output)): r for r in tree}
        roots = [r for r in tree if len(r.prompt) == 48]
        assert len(roots) == 1
        for r in tree:
            if r is roots[0]:
                continue
            parent = tuple(r.prompt[:-5])
            assert parent in contexts, "every child extends some node's prompt + output"
            assert tree.index(contexts[parent]) < tree.index(r), "parents come first"


def test_mcts_dfs_order_goes_deep_first():
    reqs = generate("mcts", seed=0, order="dfs", **dict(SMALL["mcts"], num_trees=1))
    depths = [(len(r.prompt) - 48) // (9 + 5) for r in reqs]
    assert depths[:3] == [0, 1, 2]


def test_noreuse_has_no_ideal_hits():
    reqs = generate("noreuse", seed=0, **SMALL["noreuse"])
    stats = trace_stats(reqs, page_size=4)
    assert stats.ideal_hit_tokens == 0 and stats.num_sessions == 10


def test_stats_counts_working_set_and_ideal_hits():
    p = 4
    a = Request(0, 0, list(range(10)), [50, 51])  # full 12 tokens: 3 pages
    b = Request(1, 1, list(range(10)) + [50, 51, 60], [70, 71, 72])  # shares 3, adds 1
    c = Request(2, 2, [9, 9, 9], [])  # shorter than a page: nothing cached
    s = trace_stats([a, b, c], page_size=p)
    assert s.working_set_tokens == 4 * p
    assert s.ideal_hit_tokens == 3 * p  # b's prompt has 3 whole pages, all cached by a
    assert (s.num_requests, s.num_sessions, s.prompt_tokens, s.output_tokens) == (3, 3, 26, 5)
    assert (s.min_prompt_len, s.max_prompt_len) == (3, 13)


def test_stats_hits_stop_at_the_first_missing_page():
    a = Request(0, 0, [1, 2, 3, 4, 5, 6, 7, 8], [])
    b = Request(1, 0, [1, 2, 3, 4, 0, 0, 0, 0, 5, 6, 7, 8], [])
    s = trace_stats([a, b], page_size=4)
    assert s.ideal_hit_tokens == 4 and s.working_set_tokens == 4 * 4


@pytest.mark.parametrize("line, expected", [
    ("{not json", ":2: expected one JSON object per line"),
    ("[1, 2]", ":2: expected a JSON object, got list"),
    ('{"id": 1, "session": 0, "prompt": [1]}', "missing output"),
    ('{"id": "1", "session": 0, "prompt": [1], "output": []}', "'id' expected an int"),
    ('{"id": 1, "session": true, "prompt": [1], "output": []}', "'session' expected an int"),
    ('{"id": 1, "session": 0, "prompt": "abc", "output": []}', "'prompt' expected a list"),
    ('{"id": 1, "session": 0, "prompt": [1, 2.5], "output": []}', "expected int token ids"),
    ('{"id": 1, "session": 0, "prompt": [1, true], "output": []}', "got bool"),
    ('{"id": 1, "session": 0, "prompt": [1], "output": [-3]}', "got -3"),
    ('{"id": 1, "session": 0, "prompt": [2147483648], "output": []}', "got 2147483648"),
    ('{"id": 1, "session": 0, "prompt": [1], "output": [], "t": -1}', "'t' expected"),
    ('{"id": 0, "session": 0, "prompt": [1], "output": []}', "unique 'id', got 0 again"),
])
def test_malformed_lines_raise_with_line_number(tmp_path, line, expected):
    good = '{"id": 0, "session": 0, "prompt": [1, 2], "output": [3]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2") as info:
        load_trace(str(path))
    assert expected in str(info.value)
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace_arrays(str(path))


def test_blank_lines_and_arrival_times(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"id": 5, "session": 1, "prompt": [], "output": [], "t": 0.5}\n\n')
    (req,) = load_trace(str(path))
    assert req == Request(5, 1, [], [], 0.5)


def test_rate_adds_increasing_arrival_times():
    reqs = generate("noreuse", seed=0, rate=100.0, **SMALL["noreuse"])
    times = [r.t for r in reqs]
    assert all(t is not None and t > 0 for t in times) and times == sorted(times)
    buf = io.StringIO()
    traces.write_trace(reqs[:1], buf)
    assert json.loads(buf.getvalue())["t"] == times[0]


@pytest.mark.parametrize("kind, params, expected", [
    ("nope", {}, "kind: expected one of"),
    ("agentic", {"vocab_size": 0}, "vocab_size"),
    ("agentic", {"num_sessions": -1}, "num_sessions: expected an int >= 0, got -1"),
    ("agentic", {"jitter": 1.5}, "jitter"),
    ("multiturn", {"min_rounds": 5, "max_rounds": 2}, "min_rounds <= max_rounds"),
    ("mcts", {"order": "random"}, "order: expected 'bfs' or 'dfs'"),
    ("noreuse", {"rate": -1.0}, "rate"),
])
def test_bad_generator_options(kind, params, expected):
    with pytest.raises(ValueError, match=expected):
        generate(kind, **params)


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trace_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_make_and_stats(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    args = _cli(["make", "agentic", "--seed", "4", "--sessions", "3", "--turns", "2",
                 "--system-tokens", "32", "--num-system-prompts", "1", "-o", str(out)])
    assert trace_cli.run(args) == 0
    reqs = load_trace(str(out))
    assert len(reqs) == 6
    assert _as_lists(reqs) == _as_lists(generate(
        "agentic", seed=4, num_sessions=3, num_turns=2, system_tokens=32, num_system_prompts=1))
    assert trace_cli.run(_cli(["stats", str(out), "--page-size", "16", "--json"])) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["requests"] == 6 and last["sessions"] == 3 and last["page_size"] == 16


def test_cli_preset_with_override_to_stdout(capsys):
    args = _cli(["make", "agentic", "--preset", "foundation", "--sessions", "2", "--turns", "2"])
    assert trace_cli.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert {len(json.loads(x)["prompt"]) for x in lines} == {4096, 4192}


def test_cli_errors_return_2(tmp_path, capsys):
    from hicache.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["trace", "make", "mcts", "--order", "zigzag"])
    assert exc.value.code == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("oops\n")
    assert main(["trace", "stats", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
