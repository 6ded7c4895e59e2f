"""hicache as a vLLM v1 KV connector: ``HiCacheConnector`` (see docs/vllm.md).

``kv_connector_module_path = "hicache.integrations.vllm"``. vLLM runs the connector's
two halves in different processes; each has its folder, and what both speak is a third:

    scheduler/   the scheduler half (vLLM's scheduler process): lookups, step plans,
                 write policies, third-tier promises and prefetch, KV events
    worker/      the worker half (each worker process): copies between vLLM's blocks
                 and host pages, third-tier reads and writes, wrong-KV tracking
    common/      options, per-request control, the step plan, storage identity and keys,
                 tensor parallelism

The halves never import each other. They import no vLLM (but
:mod:`.scheduler.kv_events`); only :mod:`.connector`, which translates vLLM's calls
into the halves' plain arguments, and what it uses of vLLM's (:mod:`.metadata`,
:mod:`.stats`, :mod:`.prom` for ``/metrics``, :mod:`.clocks`, :mod:`.roles` for
``kv_role`` and the prefill-to-decode hand-off) do, imported on first use of
``HiCacheConnector``, so the halves are usable and testable without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name in ("HiCacheConnector", "HiCacheConnectorMetadata", "HiCacheConnectorStats"):
        from hicache.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
