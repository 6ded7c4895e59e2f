"""Mistakes are one line, bugs are tracebacks: each case a new user hit (issue 28).

A user's mistake (an impossible size, a malformed spec, an empty or binary trace) is
one line on stderr naming the option or file, exit status 2, before any work; an
error from inside the work is a bug and keeps its traceback (exit status 1).
"""

from __future__ import annotations

import argparse
import json

import pytest
from cli_runs import assert_user_error, run_cli

from hicache.cli import app as cli
from hicache.cli.args import UsageError, run_guarded

HUGE = "99999999999999"  # tokens: page allocators alone would need ~150 TB


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mistakes") / "t.jsonl"
    assert cli.main(["trace", "make", "agentic", "--sessions", "2", "--turns", "2",
                     "--system-tokens", "32", "-o", str(path)]) == 0
    return str(path)


@pytest.fixture
def empty_trace(tmp_path) -> str:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")  # blank lines only: no request
    return str(path)


@pytest.fixture
def binary_trace(tmp_path, trace) -> str:
    path = tmp_path / "latin1.jsonl"
    first = open(trace, "rb").readline()
    path.write_bytes(first + b'{"id": 99, "caf\xe9": 1}\n')  # line 2 is Latin-1, not UTF-8
    return str(path)


# ------------------------------------------------------------------ sizes beyond memory
def test_replay_device_tokens_beyond_memory_is_one_line(trace, capsys):
    err = assert_user_error(["replay", trace, "--device-tokens", HUGE], capsys,
                            "host memory:", "lower --device-tokens")
    assert "--host-tokens" not in err  # no host tier asked for: nothing else to blame


def test_replay_memory_message_blames_the_option_that_asks_for_it(trace, capsys):
    assert_user_error(["replay", trace, "--device-tokens", HUGE, "--host-tokens", "64"],
                      capsys, "lower --device-tokens or --host-tokens")
    assert_user_error(["replay", trace, "--device-tokens", "64", "--host-tokens", HUGE],
                      capsys, "lower --host-tokens or --device-tokens")
    assert_user_error(["replay", trace, "--device-tokens", "64", "--sweep-host", f"0,{HUGE}"],
                      capsys, "lower --sweep-host or --device-tokens")


@pytest.mark.parametrize("command", [["demo"], ["bench", "multiturn"]])
def test_engine_tiers_are_checked_before_the_work(command, capsys):
    small = ["--preset", "tiny", "--sessions", "1", "--turns", "1", "--system-tokens", "16",
             "--first-turn-tokens", "16"]
    assert_user_error([*command, *small, "--device-tokens", "1"], capsys,
                      "--device-tokens: expected at least one page (16 tokens), got 1")
    assert_user_error([*command, *small, "--device-tokens", HUGE], capsys, "lower --device-tokens")


# ------------------------------------------------------------------ storage spec
def test_bench_multiturn_checks_the_storage_spec_first(capsys):
    assert_user_error(["bench", "multiturn", "--storage", "bogus:spec"], capsys,
                      "--storage: storage spec: expected 'file:DIR' or 'mooncake://",
                      "got 'bogus:spec'")
    assert_user_error(["bench", "multiturn", "--storage", "mooncake://host-without-port"],
                      capsys, "--storage: storage spec")


def test_bench_multiturn_refuses_a_storage_spec_no_configuration_uses(tmp_path, capsys):
    assert_user_error(["bench", "multiturn", "--storage", f"file:{tmp_path}",
                       "--configs", "none,device"], capsys,
                      "--storage: the third tier of", "--configs runs only none,device")


# ------------------------------------------------------------------ traces
@pytest.mark.parametrize("command", [
    ["replay", "{t}", "--device-tokens", "64"],
    ["trace", "stats", "{t}"],
    ["bench", "tiers", "{t}"],
    ["bench", "multiturn", "--trace", "{t}"],
])
def test_an_empty_trace_is_a_mistake(command, empty_trace, capsys):
    argv = [a.format(t=empty_trace) for a in command]
    assert_user_error(argv, capsys, f"{empty_trace}: expected at least one request")


@pytest.mark.parametrize("command", [
    ["replay", "{t}", "--device-tokens", "64"],
    ["trace", "stats", "{t}"],
    ["bench", "multiturn", "--trace", "{t}"],
])
def test_a_non_utf8_trace_names_the_file_and_line(command, binary_trace, capsys):
    argv = [a.format(t=binary_trace) for a in command]
    assert_user_error(argv, capsys, f"{binary_trace}:2: expected UTF-8 text (JSON Lines), "
                      "got byte 0xe9")


# ------------------------------------------------------------------ bugs stay bugs
def _args() -> argparse.Namespace:
    return argparse.Namespace()


@pytest.mark.parametrize("error", [ValueError("an internal check"), TypeError("a bad call")])
def test_run_guarded_lets_internal_errors_through(error, capsys):
    def run(_args):
        raise error

    with pytest.raises(type(error), match=str(error)):
        run_guarded(run, _args(), "hicache x")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("error", [UsageError("--x: expected 1, got 2"),
                                   FileNotFoundError(2, "No such file or directory", "t.jsonl")])
def test_run_guarded_reports_mistakes_in_one_line(error, capsys):
    def run(_args):
        raise error

    assert run_guarded(run, _args(), "hicache x") == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache x: error: ") and err.count("\n") == 1


def test_a_bug_inside_a_command_is_a_traceback(trace, monkeypatch):
    """A ValueError raised by the work itself (not by a check of the user's input) used
    to be printed as a one-line "mistake" with exit status 2."""
    from hicache.cli import replay

    def broken(*_a, **_k):
        raise ValueError("replay_device: internal invariant broken")

    monkeypatch.setattr(replay, "replay_device", broken)
    with pytest.raises(ValueError, match="internal invariant broken"):
        cli.main(["replay", trace, "--device-tokens", "64"])


# ------------------------------------------------------------------ progress
def test_bench_multiturn_shows_progress_per_configuration(capsys):
    rc, out, _ = run_cli(["bench", "multiturn", "--preset", "tiny", "--sessions", "2",
                          "--turns", "2", "--system-tokens", "32", "--first-turn-tokens", "16"],
                         capsys)
    assert rc == 0
    lines = out.splitlines()
    # Off a terminal (here) the bar is one line per finished configuration, in order.
    done = [line.split()[0] for line in lines if "4/4 requests" in line]
    assert done == ["none", "device", "hierarchical"], out
    assert json.loads(lines[-1])["num_requests"] == 4
    rc, out, _ = run_cli(["bench", "multiturn", "--preset", "tiny", "--sessions", "2",
                          "--turns", "2", "--system-tokens", "32", "--first-turn-tokens", "16",
                          "--json"], capsys)
    assert rc == 0 and len(out.splitlines()) == 1  # --json: no progress on stdout
