"""hicache as a vLLM v1 KV connector: ``HiCacheConnector`` (see docs/vllm.md).

``kv_connector_module_path = "hicache.integrations.vllm"``. The halves
(:mod:`.scheduler` with :mod:`.requests` and :mod:`.third_tier`, :mod:`.worker`,
:mod:`.plan`, :mod:`.layout`, :mod:`.config`) import no vLLM; only :mod:`.connector`
and what it uses of vLLM's (:mod:`.stats`, :mod:`.prom` for ``/metrics``,
:mod:`.kv_events`) do, imported on first use of ``HiCacheConnector``, so the halves are
usable and testable without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name in ("HiCacheConnector", "HiCacheConnectorMetadata", "HiCacheConnectorStats"):
        from hicache.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
