"""hicache.metrics: the exporter serves what stats() says, per tier, with transfer histograms;
and the library logs under the `hicache` hierarchy and never prints."""

from __future__ import annotations

import ast
import logging
import urllib.request
from pathlib import Path

import pytest
from leak_checks import assert_no_leaks
from optional import need

from hicache import CacheConfig, HiCache, KVConfig

need("metrics")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hicache.metrics import CacheMetrics  # noqa: E402

KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)


def _request(cache: HiCache, tokens: list[int]) -> None:
    h = cache.match(tokens)
    assert cache.alloc(h, len(tokens) - h.prefix_len) is not None
    assert cache.finish_loads(h)
    cache.insert(h, tokens)
    cache.release(h)
    cache.wait_all()


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_scraped_metrics_equal_stats_per_tier():
    config = CacheConfig(KV, device_tokens=32, host_tokens=256, executor="thread")
    metrics = CacheMetrics()
    with HiCache(config) as cache:
        metrics.track(cache, "c")
        a, b = list(range(24)), list(range(1000, 1024))
        _request(cache, a)
        _request(cache, b)  # evicts a's device pages; a's host copies stay
        _request(cache, a)  # host hit: loaded back
        metrics.update()
        port = metrics.serve(0)
        try:
            got = _scrape(port)
        finally:
            metrics.close()
        s = cache.stats()
        assert s["host_hit_tokens"] > 0 and s["loads"] > 0 and s["backups"] > 0

        def value(name, **labels):
            return got[(name, tuple(sorted({"cache": "c", **labels}.items())))]

        assert value("hicache_requests_total") == s["requests"] == 3
        for tier in ("device", "host", "storage"):
            assert value("hicache_hit_tokens_total", tier=tier) == s[f"{tier}_hit_tokens"]
        for tier in ("device", "host"):
            assert value("hicache_evicted_tokens_total", tier=tier) == s[f"{tier}_evicted_tokens"]
            assert value("hicache_pages_used", tier=tier) == s[f"{tier}_pages_used"]
            assert value("hicache_pages_free", tier=tier) == s[f"{tier}_pages_free"]
            assert value("hicache_cached_tokens", tier=tier) == s[f"{tier}_cached_tokens"]
        assert value("hicache_occupancy_ratio", tier="device") == (
            s["device_pages_used"] / config.num_device_pages)
        for key, name in (("loads", "hicache_loads_total"), ("load_bytes", "hicache_load_bytes_total"),
                          ("backups", "hicache_backups_total"),
                          ("backup_bytes", "hicache_backup_bytes_total"),
                          ("storage_errors", "hicache_storage_errors_total"),
                          ("inserted_tokens", "hicache_inserted_tokens_total")):
            assert value(name) == s[key], name
        assert value("hicache_load_seconds_total") == pytest.approx(s["load_seconds"])
        assert value("hicache_transfers_in_flight") == 0 and value("hicache_live_requests") == 0
        # Histograms: one observation per finished transfer, bytes summing to the counters.
        for direction in ("load", "backup"):
            count = value("hicache_transfer_bytes_count", direction=direction)
            total = value("hicache_transfer_bytes_sum", direction=direction)
            assert count == s[f"{direction}s"] - s[f"{direction}s_failed"]
            assert total == s[f"{direction}_bytes"]
            assert value("hicache_transfer_seconds_count", direction=direction) == count
        assert_no_leaks(cache)
        metrics.untrack("c")


def test_track_refuses_a_second_cache_under_one_name():
    metrics = CacheMetrics()
    with HiCache(CacheConfig(KV, device_tokens=32)) as cache:
        metrics.track(cache, "c")
        with pytest.raises(ValueError, match="a cache named 'c' is tracked already"):
            metrics.track(cache, "c")
        with pytest.raises(ValueError, match="name: expected a non-empty str"):
            metrics.track(cache, "")
        with pytest.raises(TypeError, match="cache: expected HiCache, got dict"):
            metrics.track({}, "d")
        with pytest.raises(ValueError, match="name: expected a tracked cache"):
            metrics.update("nope")
        for bad in (-1, 65536, "80", True):
            with pytest.raises(ValueError, match="port: expected an int"):
                metrics.serve(bad)
        assert_no_leaks(cache)


def test_untrack_stops_observing_transfers_and_track_again_counts_each_once():
    """untrack left its observer installed: an untracked cache was still counted, and
    track/untrack/track counted every transfer twice (issue 25.6)."""
    metrics = CacheMetrics()
    config = CacheConfig(KV, device_tokens=32, host_tokens=256, executor="immediate")
    with HiCache(config) as cache:

        def backups() -> float:
            return metrics.registry.get_sample_value(
                "hicache_transfer_bytes_count", {"cache": "c", "direction": "backup"}) or 0

        metrics.track(cache, "c")
        _request(cache, list(range(8)))  # 2 pages, backed up in one transfer (write-through)
        assert backups() == 1 == cache.stats()["backups"]
        metrics.untrack("c")
        assert cache.transfers.on_complete == []
        _request(cache, list(range(100, 108)))  # untracked: not observed
        assert backups() == 1 and cache.stats()["backups"] == 2
        metrics.track(cache, "c")
        _request(cache, list(range(200, 208)))
        assert backups() == 2 and cache.stats()["backups"] == 3  # once, not twice
        assert len(cache.transfers.on_complete) == 1
        metrics.untrack("c")
        with pytest.raises(ValueError, match="name: expected a tracked cache"):
            metrics.untrack("c")
        assert_no_leaks(cache)


def test_transfer_failures_are_logged_under_the_hicache_hierarchy(caplog):
    from hicache.transfer import TransferEngine

    config = CacheConfig(KV, device_tokens=32, host_tokens=64, executor="manual")
    with HiCache(config) as cache:
        engine: TransferEngine = cache.transfers
        h = cache.match(list(range(8)))
        cache.alloc(h, 8)
        cache.insert(h, list(range(8)))  # write-through: a backup is submitted
        cache.release(h)
        executor = engine.executor
        with caplog.at_level(logging.WARNING, logger="hicache"):
            for handle in executor.pending():
                executor.fail(handle, RuntimeError("injected"))  # the manual executor's hook
            cache.wait_all()
        records = [r for r in caplog.records if r.name == "hicache.transfer.engine"]
        assert records and "backup of 2 pages failed" in records[0].getMessage()
        assert_no_leaks(cache)


def test_library_code_never_prints():
    """print is for the command line (hicache/cli/) alone; the library and sim/ log or return."""
    root = Path(__file__).resolve().parents[2] / "hicache"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def test_log_level_from_the_environment(monkeypatch):
    from hicache import logs

    logger = logging.getLogger("hicache")
    before = (logger.level, list(logger.handlers))
    try:
        logs.configure_from_env({"HICACHE_LOG_LEVEL": "debug"})
        assert logger.level == logging.DEBUG and logs._handler in logger.handlers
        with pytest.warns(RuntimeWarning, match="HICACHE_LOG_LEVEL: expected one of"):
            logs.configure_from_env({"HICACHE_LOG_LEVEL": "loud"})
    finally:
        logger.setLevel(before[0])
        logger.handlers[:] = before[1]
        logs._handler = None


def test_metrics_port_on_the_long_running_commands(capsys, monkeypatch):
    from hicache.cli import app as cli

    exported = {}
    real_close = CacheMetrics.close

    def close(self):  # what the exporter held when the command ended
        exported.update(self._snapshots)
        real_close(self)

    monkeypatch.setattr(CacheMetrics, "close", close)
    for argv, name in (
        (["stress", "--seconds", "0.3", "--metrics-port", "0", "--json"], "stress"),
        (["bench", "multiturn", "--preset", "tiny", "--requests", "3", "--configs",
          "hierarchical", "--metrics-port", "0", "--json"], "hierarchical"),
    ):
        exported.clear()
        assert cli.main(argv) == 0, argv
        captured = capsys.readouterr()
        assert "serving metrics on http://127.0.0.1:" in captured.err, (argv, captured.err)
        assert exported[name]["requests"] > 0 and exported[name]["live_requests"] == 0
        if name == "hierarchical":
            # one match per request, as the bench's own report counts them
            assert exported[name]["requests"] == 3
