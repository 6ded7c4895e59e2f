"""The package's boundaries: what ``import hicache`` loads, and which way imports point.

The import graph is read from the sources with :mod:`ast`, so it holds every import:
module level, inside functions and under ``if TYPE_CHECKING:``. A circle closed only
through a function-level or annotation-only import is still a circle: the two modules
cannot be understood, tested or moved apart.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hicache"

# The harness, the command line and the real models and data sets sit on top of the
# library; nothing below them imports them.
ABOVE_THE_LIBRARY = ("hicache.sim", "hicache.cli", "hicache.testing", "hicache.realdata")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the hicache modules it imports anywhere in its source.

    ``from hicache.a import b`` points at ``hicache.a.b`` when that is a module, else
    at ``hicache.a`` (a name defined there); parent packages that Python imports on
    the way are not counted: they are what ``hicache.a``'s own imports say."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
            else:
                continue
            deps |= {r for t in targets if t.startswith("hicache") and (r := resolve(t))}
        deps.discard(name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_circle_finder_finds_circles_through_any_kind_of_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_and_type_checking_imports():
    graph = import_graph()
    # hicache/cache/loads.py imports the in-flight table under TYPE_CHECKING, and
    # hicache/tree/factory.py the native tree inside make_tree.
    assert "hicache.cache.inflight" in graph["hicache.cache.loads"]
    assert "hicache.tree.native" in graph["hicache.tree.factory"]


def test_no_import_circle_between_hicache_modules():
    assert [sorted(c) for c in circles(import_graph())] == []


def test_the_library_imports_neither_the_harness_nor_the_cli():
    graph = import_graph()
    offenders = {
        (module, dep)
        for module, deps in graph.items()
        if not module.startswith(ABOVE_THE_LIBRARY)
        for dep in deps
        if dep.startswith(ABOVE_THE_LIBRARY)
    }
    # hicache/__init__.py names the simulator's Engine, Model and preset only as lazy
    # attributes (PEP 562 __getattr__, through importlib) and under TYPE_CHECKING.
    assert offenders == {("hicache", "hicache.sim.engine"), ("hicache", "hicache.sim.model")}


def test_the_connectors_halves_import_only_what_they_share():
    """vLLM runs the scheduler half and the worker half in different processes: neither
    imports the other's folder, and what both import (common/) imports neither."""
    vllm = "hicache.integrations.vllm"
    graph = import_graph()
    sides = {"scheduler": f"{vllm}.scheduler", "worker": f"{vllm}.worker",
             "common": f"{vllm}.common"}
    allowed = {"scheduler": {"scheduler", "common"}, "worker": {"worker", "common"},
               "common": {"common"}}
    crossings = set()
    for module, deps in graph.items():
        side = next((s for s, prefix in sides.items() if module.startswith(prefix)), None)
        if side is None:
            continue
        for dep in deps:
            dep_side = next((s for s, prefix in sides.items() if dep.startswith(prefix)), None)
            if dep.startswith(vllm) and dep_side not in allowed[side]:
                crossings.add((module, dep))
    assert crossings == set()
    assert {m for m in graph if m.startswith(f"{vllm}.scheduler.")} and \
        {m for m in graph if m.startswith(f"{vllm}.worker.")}


def test_only_the_cli_uses_the_real_models_and_data_sets():
    """hicache/realdata/ (pip, conversions, data sets) is for the command line, the
    benchmarks and the tests; it imports nothing above the library itself."""
    graph = import_graph()
    users = {m for m, deps in graph.items() if not m.startswith("hicache.realdata")
             and any(d.startswith("hicache.realdata") for d in deps)}
    assert users and all(m.startswith("hicache.cli") for m in users)
    above = {d for m, deps in graph.items() if m.startswith("hicache.realdata")
             for d in deps if d.startswith(ABOVE_THE_LIBRARY) and
             not d.startswith("hicache.realdata")}
    assert above == set()


def test_the_mooncake_launcher_is_a_testing_module():
    assert not (PACKAGE / "storage" / "mooncake_master.py").exists()
    graph = import_graph()
    users = {m for m, deps in graph.items() if "hicache.testing.mooncake_master" in deps}
    assert users and all(m.startswith(("hicache.cli", "hicache.testing")) for m in users)


def _loaded_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}; import json, sys; "
         "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hicache'))))"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_hicache_loads_neither_the_simulator_nor_the_cli():
    loaded = _loaded_after("import hicache")
    assert "hicache.cache" in loaded  # the library itself is there
    assert [m for m in loaded if m.startswith(ABOVE_THE_LIBRARY + ("hicache.integrations",))] == []


def test_simulator_names_resolve_on_first_use():
    loaded = _loaded_after("import hicache; hicache.Engine; from hicache import Model, preset")
    assert {"hicache.sim.engine", "hicache.sim.model"} <= set(loaded)
    import hicache

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        hicache.Nope  # noqa: B018


# ------------------------------------------------------------------ version
def test_the_version_has_one_source():
    """pyproject.toml's ``version``; hicache.__version__ and ``hicache --version`` read it
    from the installed metadata, and no module writes a version literal of its own."""
    import importlib.metadata

    import hicache

    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert hicache.__version__ == importlib.metadata.version("hicache") == declared
    literal = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if f'"{declared}"' in p.read_text(encoding="utf-8")]
    assert literal == []


def test_the_version_without_metadata_says_unknown():
    code = ("import importlib.metadata as m\n"
            "def missing(name): raise m.PackageNotFoundError(name)\n"
            "m.version = missing\n"
            "import hicache; print(hicache.__version__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "0+unknown"


def test_pyproject_classifiers():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "Typing :: Typed" in project["classifiers"]  # hicache/py.typed ships
    assert (PACKAGE / "py.typed").is_file()
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # SPDX license


def test_no_module_imports_another_modules_private_name():
    """A leading underscore is a module's own: another module importing it couples to an
    internal (a renamed helper would break it silently at import time)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hicache"):
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                          for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


# ------------------------------------------------------------------ module size
MAX_MODULE_LINES = 450  # one concept per module; split a module that grows past this


def test_no_module_is_over_the_size_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in PACKAGE.rglob("*.py")}
    over = {name for name, num_lines in sizes.items() if num_lines > MAX_MODULE_LINES}
    assert sorted(over) == []
