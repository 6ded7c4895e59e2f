"""hicache's counters on vLLM's own Prometheus ``/metrics``.

vLLM's ``PrometheusStatLogger`` (the engine front end) asks the connector class for a
:class:`~vllm.distributed.kv_transfer.kv_connector.v1.metrics.KVConnectorPromMetrics`
(``build_prom_metrics``) and hands it, for every stats report, the connector stats of
the step: the workers' counters (aggregated over ranks) and the scheduler half's, as the
plain ``data`` dict of :class:`~hicache.integrations.vllm.connector.HiCacheConnectorStats`.
:class:`HiCachePromMetrics` turns those deltas into counters and the host tier's
occupancy into gauges, named ``vllm:hicache_*`` and labelled ``model_name`` and
``engine`` as vLLM's own metrics are (whatever label names vLLM passes come first).

Metric name -> (kind, stats keys), the whole mapping in :data:`METRICS`; docs/vllm.md
lists them with their meaning. Throughput is best read as
``rate(vllm:hicache_transfer_bytes_total[1m]) / rate(vllm:hicache_transfer_seconds_total[1m])``;
the ``*_gbps`` / ``*_ms_per_step`` gauges hold the last report's value.

This module knows nothing of the connector's state; it only reads stats dicts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from prometheus_client import Counter, Gauge
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)


class Metric(NamedTuple):
    """One Prometheus metric fed from the stats dict."""

    kind: type  # prometheus_client.Counter or Gauge (vLLM may substitute its own classes)
    doc: str
    label: str | None  # the extra label's name, or None
    # label value (or "" without a label) -> stats key(s); a tuple of two keys is a ratio
    # (bytes, seconds) -> GB/s, or (seconds, steps) -> ms per step
    sources: dict[str, str | tuple[str, str]]


_OPS = {"load": "load", "save": "save", "storage_read": "storage_read",
        "storage_write": "storage_write"}

METRICS: dict[str, Metric] = {
    "vllm:hicache_lookups_total": Metric(
        Counter, "Lookups of the host and third tiers (get_num_new_matched_tokens calls).",
        None, {"": "lookups"}),
    "vllm:hicache_lookup_tokens_total": Metric(
        Counter, "Prompt tokens looked up in hicache beyond vLLM's own prefix hit.",
        None, {"": "lookup_tokens"}),
    "vllm:hicache_hit_tokens_total": Metric(
        Counter, "Tokens planned to load from hicache, by the tier they are found in.",
        "tier", {"host": "host_hit_tokens", "storage": "storage_hit_tokens"}),
    "vllm:hicache_load_failed_tokens_total": Metric(
        Counter, "Promised tokens that could not be planned (reported failed, recomputed).",
        None, {"": "load_failed_tokens"}),
    "vllm:hicache_saved_tokens_total": Metric(
        Counter, "Tokens planned to save into the host tier.", None, {"": "saved_tokens"}),
    "vllm:hicache_save_skipped_tokens_total": Metric(
        Counter, "Tokens not saved: the host tier was full of pages in use.",
        None, {"": "save_skipped_tokens"}),
    "vllm:hicache_host_evicted_tokens_total": Metric(
        Counter, "Tokens evicted from the host tier.", None, {"": "host_evicted_tokens"}),
    "vllm:hicache_loaded_blocks_total": Metric(
        Counter, "Blocks loaded into vLLM's KV cache, by the tier they came from.",
        "tier", {"host": "load_host_blocks", "storage": "load_storage_blocks"}),
    "vllm:hicache_load_failed_blocks_total": Metric(
        Counter, "Blocks whose load failed (reported to vLLM as load errors).",
        None, {"": "load_failed_blocks"}),
    "vllm:hicache_saved_blocks_total": Metric(
        Counter, "Blocks copied from vLLM's KV cache into the host tier.",
        None, {"": "save_blocks"}),
    "vllm:hicache_save_failed_blocks_total": Metric(
        Counter, "Blocks whose save failed (the host page is not served).",
        None, {"": "save_failed_blocks"}),
    "vllm:hicache_transfer_bytes_total": Metric(
        Counter, "Bytes moved: load (host to vLLM), save (vLLM to host), storage_read, "
        "storage_write (third tier).", "operation", {op: f"{op}_bytes" for op in _OPS}),
    "vllm:hicache_transfer_seconds_total": Metric(
        Counter, "Seconds the transfers of each operation took.",
        "operation", {op: f"{op}_seconds" for op in _OPS}),
    "vllm:hicache_transfer_gbps": Metric(
        Gauge, "GB/s (1e9 bytes) of each operation in the last report that moved bytes.",
        "operation", {op: (f"{op}_bytes", f"{op}_seconds") for op in _OPS}),
    "vllm:hicache_prefetch_tokens_total": Metric(
        Counter, "Tokens of third-tier prefetches: started, arrived (into the host tier), "
        "dropped (their read failed, or came after a reset), declined (stored, computed: "
        "reading would not pay).", "state",
        {"started": "prefetch_tokens", "arrived": "prefetch_arrived_tokens",
         "dropped": "prefetch_dropped_tokens", "declined": "prefetch_declined_tokens"}),
    "vllm:hicache_unkeyed_requests_total": Metric(
        Counter, "Requests served without hicache (nothing loaded or saved): an input their "
        "KV depends on that hicache cannot key.", None, {"": "unkeyed_requests"}),
    "vllm:hicache_handoff_tokens_total": Metric(
        Counter, "Tokens of the prefill-to-decode hand-off: offered (a prefill instance "
        "handed them off), wanted (a decode request could load them), served (it did).",
        "state", {"offered": "handoff_offered_tokens", "wanted": "handoff_tokens",
                  "served": "handoff_served_tokens"}),
    "vllm:hicache_handoff_requests_total": Metric(
        Counter, "Decode requests with a hand-off: served every page, or computed some "
        "because of another epoch, another key (identity), a timeout, an unreachable "
        "store, a failed write at the prefill, or a short read.", "outcome",
        {"served": "handoff_served", "epoch": "handoff_epoch", "identity": "handoff_identity",
         "timeout": "handoff_timeout", "store": "handoff_store", "failed": "handoff_failed",
         "short": "handoff_short"}),
    "vllm:hicache_handoff_wait_seconds_total": Metric(
        Counter, "Seconds decode requests waited for handed-off pages to land.",
        None, {"": "handoff_wait_seconds"}),
    "vllm:hicache_audited_requests_total": Metric(
        Counter, "Run-time KV audit: requests with a hit that was not served but compared "
        "with the KV vLLM computed instead.", None, {"": "audited_requests"}),
    "vllm:hicache_audit_computed_tokens_total": Metric(
        Counter, "Run-time KV audit: hit tokens audited requests computed instead of "
        "loading (the audit's cost).", None, {"": "audit_computed_tokens"}),
    "vllm:hicache_audited_pages_total": Metric(
        Counter, "Run-time KV audit: pages compared with the KV vLLM computed.",
        None, {"": "audited_pages"}),
    "vllm:hicache_audit_mismatches_total": Metric(
        Counter, "Run-time KV audit: pages whose KV differed from what vLLM computed "
        "(taken out of service with every page below them).",
        None, {"": "audit_mismatched_pages"}),
    "vllm:hicache_audit_skipped_pages_total": Metric(
        Counter, "Run-time KV audit: pages of an audited hit not compared (they left the "
        "tiers first, or could not be read).", None, {"": "audit_skipped_pages"}),
    "vllm:hicache_audit_dropped_pages_total": Metric(
        Counter, "Run-time KV audit: host pages taken out of service for a mismatch (the "
        "page and every page below it).", None, {"": "audit_dropped_pages"}),
    "vllm:hicache_storage_errors_total": Metric(
        Counter, "Third-tier operations that failed.", None, {"": "storage_errors"}),
    "vllm:hicache_storage_timeouts_total": Metric(
        Counter, "Third-tier reads that did not finish within storage_timeout_s.",
        None, {"": "storage_timeouts"}),
    "vllm:hicache_host_pages_used": Metric(
        Gauge, "Host-tier pages (one vLLM block each) holding cached KV.",
        None, {"": "host_pages_used"}),
    "vllm:hicache_host_pages_free": Metric(
        Gauge, "Host-tier pages free.", None, {"": "host_pages_free"}),
    "vllm:hicache_component_pages_saved_total": Metric(
        Counter, "Hybrid models: host pages of sliding-window (window) and recurrent-state "
        "(state) groups planned to save.", "kind",
        {"window": "window_pages_saved", "state": "state_pages_saved"}),
    "vllm:hicache_component_pages_loaded_total": Metric(
        Counter, "Hybrid models: host pages of sliding-window and recurrent-state groups "
        "planned to load.", "kind",
        {"window": "window_pages_loaded", "state": "state_pages_loaded"}),
    "vllm:hicache_host_component_pages": Metric(
        Gauge, "Hybrid models: host-tier pages holding sliding-window tails (window) and "
        "recurrent-state checkpoints (state).", "kind",
        {"window": "host_window_pages", "state": "host_state_pages"}),
    "vllm:hicache_connector_steps_total": Metric(
        Counter, "vLLM steps seen by the connector (worker: summed over ranks).",
        "side", {"worker": "steps", "scheduler": "scheduler_steps"}),
    "vllm:hicache_connector_seconds_total": Metric(
        Counter, "Wall seconds spent in the connector's hooks (worker: copies included).",
        "side", {"worker": "hook_seconds", "scheduler": "scheduler_hook_seconds"}),
    "vllm:hicache_connector_cpu_seconds_total": Metric(
        Counter, "CPU seconds of the thread running the connector's hooks.",
        "side", {"worker": "hook_cpu_seconds", "scheduler": "scheduler_hook_cpu_seconds"}),
    "vllm:hicache_connector_ms_per_step": Metric(
        Gauge, "Milliseconds the connector's hooks added to a step, last report.",
        "side", {"worker": ("hook_seconds", "steps"),
                 "scheduler": ("scheduler_hook_seconds", "scheduler_steps")}),
}


def metric_keys() -> set[str]:
    """Every stats key some metric reads."""
    keys: set[str] = set()
    for m in METRICS.values():
        for src in m.sources.values():
            keys.update((src,) if isinstance(src, str) else src)
    return keys


def _value(data: dict[str, Any], src: str | tuple[str, str]) -> float | None:
    """The sample for ``src`` in one report, or None when the report has none."""
    if isinstance(src, str):
        return data.get(src)
    num, den = data.get(src[0]), data.get(src[1])
    if not num or not den:
        return None  # nothing moved, or no step: keep the last value
    return num / den / 1e9 if src[0].endswith("_bytes") else num / den * 1e3


class HiCachePromMetrics(KVConnectorPromMetrics):
    """Registers :data:`METRICS` and records each stats report into them."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, m in METRICS.items():
            labels = list(labelnames) + ([m.label] if m.label else [])
            if m.kind is Counter:
                self._metrics[name] = self._counter_cls(
                    name=name, documentation=m.doc, labelnames=labels)
            else:  # a snapshot: with several front-end processes, the latest one counts
                self._metrics[name] = self._gauge_cls(
                    name=name, documentation=m.doc, labelnames=labels,
                    multiprocess_mode="mostrecent")
        self._children: dict[tuple[int, str, str], Any] = {}
        for engine_idx in per_engine_labelvalues:  # every series on /metrics from the start
            for name, m in METRICS.items():
                for label in m.sources:
                    self._child(engine_idx, name, label)

    def _child(self, engine_idx: int, name: str, label: str) -> Any:
        key = (engine_idx, name, label)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label else [])
            child = self._children[key] = self._metrics[name].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one report: counters grow by its deltas, gauges take its values.
        Keys this module does not know are ignored (a newer worker's counters)."""
        if not transfer_stats_data:
            return
        for name, m in METRICS.items():
            for label, src in m.sources.items():
                value = _value(transfer_stats_data, src)
                if value is None:
                    continue
                if m.kind is Counter:
                    if value > 0:
                        self._child(engine_idx, name, label).inc(value)
                else:
                    self._child(engine_idx, name, label).set(value)
