"""One set of validators (hicache/checks.py): their messages, and that the config, the
connector config, the config files, the trace reader and the CLI use them instead of
their own copies."""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path

import pytest

from hicache import EvictionPolicy
from hicache.checks import (
    check_bounds,
    check_choice,
    check_device,
    check_enum,
    check_finite,
    check_int,
    check_number,
    parse_text,
)
from hicache.cli import args as cliargs

PACKAGE = Path(__file__).resolve().parents[1] / "hicache"


@pytest.mark.parametrize("call, error, message", [
    (lambda: check_bounds("x", 0, minimum=0, strict=True), ValueError, "x: expected > 0, got 0"),
    (lambda: check_bounds("x", 5.0, maximum=4.0, max_included=True), ValueError,
     "x: expected <= 4, got 5.0"),
    (lambda: check_bounds("x", 2**32, maximum=4.0 * 2**30), ValueError,
     "x: expected < 4294967296, got 4294967296"),
    (lambda: check_bounds("", 0, minimum=1, what="an integer", shown="0"), ValueError,
     "expected an integer >= 1, got 0"),
    (lambda: check_int("n", 1.5), TypeError, "n: expected int, got float"),
    (lambda: check_int("n", "3", what="an int", show_value=True), TypeError,
     "n: expected an int, got '3'"),
    (lambda: check_int("n", True), TypeError, "n: expected int, got bool"),
    (lambda: check_int("n", -1), ValueError, "n: expected >= 0, got -1"),
    (lambda: check_number("r", "1"), TypeError, "r: expected a number, got str"),
    (lambda: check_finite("r", math.nan), ValueError, "r: expected a finite number, got nan"),
    (lambda: check_choice("c", "x", ("a", "b")), ValueError, "c: expected one of ['a', 'b'], got 'x'"),
    (lambda: check_enum(EvictionPolicy, "eviction", "random"), ValueError,
     "eviction: expected one of ['lru', 'lfu', 'fifo', 'mru', 'filo', 'priority', 'slru'], "
     "got 'random'"),
    (lambda: check_device("tpu"), ValueError, "device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (lambda: check_device(0, name=""), TypeError, "expected str, got int"),
    (lambda: parse_text("V: f", "many", int), ValueError, "V: f: expected an integer, got 'many'"),
    (lambda: parse_text("V: f", "x", float), ValueError, "V: f: expected a number, got 'x'"),
    (lambda: parse_text("V: f", "maybe", bool), ValueError, "V: f: expected true or false, got 'maybe'"),
    (lambda: parse_text("V: f", "{", dict), ValueError, "V: f: expected JSON, got '{'"),
    (lambda: parse_text("V: f", "1,x", list), ValueError, "V: f: expected a list of ints, got '1,x'"),
])
def test_each_check_names_the_value_what_was_expected_and_what_came(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def test_checks_return_the_checked_value():
    assert check_bounds("x", 3, minimum=1, maximum=4) == 3
    assert check_enum(EvictionPolicy, "eviction", "lru") is EvictionPolicy.LRU
    assert check_device("cuda:1") == "cuda:1"
    assert parse_text("v", " 1_000 ", int) == 1000
    assert parse_text("v", "on", bool) is True
    assert parse_text("v", "[1, 2]", list) == [1, 2] == parse_text("v", "1,2", list)
    assert parse_text("v", '{"a": 1}', dict) == {"a": 1}


def test_cli_option_types_read_through_the_checks():
    assert cliargs.positive_int("4") == 4 and cliargs.nonneg_float("0") == 0.0
    for parse, text, message in [
        (cliargs.positive_int, "0", "expected an integer > 0, got 0"),
        (cliargs.positive_int, "x", "expected an integer, got 'x'"),
        (cliargs.nonneg_int, "-2", "expected an integer >= 0, got -2"),
        (cliargs.positive_float, "-1", "expected a number > 0, got -1"),
        (cliargs.positive_float, "inf", "expected a finite number, got 'inf'"),
        (cliargs.device, "gpu", "expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as info:
            parse(text)
        assert str(info.value) == message


def test_bench_multiturn_bounds_are_usage_errors_with_their_messages():
    from hicache.cli.benchmarks import multiturn

    args = argparse.Namespace(storage_host_tokens=64, page_size=16, prefetch_timeout_s=-1.0,
                              storage=None, prefetch_policy="best_effort", lookahead=0)
    with pytest.raises(cliargs.UsageError, match=r"^--prefetch-timeout-s: expected >= 0, got -1.0$"):
        multiturn.storage_setup(args, [], 1024)


# Helpers that were copies of a check in hicache/checks.py; a new one would be a sixth set.
_DUPLICATES = {"_plain", "_enum", "check_device", "_check_number"}


def test_no_module_defines_its_own_copy_of_a_shared_check():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "checks.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name in _DUPLICATES:
                found.append(f"{path.relative_to(PACKAGE.parent)}: {node.name}")
    assert found == []
