"""examples/quickstart.py runs (CPU-sized), shows a host hit, matches a cache-free run, and
is what README.md shows."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def _load():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_runs_with_a_host_hit_and_the_right_tokens(capsys):
    threads = torch.get_num_threads()
    try:
        assert _load().main(["--max-new-tokens", "4"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    c_line = next(line for line in out.splitlines() if line.startswith("request C"))
    found = re.search(r"(\d+) found on the device, (\d+) loaded from host memory", c_line)
    device_hits, host_hits = map(int, found.groups())
    assert device_hits + host_hits == 256 and host_hits > 0
    assert "C's tokens match a run without the cache" in out


def test_readme_shows_the_quickstart_core():
    source = QUICKSTART.read_text()
    core = source.split("# --8<-- [start:generate]\n")[1].split("# --8<-- [end:generate]")[0]
    readme = ROOT.joinpath("README.md").read_text()
    assert core.strip() in readme
    assert "examples/quickstart.py" in readme
