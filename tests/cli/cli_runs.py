"""``hicache`` run in this process, for the CLI tests (tests/cli only).

:func:`run_cli` returns what a user would see; :func:`assert_user_error` checks the
contract for a user's mistake: exit status 2, one line on stderr, nothing on stdout.
"""

from __future__ import annotations

from hicache.cli import app as cli


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``hicache ARGV``: (exit status, stdout, stderr)."""
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's own exit (usage errors, --help, --version)
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(argv: list[str], capsys, *expected: str) -> str:
    """A mistake refused before any work or output: exit status 2, exactly one line on
    stderr containing each of ``expected``, no traceback; returns that line."""
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2, (argv, rc, out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err  # exactly one line
    assert "Traceback" not in err, err
    assert out == "", out  # refused before any work or output
    for text in expected:
        assert text in err, (text, err)
    return err
