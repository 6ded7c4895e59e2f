"""The connector's options, validated once at start-up.

Four sources, each naming fields the same way (those of :class:`ConnectorConfig`),
in this order of precedence, highest first::

    kv_connector_extra_config  >  HICACHE_<FIELD> variables  >  $HICACHE_CONFIG_FILE  >  defaults

The file is YAML (``.yaml``/``.yml``) or JSON (``.json``), a flat mapping of fields; a
variable's text is parsed by the field's type (numbers, ``true``/``false``, ``none``
for an optional number, JSON for ``storage_options``, JSON or ``0,1,2`` for
``copy_cpus``). A higher source's ``host_gb`` replaces a lower one's ``host_tokens``
and the reverse (one size per tier, as in :mod:`hicache.configfile`).

Both halves of the connector (scheduler and workers, different processes) build the
config with :meth:`ConnectorConfig.from_sources`, so a bad value stops vLLM at
start-up with one ``ValueError``/``TypeError`` that names the field and where it came
from (``kv_connector_extra_config.host_gb``, ``HICACHE_HOST_GB: host_gb``,
``/etc/hicache.yaml: host_gb``), not on the first request; a storage secret never
appears in one. This module imports neither vLLM nor torch tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.checks import (
    check_bounds,
    check_choice,
    check_finite,
    check_int,
    check_number,
    parse_text,
)
from hicache.errors import config_errors
from hicache.integrations.vllm.common.audit import AUDIT_ACTIONS
from hicache.storage.auth import check_secret

_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# SGLang HiCache's prefetch policies, plus "sync" (read inside vLLM's step, as before)
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout", "sync")
_EVICTIONS = ("lru", "lfu")
_TREES = ("auto", "python", "native")
_EXECUTORS = ("auto", "sync", "thread", "cuda", "manual")
DEFAULT_HOST_GB = 4.0
GB = 10**9  # host_gb, host_reserve_gb: GB as CacheConfig.host_gb (and SGLang's --hicache-size)


# Upper bounds: far beyond any machine, and inside int64 once turned into bytes or
# pages, so a typo (1e30) is refused here rather than overflowing in a worker.
MAX_GB = 4.0 * 2**30  # GB: about 4 EB
MAX_INT = 1 << 62
MAX_CPU = 1 << 16  # CPU ids: Linux's NR_CPUS is at most 8192


def _number(name: str, value: object, *, minimum: float, strict: bool,
            maximum: float = MAX_GB, max_included: bool = False) -> float:
    """``value`` as a finite number between ``minimum`` (excluded when ``strict``) and
    ``maximum`` (included when ``max_included``). NaN and infinities, valid in the
    JSON vLLM parses, are refused here, not in a worker."""
    full = f"kv_connector_extra_config.{name}"
    number = check_finite(full, check_number(full, value, show_value=True))
    return check_bounds(full, number, minimum=minimum, strict=strict, maximum=maximum,
                        max_included=max_included)


def _int(name: str, value: object, *, minimum: int, maximum: int = MAX_INT) -> int:
    return check_int(f"kv_connector_extra_config.{name}", value, minimum, maximum,
                     what="an int", show_value=True)


# Number options of the storage backends (hicache/storage/__init__.py lists them): the
# int ones, and the float ones with their range (keywords of _number). Checked
# here so a bad one stops the scheduler at start-up, not a worker when it opens the
# backend; the backends check names and the other types.
_STORAGE_INTS = ("capacity_nbytes", "segment_nbytes", "local_buffer_nbytes")
_STORAGE_FLOATS: dict[str, dict[str, Any]] = {
    "low_watermark": {"minimum": 0, "strict": True, "maximum": 1, "max_included": True},
    "connect_timeout_s": {"minimum": 0, "strict": True},
    "retry_after_s": {"minimum": 0, "strict": False},
    "epoch_refresh_s": {"minimum": 0, "strict": True},
    "epoch_wait_s": {"minimum": 0, "strict": False},
}


def _storage_options(options: dict) -> None:
    for key, value in options.items():
        name = f"storage_options.{key}"
        if key in _STORAGE_INTS:
            _int(name, value, minimum=1)
        elif key in _STORAGE_FLOATS:
            _number(name, value, **_STORAGE_FLOATS[key])
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"kv_connector_extra_config.{name}: expected a finite "
                             f"number, got {value}")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    return check_choice(f"kv_connector_extra_config.{name}", value, allowed)  # type: ignore[return-value]


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` may set (every field optional)."""

    host_gb: float | None = None  # host tier per worker, GB of 10**9 bytes (default 4 without host_tokens)
    host_tokens: int | None = None  # host tier size in tokens (rounded down to whole blocks)
    host_reserve_gb: float = 2.0  # host memory (GB) the pool must leave to the rest of the machine
    storage: str | None = None  # third tier: "file:DIR" or "mooncake://HOST:PORT?metadata=URL"
    storage_options: dict = field(default_factory=dict, compare=False)  # backend keywords
    # When a block gets its host copy: "write_through" (when computed),
    # "write_through_selective" (once vLLM's prefix cache served it backup_hit_threshold
    # times) or "write_back" (when vLLM evicts it from its prefix cache for reuse)
    write_policy: str = "write_through"
    backup_hit_threshold: int = 2  # write_through_selective: hits before the save (as CacheConfig)
    eviction: str = "lru"  # host tier eviction order: "lru" or "lfu"
    load_threshold_tokens: int = 0  # host/storage hits shorter than this are recomputed
    tree: str = "auto"  # radix tree implementation: "auto", "python" or "native"
    executor: str = "auto"  # worker copies: "auto" (cuda on GPU; on CPU see worker.py), ...
    copy_cpus: list[int] | None = None  # CPU: pin the copy threads here (executor thread/auto)
    model_id: str | None = None  # storage identity override (default: derived from vLLM)
    # A third-tier read in vLLM's step waits at most this long (a hung store or NFS mount
    # must not hang the engine): what has not arrived is a load error, recomputed.
    storage_timeout_s: float = 5.0
    # Third-tier hits: read in the background while the request waits (see
    # hicache/integrations/vllm/scheduler/prefetch.py) under "best_effort", "wait_complete" or
    # "timeout"; "sync" reads them inside vLLM's step. A hit is read when reading it is
    # expected to take less than computing its tokens (both measured, scheduler/costs.py);
    # with prefetch_threshold_tokens set, when it has at least that many tokens beyond the
    # host tier's and vLLM's hit instead (SGLang's fixed prefetch_threshold, 256 there).
    prefetch_policy: str = "timeout"
    prefetch_threshold_tokens: int | None = None
    # "timeout": a request waits at most base + per_ki_token * tokens / 1024 seconds
    # (SGLang's prefetch_timeout_base, prefetch_timeout_per_ki_token), capped at max.
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25
    prefetch_timeout_max_s: float = 30.0
    # kv_role "kv_consumer" (a decode instance) saves nothing unless this is on; on, it
    # saves what it computes (host tier and third tier), so that the next turn's prefill
    # reuses the decode instance's KV (as vLLM's MooncakeStoreConnector's save_decode_cache)
    save_decode: bool = False
    # kv_role "kv_producer" (a prefill instance) loads nothing from the third tier unless
    # this is on (its own host tier still serves it); on, prefill instances share prefixes
    # through the third tier, as SGLang HiCache's prefill instances share their L3.
    producer_reads_storage: bool = False
    # A request handed off by a prefill instance (its kv_transfer_params name the pages
    # the prefill stored, see scheduler/handoff.py) waits at most this long for exactly
    # those pages to land in the third tier, then computes what did not come. They land
    # in tens of ms; the default covers the prefill's own storage_timeout_s (after which
    # it gives its writes up) twice over, for a loaded or stalled machine.
    handoff_timeout_s: float = 10.0
    # reset_prefix_cache(reset_connector=True) bumps the third tier's epoch (its pages of
    # the old weights miss from then on, for every process sharing the tier)
    storage_epoch_on_reset: bool = True
    # The run-time KV audit (scheduler/audit.py): this share of the requests with a hit is
    # not served it; vLLM computes those blocks and the workers compare them with the
    # pages the hit would have served. "count": a page found wrong is counted, logged and
    # taken out of service; "stop_loads": and no hit is served from then on.
    audit_rate: float = 0.0
    audit_action: str = "count"
    # Storage secret: pages are tagged and verified (None: $HICACHE_STORAGE_SECRET). Never
    # shown; from the file or the environment only (kv_connector_extra_config refuses it).
    storage_secret: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    @config_errors
    def from_sources(cls, extra: Mapping[str, Any] | None,
                     environ: Mapping[str, str] | None = None) -> ConnectorConfig:
        """``extra`` (``kv_connector_extra_config``) over the ``HICACHE_*`` variables of
        ``environ`` (default ``os.environ``) over the file ``$HICACHE_CONFIG_FILE`` names
        over the defaults; every mistake names its field and its source."""
        environ = os.environ if environ is None else environ
        layers: list[tuple[str, dict[str, Any]]] = []
        path = environ.get(CONFIG_FILE_ENV)
        if path:
            layers.append((path, _read_file(path)))
        layers += _env_layers(environ)
        layers.append((EXTRA, _refuse_secret(dict(extra or {}))))
        merged: dict[str, Any] = {}
        origin: dict[str, str] = {}
        allowed = sorted(cls.__dataclass_fields__)
        for source, values in layers:
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                raise ValueError(f"{source}: unknown field(s) {unknown}; expected some of "
                                 f"{allowed}")
            if _SIZES & values.keys():  # one size per tier: this source's replaces the others'
                for name in _SIZES - values.keys():
                    merged.pop(name, None)
                    origin.pop(name, None)
            merged.update(values)
            origin.update(dict.fromkeys(values, source))
        try:
            return cls(**merged)
        except (ValueError, TypeError) as exc:
            raise type(exc)(_relabel(str(exc), origin)) from None

    @classmethod
    @config_errors
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; unknown keys are an error, not ignored."""
        extra = _refuse_secret(dict(extra or {}))
        allowed = sorted(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown field(s) {unknown}; expected some of {allowed}"
            )
        return cls(**extra)

    @config_errors
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
        _storage_options(self.storage_options)
        _number("storage_timeout_s", self.storage_timeout_s, minimum=0, strict=True,
                maximum=3600, max_included=True)
        _choice("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        if self.prefetch_threshold_tokens is not None:
            _int("prefetch_threshold_tokens", self.prefetch_threshold_tokens, minimum=0)
        for name in ("storage_epoch_on_reset", "save_decode", "producer_reads_storage"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"kv_connector_extra_config.{name}: expected a bool, got "
                                f"{getattr(self, name)!r}")
        _number("handoff_timeout_s", self.handoff_timeout_s, minimum=0, strict=False,
                maximum=3600, max_included=True)
        _number("prefetch_timeout_base_s", self.prefetch_timeout_base_s, minimum=0,
                strict=False, maximum=3600, max_included=True)
        _number("prefetch_timeout_per_ki_token_s", self.prefetch_timeout_per_ki_token_s,
                minimum=0, strict=False, maximum=3600, max_included=True)
        _number("prefetch_timeout_max_s", self.prefetch_timeout_max_s, minimum=0,
                strict=True, maximum=3600, max_included=True)
        _number("audit_rate", self.audit_rate, minimum=0, strict=False, maximum=1,
                max_included=True)
        _choice("audit_action", self.audit_action, AUDIT_ACTIONS)
        _choice("write_policy", self.write_policy, _WRITE_POLICIES)
        _int("backup_hit_threshold", self.backup_hit_threshold, minimum=1)
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
            if not self.copy_cpus or not 0 <= min(self.copy_cpus) <= max(self.copy_cpus) < MAX_CPU:
                raise ValueError(
                    "kv_connector_extra_config.copy_cpus: expected one or more CPU ids >= 0 "
                    f"and < {MAX_CPU}, "
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

    def prefetch_budget_s(self, num_tokens: int) -> float:
        """How long a request waits for a prefetch of ``num_tokens`` under "timeout"."""
        return min(self.prefetch_timeout_max_s, self.prefetch_timeout_base_s
                   + self.prefetch_timeout_per_ki_token_s * num_tokens / 1024)

    def num_host_pages(self, page_size: int, page_nbytes: int) -> int:
        """Host pages per worker for pages of ``page_size`` tokens and ``page_nbytes`` bytes."""
        if self.host_tokens is not None:
            num = self.host_tokens // page_size
        else:
            gb = DEFAULT_HOST_GB if self.host_gb is None else self.host_gb
            num = int(gb * GB) // page_nbytes
        if num < 1:
            raise ValueError(
                "kv_connector_extra_config: the host tier holds no whole block "
                f"({page_size} tokens, {page_nbytes} bytes); raise host_gb or host_tokens"
            )
        return num

    @property
    def host_reserve_nbytes(self) -> int:
        return int(self.host_reserve_gb * GB)


# ------------------------------------------------------------------ sources
EXTRA = "kv_connector_extra_config"
ENV_PREFIX = "HICACHE_"
CONFIG_FILE_ENV = "HICACHE_CONFIG_FILE"
_SIZES = frozenset({"host_gb", "host_tokens"})
# vLLM prints its configuration at start-up (the "non-default args" line, kv_transfer_config
# included) and `vllm serve` carries it on its command line: no place for a secret.
SECRET_IN_EXTRA = (
    f"{EXTRA}.storage_secret: refused (vLLM logs its configuration and `vllm serve` shows "
    f"it on the command line); set HICACHE_STORAGE_SECRET in the environment of every "
    f"vLLM process, or storage_secret in the file ${CONFIG_FILE_ENV} names"
)


def _refuse_secret(extra: dict[str, Any]) -> dict[str, Any]:
    if "storage_secret" in extra:
        raise ValueError(SECRET_IN_EXTRA)  # never the value
    return extra


def _read_file(path: str) -> dict[str, Any]:
    """The mapping in ``path``; errors name the file (and for YAML the line, never a
    line's text: it could be a secret)."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{CONFIG_FILE_ENV}={path}: expected a .yaml, .yml or .json file, "
                         f"got {suffix!r}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{CONFIG_FILE_ENV}={path}: cannot read it ({exc.strerror})") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    else:
        import yaml  # a vLLM dependency

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or "not YAML"
            raise ValueError(f"{path}: invalid YAML ({problem}{where})") from None
    if data is None:
        return {}  # an empty file
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of connector fields, got "
                         f"{type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def _env_layers(environ: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """One single-field layer per ``HICACHE_<FIELD>`` variable set (so that an error
    names the variable)."""
    hints = typing.get_type_hints(ConnectorConfig)
    out = []
    for name in ConnectorConfig.__dataclass_fields__:
        var = ENV_PREFIX + name.upper()
        if var in environ:
            out.append((var, {name: _parse_env(var, name, hints[name], environ[var])}))
    return out


def _parse_env(var: str, name: str, hint: Any, text: str) -> Any:
    args = set(typing.get_args(hint)) or {hint}
    optional = type(None) in args
    kinds = {typing.get_origin(a) or a for a in args} - {type(None)}
    value = text.strip()
    if optional and value.lower() in ("", "none", "null") and str not in kinds:
        return None
    if str in kinds:
        return value if value or not optional else None
    for kind in (bool, float, int, dict, list):  # float before int: a float field takes 1
        if kind in kinds:
            return parse_text(f"{var}: {name}", text, kind)
    raise TypeError(f"{var}: {name}: no parser for the field's type {hint}")


def _relabel(message: str, origin: Mapping[str, str]) -> str:
    """A validation message (written for ``kv_connector_extra_config``) naming the source
    of the field it is about instead."""
    m = re.match(rf"{EXTRA}\.([a-z_]+)", message)
    if m:
        source = origin.get(m.group(1), EXTRA)
        return message if source == EXTRA else f"{source}: {message[len(EXTRA) + 1:]}"
    others = [f"{name} from {source}" for name, source in origin.items()
              if source != EXTRA and re.search(rf"\b{name}\b", message)]
    return f"{message} ({', '.join(others)})" if others else message
