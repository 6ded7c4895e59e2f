"""The connector's options: ``kv_connector_extra_config``, validated once at start-up.

Both halves of the connector (scheduler and workers, different processes) parse
the same dict with :meth:`ConnectorConfig.from_extra`, so a bad value stops vLLM
at start-up with one ``ValueError``/``TypeError`` that names the field, not on
the first request. This module imports neither vLLM nor torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache.config import GiB
from hicache.storage.auth import check_secret

_WRITE_POLICIES = ("write_through",)
_EVICTIONS = ("lru", "lfu")
_TREES = ("auto", "python", "native")
_EXECUTORS = ("auto", "sync", "thread", "cuda", "manual")
DEFAULT_HOST_GB = 4.0


def _number(name: str, value: object, *, minimum: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"kv_connector_extra_config.{name}: expected a number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ValueError(f"kv_connector_extra_config.{name}: expected {op} {minimum}, got {value}")
    return value


def _int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"kv_connector_extra_config.{name}: expected an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"kv_connector_extra_config.{name}: expected >= {minimum}, got {value}")
    return value


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(
            f"kv_connector_extra_config.{name}: expected one of {list(allowed)}, got {value!r}"
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may set (every field optional)."""

    host_gb: float | None = None  # host tier size per worker, GiB (default 4 when no host_tokens)
    host_tokens: int | None = None  # host tier size in tokens (rounded down to whole blocks)
    host_reserve_gb: float = 2.0  # host memory the pool must leave to the rest of the machine
    storage: str | None = None  # third tier: "file:DIR" or "mooncake://HOST:PORT?metadata=URL"
    storage_options: dict = field(default_factory=dict, compare=False)  # backend keywords
    write_policy: str = "write_through"  # when a computed block gets its host copy
    eviction: str = "lru"  # host tier eviction order: "lru" or "lfu"
    load_threshold_tokens: int = 0  # host/storage hits shorter than this are recomputed
    tree: str = "auto"  # radix tree implementation: "auto", "python" or "native"
    executor: str = "auto"  # worker copies: "auto" (cuda on GPU; on CPU see worker.py), ...
    copy_cpus: list[int] | None = None  # CPU: pin the copy threads here (executor thread/auto)
    model_id: str | None = None  # storage identity override (default: derived from vLLM)
    # Storage secret: pages are tagged and verified (None: $HICACHE_STORAGE_SECRET). Never shown.
    storage_secret: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; unknown keys are an error, not ignored."""
        extra = dict(extra or {})
        allowed = sorted(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown field(s) {unknown}; expected some of {allowed}"
            )
        return cls(**extra)

    def __post_init__(self) -> None:
        if self.host_gb is not None and self.host_tokens is not None:
            raise ValueError(
                "kv_connector_extra_config: expected at most one of host_gb or host_tokens, got "
                f"host_gb={self.host_gb}, host_tokens={self.host_tokens}"
            )
        if self.host_gb is not None:
            _number("host_gb", self.host_gb, minimum=0, strict=True)
        if self.host_tokens is not None:
            _int("host_tokens", self.host_tokens, minimum=1)
        _number("host_reserve_gb", self.host_reserve_gb, minimum=0, strict=False)
        if self.storage is not None:
            if not isinstance(self.storage, str) or not (
                (self.storage.startswith("file:") and len(self.storage) > len("file:"))
                or self.storage.startswith("mooncake://")
            ):
                raise ValueError(
                    "kv_connector_extra_config.storage: expected 'file:DIR' or "
                    f"'mooncake://HOST:PORT?metadata=URL', got {self.storage!r}"
                )
        if not isinstance(self.storage_options, dict):
            raise TypeError(
                "kv_connector_extra_config.storage_options: expected a dict, got "
                f"{type(self.storage_options).__name__}"
            )
        if self.storage_options and self.storage is None:
            raise ValueError(
                "kv_connector_extra_config.storage_options: given without storage"
            )
        _choice("write_policy", self.write_policy, _WRITE_POLICIES)
        _choice("eviction", self.eviction, _EVICTIONS)
        _int("load_threshold_tokens", self.load_threshold_tokens, minimum=0)
        _choice("tree", self.tree, _TREES)
        _choice("executor", self.executor, _EXECUTORS)
        if self.copy_cpus is not None:
            if not isinstance(self.copy_cpus, list | tuple) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in self.copy_cpus
            ):
                raise TypeError(
                    "kv_connector_extra_config.copy_cpus: expected a list of int CPU ids, "
                    f"got {self.copy_cpus!r}"
                )
            if not self.copy_cpus or min(self.copy_cpus) < 0:
                raise ValueError(
                    "kv_connector_extra_config.copy_cpus: expected one or more CPU ids >= 0, "
                    f"got {self.copy_cpus!r}"
                )
            if self.executor not in ("auto", "thread"):
                raise ValueError(
                    "kv_connector_extra_config.copy_cpus: pins the thread executor's copies; "
                    f"expected executor 'auto' or 'thread', got {self.executor!r}"
                )
        check_secret("kv_connector_extra_config.storage_secret", self.storage_secret)
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ValueError(
                f"kv_connector_extra_config.model_id: expected a non-empty str, got {self.model_id!r}"
            )

    def num_host_pages(self, page_size: int, page_nbytes: int) -> int:
        """Host pages per worker for pages of ``page_size`` tokens and ``page_nbytes`` bytes."""
        if self.host_tokens is not None:
            num = self.host_tokens // page_size
        else:
            gb = DEFAULT_HOST_GB if self.host_gb is None else self.host_gb
            num = int(gb * GiB) // page_nbytes
        if num < 1:
            raise ValueError(
                "kv_connector_extra_config: the host tier holds no whole block "
                f"({page_size} tokens, {page_nbytes} bytes); raise host_gb or host_tokens"
            )
        return num

    @property
    def host_reserve_nbytes(self) -> int:
        return int(self.host_reserve_gb * GiB)
