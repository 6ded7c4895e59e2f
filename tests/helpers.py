"""Compatibility: every name test modules once imported from here, re-exported.

The helpers now live in modules named by subject; new tests import from those:

* ``kv_layouts``: ``TREE_KINDS``, ``P``, ``KV``, ``KV_TINY``, ``pages``, ``seq``;
* ``leak_checks``: ``assert_no_leaks``, ``finish_transfers``, ``assert_quiescent``;
* ``serving``: ``bookkeeping``, ``serve``, ``expected_kv``, ``compute``, ``read_prefix``,
  ``serve_kv``;
* ``tree_observation``: ``FORMS``, ``as_form``, ``snapshot``,
  ``host_takeable_by_definition``;
* ``cuda_streams``: ``CUDA_AVAILABLE``, ``DEVICES``, ``stall_stream``;
* ``optional_vllm``: ``VLLM_REQUIRED``, ``vllm_available``;
* ``tests/cache/manual_executor.py``: ``KV_F16``, ``make_cache``, ``pending``, ``complete``,
  ``verify_prefix``, ``serve_manual``, ``evict_all_device``, ``settle``, ``host_only``;
* ``tests/storage/engine_processes.py``: ``ENGINE_PAGE_SIZE``, ``ENGINE_MAX_NEW_TOKENS``,
  ``ENGINE_WORKER_SCRIPT``, ``run_engine_process``, ``shared_prompts``,
  ``no_cache_tokens``, ``assert_second_process_reuses_first``;
* ``tests/integrations/vllm_processes.py``: ``VLLM_DRIVER``, ``run_vllm``, ``vllm_result``.

The modules of ``tests/`` are importable from every folder (pytest puts ``tests/`` on
``sys.path`` for ``tests/conftest.py``); a folder's own module is importable from that
folder's tests. This module also makes the three folder modules importable from
anywhere, by appending their folders to ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Appended, not prepended: a folder pytest already put first keeps its place, and the
# folders' module names cannot shadow an installed package.
for _folder in ("", "cache", "storage", "integrations"):
    _path = str(Path(__file__).parent / _folder)
    if _path not in sys.path:
        sys.path.append(_path)

from cuda_streams import CUDA_AVAILABLE, DEVICES, stall_stream  # noqa: E402
from engine_processes import (  # noqa: E402
    ENGINE_MAX_NEW_TOKENS,
    ENGINE_PAGE_SIZE,
    ENGINE_WORKER_SCRIPT,
    assert_second_process_reuses_first,
    no_cache_tokens,
    run_engine_process,
    shared_prompts,
)
from kv_layouts import KV, KV_TINY, TREE_KINDS, P, pages, seq  # noqa: E402
from leak_checks import assert_no_leaks, assert_quiescent, finish_transfers  # noqa: E402
from manual_executor import (  # noqa: E402
    KV_F16,
    complete,
    evict_all_device,
    host_only,
    make_cache,
    pending,
    serve_manual,
    settle,
    verify_prefix,
)
from optional_vllm import VLLM_REQUIRED, vllm_available  # noqa: E402
from serving import (  # noqa: E402
    bookkeeping,
    compute,
    expected_kv,
    read_prefix,
    serve,
    serve_kv,
)
from tree_observation import (  # noqa: E402
    FORMS,
    as_form,
    host_takeable_by_definition,
    snapshot,
)
from vllm_processes import VLLM_DRIVER, run_vllm, vllm_result  # noqa: E402

__all__ = [
    "CUDA_AVAILABLE", "DEVICES", "ENGINE_MAX_NEW_TOKENS", "ENGINE_PAGE_SIZE",
    "ENGINE_WORKER_SCRIPT", "FORMS", "KV", "KV_F16", "KV_TINY", "P", "TREE_KINDS",
    "VLLM_DRIVER", "VLLM_REQUIRED", "as_form", "assert_no_leaks", "assert_quiescent",
    "assert_second_process_reuses_first", "bookkeeping", "complete", "compute",
    "evict_all_device", "expected_kv", "finish_transfers", "host_only",
    "host_takeable_by_definition", "make_cache", "no_cache_tokens", "pages", "pending",
    "read_prefix", "run_engine_process", "run_vllm", "seq", "serve", "serve_kv",
    "serve_manual", "settle", "shared_prompts", "snapshot", "stall_stream",
    "verify_prefix", "vllm_available", "vllm_result",
]
