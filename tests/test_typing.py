"""The type checker's configuration: strict where the public API is defined, and run by
`make lint`, which CI runs (the check itself is mypy's, over hicache/)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
from optional_vllm import vllm_available

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# The packages whose __all__ is the public API.
PUBLIC = ["hicache", "hicache.cache", "hicache.memory", "hicache.storage", "hicache.transfer",
          "hicache.tree", "hicache.integrations.vllm", "hicache.cli"]


def _strict_patterns() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    strict = [o for o in config["tool"]["mypy"]["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1, "expected one strict override section in [tool.mypy]"
    assert strict[0]["disallow_incomplete_defs"] and strict[0]["warn_return_any"]
    return strict[0]["module"]


def _is_strict(module: str, patterns: list[str]) -> bool:
    """As mypy matches overrides: ``a.*`` is ``a`` and every module under it."""
    return any(module == p.removesuffix(".*") or (p.endswith(".*") and module.startswith(p[:-1]))
               for p in patterns)


def test_every_module_defining_a_public_name_is_checked_strictly():
    patterns = _strict_patterns()
    loose = []
    for package in PUBLIC:
        if package == "hicache.integrations.vllm" and not vllm_available():
            continue  # its names are vLLM classes' subclasses: they need vLLM to exist
        mod = importlib.import_module(package)
        assert _is_strict(package, patterns), f"{package}: its __init__ is not strict"
        for name in mod.__all__:
            obj = getattr(mod, name)
            where = getattr(obj, "__module__", None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and where and (
                where.startswith("hicache") and not _is_strict(where, patterns)
            ):
                loose.append(f"{package}.{name} (defined in {where})")
    assert loose == []


def test_the_strict_list_names_only_modules_that_exist():
    for pattern in _strict_patterns():
        path = ROOT / pattern.removesuffix(".*").replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), pattern


def test_make_lint_runs_ruff_and_mypy_and_ci_runs_it():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    lint = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert lint is not None, "no lint target"
    assert "ruff check hicache tests bench" in lint.group(1)
    assert "-m mypy" in lint.group(1)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make lint$", ci, re.M), ".ci/run does not run `make lint`"


def _third_party_imports() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "hicache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "hicache"}


def test_mypy_passes_without_the_optional_dependencies():
    """CI's `make lint` runs before vLLM and Mooncake are installed: an import of an
    optional package mypy is not told to ignore fails lint there and nowhere else."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    required = {re.split(r"[<>=!~ ;\[]", d)[0] for d in config["project"]["dependencies"]}
    ignored = {m.removesuffix(".*") for o in config["tool"]["mypy"]["overrides"]
               if o.get("ignore_missing_imports") for m in o["module"]}
    assert "vllm" in _third_party_imports()  # the scan sees the optional imports
    assert sorted(_third_party_imports() - required - ignored) == []
