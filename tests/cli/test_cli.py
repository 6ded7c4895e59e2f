"""The command line's contract, per command: a user's mistake is one line on stderr and exit
status 2 (no traceback, checked before the work starts); ``--json`` is one JSON line on stdout;
``--version``; help text that is plain, complete and cites only shipped files."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from cli_runs import assert_user_error, run_cli

from hicache.cli import app as cli
from hicache.cli.trace import _KIND_HELP
from hicache.sim.replay import prepare_requests, replay_hicache_device_only

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cli") / "small.jsonl"
    assert cli.main(["trace", "make", "agentic", "--sessions", "6", "--turns", "3",
                     "--num-system-prompts", "2", "--system-tokens", "64", "-o", str(path)]) == 0
    return str(path)


@pytest.fixture
def no_matplotlib(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))


def test_version(capsys):
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.strip() == "hicache 0.1.0"


# ------------------------------------------------------------------ replay
@pytest.mark.parametrize("argv, expected", [
    (["/no/such/trace.jsonl", "--device-tokens", "64"], "No such file or directory"),
    (["{trace}", "--device-tokens", "64", "--host-tokens", "3"],
     "--host-tokens: expected at least one page (16 tokens), got 3"),
    (["{trace}", "--device-tokens", "8"], "--device-tokens: expected at least one page"),
    (["{trace}", "--device-tokens", "0"], "--device-tokens: expected an integer > 0, got 0"),
    (["{trace}", "--device-tokens", "64", "--page-size", "-1"], "--page-size"),
    (["{trace}", "--device-tokens", "64", "--plot", "x.png"], "--plot draws a --sweep-host"),
    (["{trace}", "--device-tokens", "64", "--sweep-host", "1,x"], "comma-separated"),
    (["{trace}", "--device-tokens", "64", "--sweep-host", "8"], "--sweep-host: expected 0"),
    (["{trace}", "--device-tokens", "64", "--sweep-host", "0", "--host-tokens", "64"],
     "--sweep-host replaces --host-tokens"),
    (["{bad}", "--device-tokens", "64"], "bad.jsonl:2: expected one JSON object per line"),
])
def test_replay_user_errors(argv, expected, small_trace, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(small_trace).read_text().splitlines()[0] + "\n{oops\n")
    argv = [a.format(trace=small_trace, bad=bad) for a in argv]
    assert_user_error(["replay", *argv], capsys, expected)


def test_replay_plot_without_matplotlib_fails_before_the_work(small_trace, no_matplotlib,
                                                             tmp_path, capsys):
    plot = tmp_path / "curve.png"
    assert_user_error(["replay", small_trace, "--device-tokens", "256", "--sweep-host", "0,512",
                       "--plot", str(plot)], capsys, "--plot needs matplotlib")
    assert not plot.exists()


def test_replay_sweep_accepts_zero_as_the_device_only_baseline(small_trace, capsys):
    rc, out, _ = run_cli(["replay", small_trace, "--device-tokens", "256",
                          "--sweep-host", "0,4096", "--json"], capsys)
    assert rc == 0
    rows = json.loads(out)["sweep"]
    assert [r["host_tokens"] for r in rows] == [0, 4096]
    assert rows[0]["host_hit_tokens"] == 0 and rows[1]["host_hit_tokens"] > 0
    baseline = replay_hicache_device_only(prepare_requests(small_trace, 16), 16, 256, "auto")
    assert rows[0]["hit_ratio"] == round(baseline.hit_ratio, 6)


# ------------------------------------------------------------------ trace
@pytest.mark.parametrize("argv, expected", [
    (["make", "agentic", "--sessions", "0"],
     "agentic: expected a trace of at least one request, got none (from num_sessions=0)"),
    (["make", "noreuse", "--requests", "0"], "expected a trace of at least one request"),
    (["make", "agentic", "--jitter", "2"], "jitter: expected a fraction in [0, 1)"),
    (["make", "agentic", "--sessions", "-1"], "--sessions: expected an integer >= 0"),
    (["make", "mcts", "--order", "zigzag"], "--order: invalid choice"),
    (["make", "agentic", "--rate", "inf"], "--rate: expected a finite number"),
    (["stats", "/no/such/trace.jsonl"], "No such file or directory"),
    (["stats", "{trace}", "--page-size", "0"], "--page-size: expected an integer > 0"),
])
def test_trace_user_errors(argv, expected, small_trace, capsys):
    argv = [a.format(trace=small_trace) for a in argv]
    assert_user_error(["trace", *argv], capsys, expected)


# ------------------------------------------------------------------ stress
@pytest.mark.parametrize("argv, expected", [
    (["--seconds", "0"], "--seconds: expected a number > 0, got 0"),
    (["--seconds", "-1"], "--seconds: expected a number > 0, got -1"),
    (["--seconds", "nan"], "--seconds: expected a finite number, got 'nan'"),
    (["--concurrency", "0"], "--concurrency: expected an integer > 0, got 0"),
    (["--conversations", "0"], "--conversations: expected an integer > 0, got 0"),
    (["--verify-every", "0"], "--verify-every: expected an integer > 0, got 0"),
    (["--device-pages", "1"], "--device-pages: expected at least 27 (the pages of the longest "
     "request, 107 tokens), got 1"),
    (["--fault-rate", "2"], "--fault-rate: expected a probability in [0, 1], got 2"),
    (["--max-delay-ms", "-1"], "--max-delay-ms: expected a number >= 0"),
    (["--components", "window"], "components: expected 'window:TOKENS[xWIDTH]'"),
    (["--components", "window:9,state", "--device-pages", "56"], "--device-pages: expected "
     "at least 57 (the pages of the longest request, 107 tokens), got 56"),
])
def test_stress_user_errors(argv, expected, capsys):
    assert_user_error(["stress", *argv], capsys, expected)


def test_stress_json_is_one_line(capsys):
    rc, out, _ = run_cli(["stress", "--seconds", "0.3", "--json"], capsys)
    assert rc == 0
    assert len(out.splitlines()) == 1 and json.loads(out)["requests"] > 0


# ------------------------------------------------------------------ bench
_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@pytest.mark.parametrize("argv, expected", [
    (["transfer", "--total-mib", "-4"], "--total-mib: expected an integer > 0, got -4"),
    (["transfer", "--page-kib", "3"], "--page-kib: expected multiples of 2, got 3"),
    (["transfer", "--repeats", "0"], "--repeats: expected an integer > 0"),
    pytest.param(["transfer", "--device", "cuda"], "CUDA is not available here", marks=_NO_CUDA),
    (["recompute", "--tokens", "17"], "--tokens: expected positive multiples of the page size"),
    (["recompute", "--dtype", "int4"], "dtype: expected one of"),
    (["recompute", "--preset", "tiny-hybrid", "--page-size", "4", "--tokens", "16"],
     "--page-size: page_size: a linear layer's state takes 8"),
    pytest.param(["recompute", "--device", "cuda:0"], "CUDA is not available", marks=_NO_CUDA),
    (["multiturn", "--requests", "0"], "--requests: expected an integer > 0"),
    (["multiturn", "--sessions", "0"], "--sessions: expected an integer > 0"),
    (["multiturn", "--configs", "none,disk"], "--configs"),
    (["multiturn", "--trace", "/no/such/trace.jsonl"], "No such file or directory"),
    pytest.param(["multiturn", "--device", "cuda"], "CUDA is not available", marks=_NO_CUDA),
    (["tiers", "/no/such/trace.jsonl"], "No such file or directory"),
    (["tiers", "{trace}", "--device-fraction", "1.5"], "--device-fraction: expected a fraction"),
    (["tiers", "{trace}", "--repeats", "0"], "--repeats: expected an integer > 0"),
])
def test_bench_user_errors(argv, expected, small_trace, capsys):
    argv = [a.format(trace=small_trace) for a in argv]
    assert_user_error(["bench", *argv], capsys, expected)


def test_bench_tiers_json_is_one_line(small_trace, capsys):
    rc, out, _ = run_cli(["bench", "tiers", small_trace, "--repeats", "1", "--json"], capsys)
    assert rc == 0
    assert len(out.splitlines()) == 1 and "hierarchical" in json.loads(out)["configs"]


# ------------------------------------------------------------------ demo
@pytest.mark.parametrize("argv, expected", [
    (["--threads", "0"], "--threads: expected an integer > 0"),
    (["--requests", "0"], "--requests: expected an integer > 0"),
    (["--turns", "0"], "--turns: expected an integer > 0"),
    (["--page-size", "x"], "--page-size: expected an integer, got 'x'"),
])
def test_demo_user_errors(argv, expected, capsys):
    assert_user_error(["demo", *argv], capsys, expected)


def test_demo_plot_without_matplotlib_fails_before_the_work(no_matplotlib, tmp_path, capsys):
    assert_user_error(["demo", "--plot", str(tmp_path / "t.png")], capsys,
                      "--plot needs matplotlib")


# ------------------------------------------------------------------ --json everywhere
def test_json_is_exactly_one_line_on_stdout(small_trace, capsys):
    for argv in (
        ["replay", small_trace, "--device-tokens", "256", "--json"],
        ["replay", small_trace, "--device-tokens", "256", "--host-tokens", "1024", "--json"],
        ["replay", small_trace, "--device-tokens", "256", "--sweep-host", "0,1024", "--json"],
        ["trace", "stats", small_trace, "--json"],
        ["demo", "--preset", "tiny", "--sessions", "2", "--turns", "2", "--system-prompts", "1",
         "--system-tokens", "32", "--first-turn-tokens", "16", "--json"],
    ):
        rc, out, _ = run_cli(argv, capsys)
        assert rc == 0 and len(out.splitlines()) == 1, (argv, out)
        assert isinstance(json.loads(out), dict)


# ------------------------------------------------------------------ help
def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command line, each with its command's module imported."""
    names = [[c[0]] for c in cli._COMMANDS] + [["bench", b[0]] for b in cli._BENCHES]
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found.setdefault(parser.prog, parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    for argv in names:
        walk(cli.build_parser(argv))
    return sorted(found.items())


def test_help_is_plain_complete_and_cites_only_shipped_files():
    parsers = _parsers()
    progs = [p for p, _ in parsers]
    assert "hicache trace make agentic" in progs and "hicache bench tiers" in progs
    for prog, parser in parsers:
        text = parser.format_help()
        for bad in ("``", ":class:", ":func:", ":mod:", "(default: None)", "WORKLOADS.md",
                    "../shared", "/work/"):
            assert bad not in text, (prog, bad)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help and len(action.help) > 3, (prog, action.dest)
    for cited in ("docs/workloads.md",):
        assert (ROOT / cited).is_file()


def test_trace_kinds_have_whole_sentences_as_help():
    make = dict(_parsers())["hicache trace make"]
    sub = next(a for a in make._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert helps == _KIND_HELP


def test_only_the_command_line_imports_the_command_line():
    """Dependencies point one way, cli -> sim -> library: no module outside hicache/cli/
    imports hicache.cli (the simulation code keeps no parsers or printing of its own)."""
    package = ROOT / "hicache"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{rel}:{node.lineno} {n}" for n in names
                          if n == "hicache.cli" or n.startswith("hicache.cli.")]
    assert offenders == []
