"""hicache's counters on vLLM's Prometheus metrics: the connector's stats of real vLLM
scheduler steps (vllm_sched.py), recorded by vLLM's own ``PrometheusStatLogger`` into
the default registry, read back from its text exposition. Skipped without vLLM unless
``HICACHE_REQUIRE_VLLM=1``."""

from __future__ import annotations

import dataclasses
import random

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm]') not installed",
)


def _scrape() -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def test_every_counter_the_halves_report_has_a_metric():
    from hicache.integrations.vllm.prom import METRICS, metric_keys
    from hicache.integrations.vllm.scheduler.half import SchedulerStats
    from hicache.integrations.vllm.worker.half import WorkerStats

    reported = {f.name for cls in (WorkerStats, SchedulerStats) for f in dataclasses.fields(cls)}
    reported |= {"scheduler_steps", "scheduler_hook_seconds", "scheduler_hook_cpu_seconds",
                 "host_pages_used", "host_pages_free", "host_window_pages", "host_state_pages"}
    # load_blocks is the sum of vllm:hicache_loaded_blocks_total's two tiers
    assert reported - metric_keys() == {"load_blocks"}
    assert metric_keys() - reported == set()  # and no metric reads a key nobody sends
    assert all(name.startswith("vllm:hicache_") for name in METRICS)


def test_vllms_prometheus_logger_exposes_hicache_counters(sched):
    import prom_check
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    B = sched.B
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 16 * B}, max_num_batched_tokens=256)
    logger = PrometheusStatLogger(e.vllm_config, engine_indexes=[0])
    before = _scrape()
    assert prom_check.missing_hicache_metrics(before) == []  # every series from the start
    assert prom_check.sample(before, "vllm:hicache_hit_tokens_total") == 0
    rng = random.Random(3)
    prefix = [rng.randrange(1, 500) for _ in range(4 * B)]
    e.add("warm", prefix + [7, 8, 9], max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()  # vLLM forgets; the host tier keeps the prefix
    e.add("a", prefix + [rng.randrange(1, 500) for _ in range(B + 3)], max_tokens=2)
    e.run()
    e.step()  # an empty step: the last saves land and are reported
    e.check()
    for stats in e.scheduler_stats:
        logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    text = _scrape()
    half = e.connector.scheduler_half
    c = half.counters
    page_nbytes = e.connector.page_nbytes
    model = e.vllm_config.model_config.served_model_name

    def value(name: str, **labels: str) -> float:
        return prom_check.sample(text, name, model_name=model, engine="0", **labels)

    assert c.host_hit_tokens == 4 * B
    assert value("vllm:hicache_hit_tokens_total", tier="host") == c.host_hit_tokens
    assert value("vllm:hicache_hit_tokens_total", tier="storage") == 0
    assert value("vllm:hicache_lookups_total") == c.lookups
    assert value("vllm:hicache_lookup_tokens_total") == c.lookup_tokens
    assert value("vllm:hicache_saved_tokens_total") == c.saved_tokens
    assert value("vllm:hicache_loaded_blocks_total", tier="host") == 4
    assert value("vllm:hicache_transfer_bytes_total", operation="load") == 4 * page_nbytes
    saved_blocks = c.saved_tokens // B
    assert value("vllm:hicache_saved_blocks_total") == saved_blocks
    assert value("vllm:hicache_transfer_bytes_total", operation="save") == \
        saved_blocks * page_nbytes
    assert value("vllm:hicache_transfer_seconds_total", operation="load") > 0
    assert value("vllm:hicache_transfer_gbps", operation="load") > 0
    assert value("vllm:hicache_load_failed_blocks_total") == 0
    assert value("vllm:hicache_storage_errors_total") == 0
    assert value("vllm:hicache_host_pages_used") == half.host_allocator.num_used_pages == \
        saved_blocks
    assert value("vllm:hicache_host_pages_free") == half.host_allocator.num_free_pages
    # steps without a copy ride along with the next report that has one
    assert 0 < value("vllm:hicache_connector_steps_total", side="worker") <= e.step_no
    assert value("vllm:hicache_connector_seconds_total", side="worker") > 0
    assert value("vllm:hicache_connector_ms_per_step", side="worker") > 0
    assert value("vllm:hicache_connector_steps_total", side="scheduler") > 0
    e.close()


@pytest.mark.slow  # a real engine start (~70 s on 2 cores); the vllm serve test scrapes too
def test_a_real_engine_shows_hicache_on_its_registry_and_events():
    import os
    import subprocess
    import sys
    from pathlib import Path

    from vllm_processes import vllm_result

    driver = Path(__file__).parent / "vllm_async_driver.py"
    root = str(Path(__file__).parents[2])  # this checkout's hicache, in every vLLM process
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    r = vllm_result(proc)
    blocks = 299 // 32  # whole blocks of the shared prompt (block size 32)
    assert r["cached"] == [0, blocks * 32]
    assert r["missing"] == []
    assert r["host_hit_tokens"] == blocks * 32 and r["host_pages_used"] == blocks
    assert r["load_bytes"] > 0
    assert r["events"].get("BlockStored/CPU", 0) >= 1 and "BlockRemoved/CPU" not in r["events"]
    # the third tier: one event a block, once its write landed (reported with a later
    # step: the last writes may land after the last step)
    assert 1 <= r["events"].get("BlockStored/STORAGE", 0) <= blocks
    assert "BlockRemoved/STORAGE" not in r["events"]
