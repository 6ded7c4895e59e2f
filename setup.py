"""Install-time build of the C++ extension (``hicache.native._native``); metadata is in pyproject.toml.

``make install`` and ``pip install .`` compile ``hicache/native/csrc`` here, once, so
that no process has to compile at run time. Next to the module goes
``_native_build.json``: the digest of the sources' contents and the torch
version it was built from. ``hicache/native/build.py`` loads the module only while both
still match and otherwise falls back to a JIT build (a checkout whose
``csrc/`` changed after install). The extension is optional: without torch at
build time or without a compiler the install still succeeds, with a message,
and the JIT build (or the Python fallbacks) takes over.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
SOURCES = ["hicache/native/csrc/tree.cpp", "hicache/native/csrc/lifecycle.cpp", "hicache/native/csrc/bindings.cpp"]


def _jit_module():
    """hicache/native/build.py loaded on its own (the package's __init__ imports more than torch)."""
    spec = importlib.util.spec_from_file_location("_hicache_jit", HERE / "hicache" / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _native_build():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.stderr.write(
            "hicache: torch is not importable at build time; the native extension "
            "will be compiled on first use instead\n"
        )
        return [], {}

    class BuildNative(BuildExtension):
        """Compiles the extension, announces how long it took, records its build info."""

        def build_extension(self, ext):
            sys.stderr.write("hicache: compiling the native extension (about a minute)...\n")
            start = time.perf_counter()
            super().build_extension(ext)
            seconds = time.perf_counter() - start
            out = Path(self.get_ext_fullpath(ext.name))
            info = _jit_module().build_info(HERE / "hicache" / "native" / "csrc")
            info["build_seconds"] = round(seconds, 1)  # reported, not compared
            (out.parent / "_native_build.json").write_text(json.dumps(info) + "\n")
            sys.stderr.write(f"hicache: native extension built in {seconds:.1f} s\n")

        def copy_extensions_to_source(self):
            # Editable installs (make install) copy the module into hicache/; its
            # build info must go with it.
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
                info = Path(regular_file).parent / "_native_build.json"
                if info.exists():
                    self.copy_file(str(info), str(Path(inplace_file).parent / info.name))

    ext = CppExtension(
        "hicache.native._native",
        SOURCES,
        extra_compile_args=["-O3", "-std=c++20"],
        # A failed compile (no compiler, an old one) warns and installs the rest:
        # the Python tree and the numpy allocator are the fallbacks.
        optional=True,
    )
    return [ext], {"build_ext": BuildNative}


ext_modules, cmdclass = _native_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
