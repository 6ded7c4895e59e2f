"""Install-time builds of the C++ extension (``hicache.native._native``) and the C row
copier (``hicache/memory/_copier*.so``); metadata is in pyproject.toml.

``make install`` and ``pip install .`` compile ``hicache/native/csrc`` here, once, so
that no process has to compile at run time. Next to the module goes
``_native_build.json``: the digest of the sources' contents and the torch
version it was built from. ``hicache/native/build.py`` loads the module only while both
still match and otherwise falls back to a JIT build (a checkout whose
``csrc/`` changed after install). The extension is optional: without torch at
build time or without a compiler the install still succeeds, with a message,
and the JIT build (or the Python fallbacks) takes over.

The C row copier (``hicache/memory/copier.c``) is compiled here too, with the command
its run-time fallback uses (``hicache/buildcache.py``), which builds into the user's
cache only when this library is missing or older than the source. An install also
prunes stale run-time builds from that cache (``buildcache.prune_stale``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.errors import CompileError

HERE = Path(__file__).resolve().parent
SOURCES = ["hicache/native/csrc/tree.cpp", "hicache/native/csrc/components.cpp", "hicache/native/csrc/lifecycle.cpp", "hicache/native/csrc/bindings.cpp"]
COPIER_SOURCE = "hicache/memory/copier.c"
# The package modules hicache/native/build.py imports, loaded on their own first (each
# imports only the standard library).
BUILD_IMPORTS = (("hicache.buildcache", "hicache/buildcache.py"), ("hicache.errors", "hicache/errors.py"))


def _standalone(name: str, relpath: str) -> ModuleType:
    """A module of the package loaded on its own (the package's __init__ imports far
    more than a build has), registered under its name so that another such module
    finds it: hicache/native/build.py imports hicache.buildcache and hicache.errors.
    Nothing here may import the package itself: a fresh build environment has none."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _buildcache() -> ModuleType:
    return _standalone("hicache.buildcache", "hicache/buildcache.py")


def _jit_module() -> ModuleType:
    """hicache/native/build.py (its build info, and where its JIT builds go), after the
    package modules it imports (``BUILD_IMPORTS``)."""
    for name, relpath in BUILD_IMPORTS:
        _standalone(name, relpath)
    return _standalone("_hicache_jit", "hicache/native/build.py")


class CopierLibrary(Extension):
    """The C row copier: a plain shared library that hicache.memory.copier loads with
    ctypes (never imported), compiled with the command of its run-time fallback
    (hicache/buildcache.py), which records the source's digest in it."""


def _build_base() -> type:
    try:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension
    except ImportError:
        from setuptools.command.build_ext import build_ext

        return build_ext


class Build(_build_base()):
    """Compiles the extensions, announces how long the native one took, records its
    build info; then prunes stale run-time builds from the user's cache."""

    def build_extensions(self):
        try:
            super().build_extensions()
        except (OSError, subprocess.SubprocessError) as exc:
            # torch checks the C++ compiler (runs it for its version) before building
            # any extension: without a usable one, install the rest, as a failed
            # optional extension does, and still try the C copier (it needs only cc).
            sys.stderr.write(f"hicache: no usable C++ compiler ({type(exc).__name__}: {exc}); "
                             "the native tree will be built on first use if one appears, "
                             "the Python tree serves meanwhile\n")
            for ext in self.extensions:
                if isinstance(ext, CopierLibrary):
                    try:
                        self._build_copier(ext)
                    except CompileError as copier_exc:
                        sys.stderr.write(f"hicache: {copier_exc}\n")

    def build_extension(self, ext):
        if isinstance(ext, CopierLibrary):
            self._build_copier(ext)
            return
        sys.stderr.write("hicache: compiling the native extension (about a minute)...\n")
        start = time.perf_counter()
        super().build_extension(ext)
        seconds = time.perf_counter() - start
        out = Path(self.get_ext_fullpath(ext.name))
        info = _jit_module().build_info(HERE / "hicache" / "native" / "csrc")
        info["build_seconds"] = round(seconds, 1)  # reported, not compared
        (out.parent / "_native_build.json").write_text(json.dumps(info) + "\n")
        sys.stderr.write(f"hicache: native extension built in {seconds:.1f} s\n")

    def _build_copier(self, ext):
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            _buildcache().compile_copier((HERE / COPIER_SOURCE).read_bytes(), out)
        except subprocess.CalledProcessError as exc:
            # CompileError: an optional extension's failure warns and installs the rest.
            raise CompileError(f"the C copier does not compile:\n{exc.stderr.decode(errors='replace')}") from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise CompileError(f"the C copier does not build: {type(exc).__name__}: {exc}") from exc

    def copy_extensions_to_source(self):
        # Editable installs (make install) copy the modules into hicache/; the native
        # module's build info must go with it.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            info = Path(regular_file).parent / "_native_build.json"
            if info.exists():
                self.copy_file(str(info), str(Path(inplace_file).parent / info.name))

    def run(self):
        super().run()
        try:
            removed = _buildcache().prune_copier_cache((HERE / COPIER_SOURCE).read_bytes())
            if _has_torch():
                removed += _jit_module().prune_build_dirs()
        except Exception as exc:  # a cache we cannot tidy is no reason to fail an install
            sys.stderr.write(f"hicache: stale run-time builds not pruned: {exc}\n")
            return
        for path in removed:
            sys.stderr.write(f"hicache: removed the stale run-time build {path}\n")


@functools.cache
def _has_torch() -> bool:
    try:
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError:
        return False
    return True


def _extensions() -> list[Extension]:
    # Both optional: a failed compile (no compiler, an old one) warns and installs the
    # rest; the JIT builds, the Python tree and the torch copies are the fallbacks.
    copier = CopierLibrary("hicache.memory._copier", [COPIER_SOURCE], optional=True)
    if not _has_torch():
        sys.stderr.write(
            "hicache: torch is not importable at build time; the native extension "
            "will be compiled on first use instead\n"
        )
        return [copier]
    from torch.utils.cpp_extension import CppExtension

    native = CppExtension(
        "hicache.native._native",
        SOURCES,
        extra_compile_args=["-O3", "-std=c++20"],
        optional=True,
    )
    return [native, copier]


setup(ext_modules=_extensions(), cmdclass={"build_ext": Build})
