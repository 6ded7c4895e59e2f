"""Prometheus metrics for HiCache instances, and an HTTP exporter (the ``metrics`` extra).

:class:`CacheMetrics` exposes, per tracked cache (label ``cache``) and per tier
(label ``tier``: ``device``, ``host``, ``storage``):

* counters from :meth:`hicache.HiCache.stats`, named ``hicache_<what>_total``
  with units in the name (``hicache_load_bytes_total``,
  ``hicache_backup_seconds_total``, ``hicache_hit_tokens_total{tier=...}``,
  ``hicache_evicted_tokens_total{tier=...}``, ``hicache_storage_errors_total``);
* gauges of occupancy and work in flight (``hicache_pages_used{tier}``,
  ``hicache_pages_free{tier}``, ``hicache_cached_tokens{tier}``,
  ``hicache_occupancy_ratio{tier}``, ``hicache_transfers_in_flight``,
  ``hicache_live_requests``);
* histograms of every finished transfer between the device and host tiers
  (``hicache_transfer_seconds{direction="load"|"backup"}``,
  ``hicache_transfer_bytes{direction}``), observed as the cache polls them.

Threads: a ``HiCache`` is not thread-safe, and its ``stats()`` polls transfers.
So the exporter's HTTP thread never touches a cache: the thread that owns the
cache calls :meth:`CacheMetrics.update` (after a request, once per scheduler
step) and the exporter serves the last snapshot. Transfer histograms are
filled on the owner's thread too, from ``TransferEngine.poll``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

try:
    from prometheus_client import CollectorRegistry, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # the optional extra is not installed
    raise ImportError(
        "hicache.metrics needs prometheus_client: pip install 'hicache[metrics]' "
        "(or pip install prometheus_client)"
    ) from exc

from hicache.cache import HiCache

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from hicache.transfer import Transfer

_log = logging.getLogger(__name__)

# (metric name without _total, stats() key, help). Counters, one sample per cache.
_COUNTERS = [
    ("hicache_requests", "requests", "match calls"),
    ("hicache_requested_tokens", "requested_tokens", "tokens passed to match"),
    ("hicache_host_hit_refused_tokens", "host_hit_refused_tokens",
     "host hits not loaded back (below the load threshold, or no device room)"),
    ("hicache_loads", "loads", "loads (host to device) started"),
    ("hicache_load_failures", "loads_failed", "loads that failed"),
    ("hicache_load_bytes", "load_bytes", "bytes loaded from host to device"),
    ("hicache_load_seconds", "load_seconds", "copy time of finished loads"),
    ("hicache_backups", "backups", "backups (device to host) started"),
    ("hicache_backup_failures", "backups_failed", "backups that failed"),
    ("hicache_backups_skipped", "backups_skipped",
     "nodes not backed up: host tier full and nothing evictable"),
    ("hicache_unbacked_dropped_tokens", "unbacked_dropped_tokens",
     "device tokens dropped with no host copy: write-back backups kept failing"),
    ("hicache_backup_bytes", "backup_bytes", "bytes backed up from device to host"),
    ("hicache_backup_seconds", "backup_seconds", "copy time of finished backups"),
    ("hicache_inserted_tokens", "inserted_tokens", "tokens newly cached by insert"),
    ("hicache_storage_reads", "storage_prefetches", "reads from the storage tier started"),
    ("hicache_storage_writes", "storage_writes", "writes to the storage tier started"),
    ("hicache_storage_read_bytes", "storage_read_bytes", "bytes read from the storage tier"),
    ("hicache_storage_write_bytes", "storage_write_bytes", "bytes written to the storage tier"),
    ("hicache_storage_read_seconds", "storage_read_seconds", "time of storage reads"),
    ("hicache_storage_write_seconds", "storage_write_seconds", "time of storage writes"),
    ("hicache_storage_errors", "storage_errors",
     "failed storage jobs (store unreachable, I/O error)"),
    ("hicache_storage_unauthentic_pages", "storage_unauthentic_pages",
     "pages read from storage whose tag did not verify under the storage secret"),
]
# Per-tier counters: (name, help, {tier: stats() key}).
_TIER_COUNTERS = [
    ("hicache_hit_tokens", "prompt tokens found in a tier (storage: read into host memory)",
     {"device": "device_hit_tokens", "host": "host_hit_tokens", "storage": "storage_hit_tokens"}),
    ("hicache_evicted_tokens", "tokens evicted from a tier",
     {"device": "device_evicted_tokens", "host": "host_evicted_tokens"}),
]
_TIER_GAUGES = [
    ("hicache_pages_used", "pages in use",
     {"device": "device_pages_used", "host": "host_pages_used"}),
    ("hicache_pages_free", "pages free",
     {"device": "device_pages_free", "host": "host_pages_free"}),
    ("hicache_cached_tokens", "tokens cached",
     {"device": "device_cached_tokens", "host": "host_cached_tokens"}),
]
_GAUGES = [
    ("hicache_transfers_in_flight", "transfers_in_flight",
     "device/host transfers submitted and not yet applied"),
    ("hicache_live_requests", "live_requests", "requests matched and not yet released"),
]
_SECONDS_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 12))  # 4 KiB .. 4 GiB


class CacheMetrics:
    """Prometheus collector over one or more :class:`hicache.HiCache` instances."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self._lock = threading.Lock()  # snapshots: written by owners, read by the exporter
        self._caches: dict[str, HiCache] = {}
        # name -> the transfer observer track() installed on that cache (untrack removes it)
        self._observers: dict[str, Callable[[Transfer], None]] = {}
        self._snapshots: dict[str, dict] = {}
        self._server: WSGIServer | None = None
        self.transfer_seconds = Histogram(
            "hicache_transfer_seconds", "copy time of one finished device/host transfer",
            ["cache", "direction"], buckets=_SECONDS_BUCKETS, registry=self.registry,
        )
        self.transfer_bytes = Histogram(
            "hicache_transfer_bytes", "size of one finished device/host transfer",
            ["cache", "direction"], buckets=_BYTES_BUCKETS, registry=self.registry,
        )
        self.registry.register(self)

    # ------------------------------------------------------------- owner side
    def track(self, cache: HiCache, name: str = "default") -> None:
        """Export ``cache`` under ``cache=name`` (call from the thread that owns it)."""
        if not isinstance(cache, HiCache):
            raise TypeError(f"cache: expected HiCache, got {type(cache).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        with self._lock:
            if name in self._caches:
                raise ValueError(f"name: a cache named {name!r} is tracked already")
            self._caches[name] = cache

        def observe(handle: Transfer, name: str = name) -> None:
            if handle.error is None:
                direction = handle.kind.value
                self.transfer_seconds.labels(name, direction).observe(handle.seconds or 0.0)
                self.transfer_bytes.labels(name, direction).observe(handle.nbytes)

        cache.transfers.on_complete.append(observe)
        self._observers[name] = observe
        self.update(name)

    def update(self, name: str | None = None) -> None:
        """Snapshot ``stats()`` of one tracked cache (or all): call from the owner's thread."""
        with self._lock:
            if name is not None and name not in self._caches:
                raise ValueError(f"name: expected a tracked cache {sorted(self._caches)}, got {name!r}")
            names = list(self._caches) if name is None else [name]
            caches = [(n, self._caches[n]) for n in names]
        for n, cache in caches:
            snapshot = cache.stats()
            with self._lock:
                self._snapshots[n] = snapshot

    def untrack(self, name: str) -> None:
        """Stop following a cache (before closing it); its last snapshot stays exported.

        Its transfers are no longer observed: a later :meth:`track` starts counting
        them again, once each."""
        self.update(name)
        with self._lock:
            cache = self._caches.pop(name)
        cache.transfers.on_complete.remove(self._observers.pop(name))

    # ------------------------------------------------------------- exporter side
    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshots = dict(self._snapshots)
        for metric, key, help_text in _COUNTERS:
            family = CounterMetricFamily(metric, help_text, labels=["cache"])
            for name, s in snapshots.items():
                family.add_metric([name], float(s.get(key, 0)))
            yield family
        for metric, help_text, keys in _TIER_COUNTERS:
            family = CounterMetricFamily(metric, help_text, labels=["cache", "tier"])
            for name, s in snapshots.items():
                for tier, key in keys.items():
                    family.add_metric([name, tier], float(s.get(key, 0)))
            yield family
        for metric, help_text, keys in _TIER_GAUGES:
            gauge = GaugeMetricFamily(metric, help_text, labels=["cache", "tier"])
            for name, s in snapshots.items():
                for tier, key in keys.items():
                    gauge.add_metric([name, tier], float(s.get(key, 0)))
            yield gauge
        occupancy = GaugeMetricFamily("hicache_occupancy_ratio",
                                      "fraction of a tier's pages in use", labels=["cache", "tier"])
        for name, s in snapshots.items():
            for tier in ("device", "host"):
                total = s[f"{tier}_pages_used"] + s[f"{tier}_pages_free"]
                occupancy.add_metric([name, tier], s[f"{tier}_pages_used"] / total if total else 0)
        yield occupancy
        for metric, key, help_text in _GAUGES:
            gauge = GaugeMetricFamily(metric, help_text, labels=["cache"])
            for name, s in snapshots.items():
                gauge.add_metric([name], float(s.get(key, 0)))
            yield gauge

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the HTTP exporter (``/metrics``) on a daemon thread; returns the bound port
        (``port=0`` picks a free one)."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
        if self._server is not None:
            raise RuntimeError("the exporter is already serving")
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        bound = server.server_port
        _log.info("serving Prometheus metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        """Stop the exporter, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
