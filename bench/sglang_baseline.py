"""Baseline: SGLang's Python ``RadixCache`` (sglang 0.5.23) replaying a trace.

The regime is the device-tier replay of ``docs/workloads.md``, the same sequence
``hicache replay`` runs, done with SGLang's own API and its paged allocator:

    match_prefix(prompt) -> inc_lock_ref(last node) -> need = len(full) - hit
    -> evict(cached + need - capacity) when over capacity -> alloc(need)
    -> insert(full, prefix indices + new indices) -> free duplicates -> dec_lock_ref

where ``full`` is prompt + output cut to whole pages. Only those calls are timed:
the trace is parsed into ``array('q')`` token lists (what ``RadixKey`` holds)
before the clock starts; cache and allocator are built before it too.

SGLang is not a project dependency. It lives in a bench-only directory
(``.bench-deps/``, see bench/README.md), imported with ``--no-deps``. Its import
chain reaches GPU-only packages that ``RadixCache`` never calls (Triton kernels,
the TVM FFI used by all-reduce kernels, torchvision and IPython used by
multimodal/notebook helpers). Those are replaced by SGLang's own stand-ins from
``sglang/_platform_stubs.py`` (the ones it installs where Triton is missing), and
only for imports made by sglang modules. ``RadixCache``, ``RadixKey``, the
eviction strategies and ``PagedTokenToKVPoolAllocator`` are SGLang's real code;
the script checks they were loaded from the bench directory.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import types
import warnings
from array import array
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.sim.replay import frozen_gc
from hicache.sim.traces import load_trace_arrays

SGLANG_VERSION = "0.5.23"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFAULT_DEPS_DIR = os.path.join(_REPO_ROOT, ".bench-deps")
# Packages on RadixCache's import chain (never on its call path) that need a GPU
# toolchain or drag in a notebook stack.
_STUBBED = ("triton", "tvm_ffi", "torchvision", "IPython")


class Sglang(NamedTuple):
    """The SGLang classes the replay uses."""

    RadixCache: Any
    RadixKey: Any
    CacheInitParams: Any
    MatchPrefixParams: Any
    InsertParams: Any
    EvictParams: Any
    PagedTokenToKVPoolAllocator: Any
    version: str


class _SglangOnlyStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves SGLang's mock modules for ``_STUBBED`` packages, to sglang importers only.

    Other importers (torch, transformers) keep seeing the package as absent, so
    their optional-dependency probes take the path they take without it.
    """

    def __init__(self, mock_module_type: type) -> None:
        self._mock = mock_module_type

    @staticmethod
    def _importer_is_sglang() -> bool:
        frame = sys._getframe(2)
        while frame is not None and ("importlib" in frame.f_code.co_filename
                                     or frame.f_code.co_filename.startswith("<frozen")):
            frame = frame.f_back
        return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("sglang")

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        top = fullname.partition(".")[0]
        if top not in _STUBBED:
            return None
        # a submodule of a stub already handed out is always served
        if fullname != top or self._importer_is_sglang():
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._mock(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _load_platform_stubs(deps_dir: str) -> types.ModuleType:
    """``sglang/_platform_stubs.py`` loaded on its own (``import sglang`` needs it first)."""
    path = os.path.join(deps_dir, "sglang", "_platform_stubs.py")
    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _install_triton_stub(stubs: types.ModuleType) -> None:
    """Run SGLang's Triton stand-in installer, which only acts on Apple-silicon MPS.

    Its platform checks are pointed at a darwin/arm64 view for this one call; its
    MPS-only ``Tensor.to``/``copy_`` patch is skipped (nothing here uses MPS).
    """
    stubs.sys = types.SimpleNamespace(platform="darwin", modules=sys.modules,
                                      meta_path=sys.meta_path)
    stubs.platform = types.SimpleNamespace(machine=lambda: "arm64")
    stubs._patch_non_blocking = lambda: None
    mps_is_available = torch.backends.mps.is_available
    torch.backends.mps.is_available = lambda: True
    try:
        stubs.install_platform_stubs()
    finally:
        torch.backends.mps.is_available = mps_is_available
        stubs.sys, stubs.platform = sys, types.SimpleNamespace(machine=lambda: "")
    assert "triton" in sys.modules, "SGLang's triton stand-in was not installed"


def import_sglang(deps_dir: str) -> Sglang:
    """Import SGLang's RadixCache and paged allocator from ``deps_dir``.

    Raises ``SystemExit`` with the install command when sglang is not there.
    """
    dist = os.path.join(deps_dir, f"sglang-{SGLANG_VERSION}.dist-info")
    if not os.path.isdir(os.path.join(deps_dir, "sglang")) or not os.path.isdir(dist):
        raise SystemExit(
            f"sglang {SGLANG_VERSION} not found in {deps_dir}.\n"
            "Install it there (bench-only, outside the project venv), see bench/README.md:\n"
            f"  .venv/bin/python -m pip install --no-deps --target .bench-deps "
            f"sglang=={SGLANG_VERSION} orjson pybase64 msgspec pillow starlette anyio "
            "pydantic pydantic_core typing_inspection annotated_types pyzmq tqdm dill "
            "transformers==5.19.0 huggingface_hub httpx2 httpcore2 h11 truststore click "
            "regex safetensors tokenizers==0.23.2 pyyaml compressed-tensors==0.18.0 "
            "sentencepiece==0.2.1 loguru gguf")
    sys.path.insert(0, deps_dir)
    stubs = _load_platform_stubs(deps_dir)
    if importlib.util.find_spec("triton") is None:
        _install_triton_stub(stubs)
    sys.meta_path.insert(0, _SglangOnlyStubFinder(stubs._MockModule))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "only CUDA supports AWQ/GGUF" and the like
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    for cls in (RadixCache, PagedTokenToKVPoolAllocator):
        source = sys.modules[cls.__module__].__file__ or ""
        assert os.path.realpath(source).startswith(os.path.realpath(deps_dir)), \
            f"{cls.__name__} came from {source}, not from {deps_dir}"
    version = importlib.metadata.Distribution.at(dist).version
    return Sglang(RadixCache, RadixKey, CacheInitParams, MatchPrefixParams, InsertParams,
                  EvictParams, PagedTokenToKVPoolAllocator, version)


class Prepared(NamedTuple):
    prompt: array  # array('q'), all prompt tokens (match_prefix page-aligns them)
    full: array  # array('q'), prompt + output cut to whole pages
    prompt_len: int


def prepare(trace: str, page_size: int) -> list[Prepared]:
    """Parse the trace into the token containers RadixKey holds (untimed)."""
    prepared = []
    for req in load_trace_arrays(trace):
        full = np.concatenate((req.prompt, req.output)).astype(np.int64)
        full = full[: len(full) // page_size * page_size]
        prepared.append(Prepared(array("q", req.prompt.astype(np.int64).tobytes()),
                                 array("q", full.tobytes()), len(req.prompt)))
    return prepared


class Result(NamedTuple):
    requests: int
    seconds: float  # cache and allocator calls only
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int
    skipped_inserts: int  # requests whose new pages could not be allocated
    cached_tokens: int  # in the tree at the end

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("inf")

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def build_cache(sgl: Sglang, page_size: int, device_tokens: int, eviction: str) -> Any:
    """A RadixCache over a paged allocator of ``device_tokens`` slots, as SGLang pairs them."""
    allocator = sgl.PagedTokenToKVPoolAllocator(
        device_tokens // page_size * page_size, page_size=page_size, dtype=torch.float16,
        device="cpu", kvcache=None, need_sort=False)
    params = sgl.CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=allocator, page_size=page_size,
                                 eviction_policy=eviction)
    return sgl.RadixCache(params)


def replay(sgl: Sglang, requests: list[Prepared], page_size: int, device_tokens: int,
           eviction: str = "lru") -> Result:
    """One timed replay through a fresh cache (docs/workloads.md semantics, device tier).

    Under :func:`hicache.sim.replay.frozen_gc`, as hicache's own replays run.
    """
    with frozen_gc():
        return _replay(sgl, requests, page_size, device_tokens, eviction)


def _replay(sgl: Sglang, requests: list[Prepared], page_size: int, device_tokens: int,
            eviction: str) -> Result:
    cache = build_cache(sgl, page_size, device_tokens, eviction)
    allocator = cache.token_to_kv_pool_allocator
    capacity = device_tokens // page_size * page_size
    RadixKey, MatchPrefixParams = sgl.RadixKey, sgl.MatchPrefixParams
    InsertParams, EvictParams = sgl.InsertParams, sgl.EvictParams
    hit_total = prompt_total = evicted = skipped = 0
    start = time.perf_counter()
    for prompt, full, prompt_len in requests:
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
        hit = match.device_prefix_len
        node = match.last_device_node
        cache.inc_lock_ref(node)
        need = len(full) - hit
        over = cache.evictable_size() + cache.protected_size() + need - capacity
        if over > 0:
            evicted += cache.evict(EvictParams(num_tokens=over)).num_tokens_evicted
        new_indices = allocator.alloc(need)
        if new_indices is None:
            skipped += 1
        else:
            # what the scheduler's prefix_device_indices() hands the request
            prefix_indices = cache.path_device_indices(node)[:hit]
            value = torch.cat((prefix_indices, new_indices))
            cached = cache.insert(InsertParams(key=RadixKey(full), value=value)).prefix_len
            if cached > hit:  # pages the tree already held: free the duplicates
                allocator.free_segment(value[hit:cached], start_pos=hit)
        cache.dec_lock_ref(node)
        hit_total += hit
        prompt_total += prompt_len
    seconds = time.perf_counter() - start
    return Result(len(requests), seconds, prompt_total, hit_total, evicted, skipped,
                  cache.evictable_size() + cache.protected_size())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="trace file (JSON Lines, format: docs/workloads.md)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--device-tokens", type=int, required=True, help="device capacity")
    parser.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--repeats", type=int, default=3, help="timed replays (median quoted)")
    parser.add_argument("--warmup-requests", type=int, default=200,
                        help="requests replayed once, untimed, before the timed runs")
    parser.add_argument("--deps-dir", default=_DEFAULT_DEPS_DIR,
                        help="directory sglang was installed into with --target")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.page_size <= 0 or args.device_tokens < args.page_size or args.repeats <= 0:
        parser.error(f"expected page size > 0, device tokens >= page size, repeats > 0; got "
                     f"{args.page_size}, {args.device_tokens}, {args.repeats}")

    t0 = time.perf_counter()
    sgl = import_sglang(os.path.abspath(args.deps_dir))
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    requests = prepare(args.trace, args.page_size)
    parse_s = time.perf_counter() - t0
    if args.warmup_requests > 0:
        replay(sgl, requests[: args.warmup_requests], args.page_size, args.device_tokens,
               args.eviction)
    runs = [replay(sgl, requests, args.page_size, args.device_tokens, args.eviction)
            for _ in range(args.repeats)]
    assert len({(r.hit_tokens, r.evicted_tokens) for r in runs}) == 1, \
        "replays of one trace disagree: the cache is not deterministic"
    median_s = statistics.median(r.seconds for r in runs)
    r = runs[0]

    print(f"sglang {sgl.version} RadixCache, {args.trace}: page {args.page_size}, "
          f"device {args.device_tokens} tokens, {args.eviction}")
    print(f"(import {import_s:.1f} s, trace parsing {parse_s:.1f} s: untimed)")
    print(f"{'run':>5}{'seconds':>10}{'req/s':>10}")
    for i, run in enumerate(runs):
        print(f"{i:>5}{run.seconds:>10.3f}{run.req_per_s:>10.0f}")
    rows = [("requests", r.requests), ("seconds (median)", f"{median_s:.3f}"),
            ("req/s (median)", f"{r.requests / median_s:.0f}"),
            ("prompt tokens", r.prompt_tokens), ("hit tokens", r.hit_tokens),
            ("hit ratio", f"{r.hit_ratio:.4f}"), ("evicted tokens", r.evicted_tokens),
            ("skipped inserts", r.skipped_inserts), ("cached tokens at end", r.cached_tokens)]
    for name, value in rows:
        print(f"{name:<24}{value:>14}")
    if args.json:
        print(json.dumps({
            "system": f"sglang-{sgl.version}", "requests": r.requests,
            "seconds": round(median_s, 6), "req_per_s": round(r.requests / median_s, 1),
            "prompt_tokens": r.prompt_tokens, "hit_tokens": r.hit_tokens,
            "hit_ratio": round(r.hit_ratio, 6), "evicted_tokens": r.evicted_tokens,
            "skipped_inserts": r.skipped_inserts, "page_size": args.page_size,
            "device_tokens": args.device_tokens, "repeats": args.repeats,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
