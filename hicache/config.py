"""Frozen configuration: the KV shape, pool sizes per tier, and cache policies.

Every field is validated at construction, so a bad value fails where it is
written (``ValueError`` naming the field, the expected and the actual value),
not deep inside a transfer. This module knows torch only to name dtypes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch

from hicache.checks import (
    check_bool,
    check_device,
    check_enum,
    check_fraction,
    check_int,
    check_model_id,
    check_optional_str,
    check_positive_number,
    check_seconds,
    check_secret,
)
from hicache.components import ComponentSpec, describe_components, parse_components
from hicache.configfile import config_from_dict, config_from_file, config_to_dict
from hicache.errors import config_errors

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES.values()}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``"bfloat16"``) or a torch dtype to a supported torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype: expected str or torch.dtype, got {type(dtype).__name__}")
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


# Every int field stays inside int64 with room to spare: the native tree and the
# page allocators take them as int64, and a typo (10**30) should fail here, by name.
MAX_INT_FIELD = 1 << 62


def _set_int(obj: object, name: str, minimum: int) -> None:
    """Check the int field ``name`` of a frozen config; store it as a Python int."""
    value = check_int(name, getattr(obj, name), minimum, maximum=MAX_INT_FIELD)
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class KVConfig:
    """Shape of the KV cache of one model: what one token and one page cost.

    A hybrid model (sliding-window or recurrent layers beside full attention) names
    its other layers as ``components`` (:mod:`hicache.components`, docs/design.md,
    "Hybrid models: components"); ``num_layers`` then counts its full-attention
    layers, the layers one page holds, and a component's ``width`` is how many such
    pages one of its token pages (or checkpoints) takes.
    """

    num_layers: int  # transformer layers (full attention), each with its own K and V
    num_kv_heads: int  # KV heads (GQA: fewer than query heads)
    head_dim: int  # channels per head
    dtype: str | torch.dtype = "float16"  # element type of K and V
    page_size: int = 16  # tokens per page; the unit of caching and transfer
    # Hybrid models: window and state components, as specs or text ("window:4096x5,state")
    components: str | tuple[ComponentSpec, ...] = ()

    @config_errors
    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            _set_int(self, name, minimum=1)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        object.__setattr__(self, "components", parse_components(self.components))

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype  # type: ignore[return-value]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.torch_dtype]

    @property
    def token_nbytes_per_layer(self) -> int:
        """Bytes of K plus V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes of K plus V of one token over all layers (the KV bytes per token)."""
        return self.num_layers * self.token_nbytes_per_layer

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page over all layers: the unit a backup, load or store moves."""
        return self.page_size * self.token_nbytes

    @property
    def component_specs(self) -> tuple[ComponentSpec, ...]:
        """``components`` as specs (typed: the field also takes their text on input)."""
        return self.components  # type: ignore[return-value]

    def fingerprint(self) -> str:
        """Identifies the KV layout; caches of different fingerprints never share pages."""
        dtype_name = str(self.torch_dtype).removeprefix("torch.")
        layout = (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}"
            f"-{dtype_name}-P{self.page_size}"
        )
        if self.component_specs:
            layout += "-C" + describe_components(self.component_specs)
        return layout


class WritePolicy(str, Enum):
    """When a device page gets its host copy."""

    WRITE_THROUGH = "write_through"  # as soon as it is inserted
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once hit `backup_hit_threshold` times
    WRITE_BACK = "write_back"  # only when evicted from the device


class EvictionPolicy(str, Enum):
    """Which unlocked leaf leaves a tier first (hicache/tree/policies.py gives each its key)."""

    LRU = "lru"  # least recently accessed leaf first
    LFU = "lfu"  # fewest hits first, ties by recency
    FIFO = "fifo"  # oldest node (created first) first
    MRU = "mru"  # most recently accessed leaf first
    FILO = "filo"  # newest node (created last) first
    PRIORITY = "priority"  # lowest priority (given at match/insert) first, ties by recency
    SLRU = "slru"  # probationary nodes (fewer than 2 hits) before protected ones, LRU within


class PrefetchPolicy(str, Enum):
    """How long a request waits for third-tier pages being fetched into host memory."""

    BEST_EFFORT = "best_effort"  # use what has arrived by the time the request is scheduled
    WAIT_COMPLETE = "wait_complete"  # wait for the whole prefetch
    TIMEOUT = "timeout"  # wait up to `prefetch_timeout_s`


GiB = 1 << 30
HOST_SIZE_FIELDS = ("host_tokens", "host_nbytes", "host_ratio", "host_gb")  # at most one
DEVICE_SIZE_FIELDS = ("device_tokens", "device_nbytes")  # exactly one
_MAX_PAGES = 1 << 48  # beyond any machine; keeps page counts far inside int64


@dataclass(frozen=True)
class CacheConfig:
    """Everything a :class:`hicache.HiCache` needs: KV shape, tier sizes, policies.

    Device capacity is given in tokens or bytes (exactly one); host capacity in
    tokens, bytes, GB or as a ratio of the device capacity (at most one; none
    means no host tier). Sizes are rounded down to whole pages. Configs also
    come from plain data, files and the environment: :meth:`from_dict`,
    :meth:`from_file` (:mod:`hicache.configfile`). Every option, its unit and its
    name in the vLLM connector, the environment and the CLI: docs/configuration.md.
    """

    # The size options of each tier (one per tier); an environment variable setting one
    # replaces whichever the file gave (hicache.configfile).
    SIZE_FIELD_GROUPS: ClassVar[tuple[tuple[str, ...], ...]] = (
        DEVICE_SIZE_FIELDS, HOST_SIZE_FIELDS)

    kv: KVConfig
    device_tokens: int | None = None
    device_nbytes: int | None = None
    host_tokens: int | None = None
    host_nbytes: int | None = None
    host_ratio: float | None = None
    host_gb: float | None = None  # host tier in GB (10**9 bytes), like SGLang's --hicache-size
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the device pool lives
    host_reserve_nbytes: int = 2 * GiB  # host memory left to the rest of the machine
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    backup_hit_threshold: int = 2  # write_through_selective: hits before a backup
    load_threshold_tokens: int = 0  # host hits shorter than this are recomputed, not loaded
    eviction: EvictionPolicy | str = EvictionPolicy.LRU
    allocate_kv: bool = True  # False: bookkeeping only (replay), no KV tensors
    executor: str = "auto"  # "auto", "cuda", "thread", "manual" or "immediate"
    tree: str = "auto"  # "python", "native" or "auto" (native when it builds)
    # Where a bookkeeping-only cache (allocate_kv=False, no storage) runs its request
    # lifecycle: "native" (C++, over the native tree), "python", or "auto" (native
    # when the native tree is in use). Same results either way.
    lifecycle: str = "auto"
    storage: str | None = None  # third tier: "file:DIR" or "mooncake://HOST:PORT?metadata=URL"
    # Identity of the model whose KV this cache holds (name, weights digest or revision,
    # compute dtype, tensor-parallel rank: see hicache.storage.model_identity). Part of
    # every storage key, so models sharing a store never read each other's pages;
    # required with `storage`.
    model_id: str | None = None
    # Storage secret (str or bytes): tags every stored page and serves only pages whose
    # tag verifies (docs/storage.md, "Security"); None: $HICACHE_STORAGE_SECRET, if set.
    # Never shown: not in repr, errors or logs.
    storage_secret: str | bytes | None = field(default=None, repr=False, compare=False)
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 0.05
    # Pins (HiCache.pin) may hold at most this fraction of the device tier's pages.
    max_pinned_fraction: float = 0.5
    # Log KV events (pages entering / leaving each tier) for HiCache.take_events.
    kv_events: bool = False
    # Hybrid models (kv.components): each component may hold at most this fraction of
    # the device / host tier's pages; past it, its least recently used data goes.
    component_device_fraction: float = 1.0
    component_host_fraction: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # backend-specific options

    @config_errors
    def __post_init__(self) -> None:
        if not isinstance(self.kv, KVConfig):
            raise TypeError(f"kv: expected KVConfig, got {type(self.kv).__name__}")
        check_device(self.device)
        if (self.device_tokens is None) == (self.device_nbytes is None):
            raise ValueError(
                "device pool: expected exactly one of device_tokens or device_nbytes, "
                f"got device_tokens={self.device_tokens}, device_nbytes={self.device_nbytes}"
            )
        for name in ("device_tokens", "device_nbytes", "host_tokens", "host_nbytes"):
            if getattr(self, name) is not None:
                _set_int(self, name, minimum=1)
        host_given = [n for n in HOST_SIZE_FIELDS if getattr(self, n) is not None]
        if len(host_given) > 1:
            raise ValueError(f"host pool: expected at most one size option, got {host_given}")
        if self.host_gb is not None:
            check_positive_number("host_gb", self.host_gb)
            if self.host_gb * 1e9 / self.kv.page_nbytes >= _MAX_PAGES:
                raise ValueError(f"host_gb: expected fewer than {_MAX_PAGES} host pages, "
                                 f"got {self.host_gb} GB")
        if self.host_ratio is not None:
            check_positive_number("host_ratio", self.host_ratio)
            if self.num_device_pages * self.host_ratio >= _MAX_PAGES:
                raise ValueError(
                    f"host_ratio: expected fewer than {_MAX_PAGES} host pages, got "
                    f"{self.host_ratio} x {self.num_device_pages} device pages"
                )
        for name, pages in (("device", self.num_device_pages), ("host", self.num_host_pages)):
            if pages >= _MAX_PAGES:  # page ids are int64 and the free lists index them
                raise ValueError(f"{name} pool: expected fewer than {_MAX_PAGES} pages, "
                                 f"got {pages}")
        if self.num_device_pages < 1:
            raise ValueError(
                f"device pool: expected at least one page ({self.kv.page_size} tokens, "
                f"{self.kv.page_nbytes} bytes), got {self.device_tokens or self.device_nbytes}"
            )
        if host_given and self.num_host_pages < 1:
            raise ValueError(
                f"host pool: expected at least one page ({self.kv.page_size} tokens, "
                f"{self.kv.page_nbytes} bytes), got {host_given[0]}="
                f"{getattr(self, host_given[0])}"
            )
        _set_int(self, "host_reserve_nbytes", minimum=0)
        object.__setattr__(self, "write_policy", check_enum(WritePolicy, "write_policy", self.write_policy))
        object.__setattr__(self, "eviction", check_enum(EvictionPolicy, "eviction", self.eviction))
        object.__setattr__(
            self, "prefetch_policy", check_enum(PrefetchPolicy, "prefetch_policy", self.prefetch_policy)
        )
        _set_int(self, "backup_hit_threshold", minimum=1)
        _set_int(self, "load_threshold_tokens", minimum=0)
        if self.executor not in ("auto", "cuda", "thread", "manual", "immediate"):
            raise ValueError(
                "executor: expected 'auto', 'cuda', 'thread', 'manual' or 'immediate', "
                f"got {self.executor!r}"
            )
        if self.tree not in ("python", "native", "auto"):
            raise ValueError(f"tree: expected 'python', 'native' or 'auto', got {self.tree!r}")
        if self.lifecycle not in ("python", "native", "auto"):
            raise ValueError(
                f"lifecycle: expected 'python', 'native' or 'auto', got {self.lifecycle!r}"
            )
        if self.lifecycle == "native" and (
            self.allocate_kv or self.storage is not None or self.tree == "python"
            or self.kv.component_specs
        ):
            raise ValueError(
                "lifecycle='native' runs bookkeeping-only caches of single-kind models over "
                "the native tree: expected allocate_kv=False, storage=None, no kv.components "
                f"and tree 'native' or 'auto', got allocate_kv={self.allocate_kv}, "
                f"storage={self.storage!r}, tree={self.tree!r}, "
                f"kv.components={describe_components(self.kv.component_specs)!r}"
            )
        check_seconds("prefetch_timeout_s", self.prefetch_timeout_s)
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra: expected dict, got {type(self.extra).__name__}")
        check_bool("allocate_kv", self.allocate_kv)
        check_optional_str("storage", self.storage)
        check_secret("storage_secret", self.storage_secret)
        if self.model_id is not None:
            check_model_id(self.model_id)
        if self.storage is not None and self.model_id is None:
            raise ValueError(
                "model_id: a storage tier is shared by every cache that opens it, so its "
                "keys must name the model whose KV they hold; expected a model_id "
                "(hicache.storage.model_identity(name, weights_digest=... or revision=..., "
                f"dtype=..., tp_rank=...)) with storage={self.storage!r}, got None"
            )
        check_fraction("max_pinned_fraction", self.max_pinned_fraction)
        check_bool("kv_events", self.kv_events)
        check_fraction("component_device_fraction", self.component_device_fraction)
        check_fraction("component_host_fraction", self.component_host_fraction)
        if self.kv.component_specs and self.storage is not None:
            raise ValueError(
                "storage: a third tier does not keep a hybrid model's components yet "
                f"(kv.components={describe_components(self.kv.component_specs)!r}); expected "
                f"storage=None, got {self.storage!r}"
            )

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def num_device_pages(self) -> int:
        if self.device_tokens is not None:
            return self.device_tokens // self.kv.page_size
        return self.device_nbytes // self.kv.page_nbytes  # type: ignore[operator]

    @property
    def has_host_tier(self) -> bool:
        return any(getattr(self, n) is not None for n in HOST_SIZE_FIELDS)

    @property
    def num_host_pages(self) -> int:
        """Host pool pages; 0 when there is no host tier."""
        if self.host_tokens is not None:
            return self.host_tokens // self.kv.page_size
        if self.host_nbytes is not None:
            return self.host_nbytes // self.kv.page_nbytes
        if self.host_gb is not None:
            return int(self.host_gb * 1e9) // self.kv.page_nbytes
        if self.host_ratio is not None:
            return int(self.num_device_pages * self.host_ratio)
        return 0

    # ------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, env: bool = False) -> CacheConfig:
        """A config from plain data: the field names of this class, ``kv`` a mapping of
        :class:`KVConfig` fields. Unknown keys and bad values raise ``ValueError`` /
        ``TypeError`` naming the field. ``env=True`` applies ``HICACHE_*`` overrides
        first (see :func:`hicache.configfile.apply_env`)."""
        return config_from_dict(cls, data, env=env)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, env: bool = True) -> CacheConfig:
        """A config from a JSON or YAML file (by extension; YAML needs PyYAML), with
        ``HICACHE_*`` environment overrides applied unless ``env=False``."""
        return config_from_file(cls, path, env=env)

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`from_dict` turns back into an equal config."""
        return config_to_dict(self)
