"""Read hicache's metrics out of a Prometheus text scrape (vLLM's ``/metrics``).

Plain functions, no fixtures: a test that scraped a running server calls
``missing_hicache_metrics(text)`` (every ``vllm:hicache_*`` series the connector
registers, empty when all are there) and ``sample(text, name, **labels)`` (a sample's
value summed over the labels not given).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the scrape as (name, labels, value)."""
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def missing_hicache_metrics(text: str) -> list[str]:
    """The ``vllm:hicache_*`` series the connector registers that the scrape lacks,
    as ``name{label='value'}``."""
    from hicache.integrations.vllm.prom import METRICS

    have = set()
    for name, labels, _ in samples(text):
        m = METRICS.get(name)
        if m is not None:
            have.add((name, labels.get(m.label, "") if m.label else ""))
    return [f"{name}{{{m.label}={value!r}}}" if m.label else name
            for name, m in METRICS.items() for value in m.sources
            if (name, value) not in have]


def sample(text: str, name: str, **labels: str) -> float:
    """The value of ``name`` where its labels match ``labels``, summed over the rest
    (engines, models); 0 when none matches."""
    return sum(value for n, have, value in samples(text)
               if n == name and all(have.get(k) == v for k, v in labels.items()))
