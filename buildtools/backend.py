"""PEP 517 backend: setuptools, plus torch in the build environment.

The C++ extension is compiled against torch's headers and must be loaded by the
same torch version. In an isolated build (plain ``pip install .``) the build
environment starts empty, so this asks for the torch version installed in the
target environment (the interpreter pip runs for), or any torch if there is
none. ``pip install --no-build-isolation`` (what ``make install`` does) uses the
environment's own torch and needs nothing extra.
"""

from __future__ import annotations

import os
import subprocess
import sys

from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F403  (the hooks this module does not change)


def _torch_requirement() -> list[str]:
    try:
        import torch  # noqa: F401  (already here: no isolation, or the caller provided it)

        return []
    except ImportError:
        pass
    # -I: ignore PYTHONPATH (pip points it at the isolated environment) and user
    # site-packages, so the child sees the target environment's packages.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    try:
        found = subprocess.run(
            [sys.executable, "-I", "-c",
             "import importlib.metadata as m; print(m.version('torch'))"],
            capture_output=True, text=True, timeout=60, env=env, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ["torch"]
    version = found.stdout.strip()
    return [f"torch=={version}"] if found.returncode == 0 and version else ["torch"]


def get_requires_for_build_wheel(config_settings=None):
    return _meta.get_requires_for_build_wheel(config_settings) + _torch_requirement()


def get_requires_for_build_editable(config_settings=None):
    return _meta.get_requires_for_build_editable(config_settings) + _torch_requirement()
