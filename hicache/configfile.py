"""CacheConfig from plain data, a JSON or YAML file, and ``HICACHE_*`` environment variables.

A file holds the fields of :class:`hicache.CacheConfig`, with the KV shape under
``kv``::

    kv: {num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16, page_size: 16}
    device_tokens: 200000
    host_gb: 64
    write_policy: write_through

Environment variables override single fields, as deployments set them:
``HICACHE_<FIELD>`` for a top-level field (``HICACHE_HOST_GB=32``) and
``HICACHE_KV_<FIELD>`` for a KV field (``HICACHE_KV_PAGE_SIZE=32``). Setting one
size option of a tier replaces whichever size option the file gave that tier
(``HICACHE_HOST_GB`` replaces a file's ``host_tokens``). Values are parsed by
the field's type: integers (``_`` separators allowed), numbers, ``true``/``false``,
``none`` for an optional field, JSON for ``extra``. Every mistake is a
``ValueError`` or ``TypeError`` naming the field (and the variable or file).

This module knows only configuration: it allocates nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from hicache.config import DEVICE_SIZE_FIELDS, HOST_SIZE_FIELDS, CacheConfig, KVConfig

ENV_PREFIX = "HICACHE_"

# Field kinds, for parsing environment strings.
_INT = {"device_tokens", "device_nbytes", "host_tokens", "host_nbytes", "host_reserve_nbytes",
        "backup_hit_threshold", "load_threshold_tokens", "num_layers", "num_kv_heads",
        "head_dim", "page_size"}
_FLOAT = {"host_ratio", "host_gb", "prefetch_timeout_s"}
_BOOL = {"allocate_kv"}
_JSON = {"extra"}


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _parse_env(name: str, field: str, text: str) -> Any:
    value = text.strip()
    optional = field in DEVICE_SIZE_FIELDS or field in HOST_SIZE_FIELDS or field == "storage"
    if optional and value.lower() in ("", "none", "null"):
        return None
    try:
        if field in _INT:
            return int(value.replace("_", ""))
        if field in _FLOAT:
            return float(value)
        if field in _JSON:
            return json.loads(value)
    except ValueError:
        kind = "an integer" if field in _INT else "a number" if field in _FLOAT else "JSON"
        raise ValueError(f"{name}: {field}: expected {kind}, got {text!r}") from None
    if field in _BOOL:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: {field}: expected true or false, got {text!r}")
    return value


def apply_env(data: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict:
    """``data`` with every ``HICACHE_<FIELD>`` / ``HICACHE_KV_<FIELD>`` variable applied."""
    environ = os.environ if environ is None else environ
    out = dict(data)
    kv = dict(out.get("kv") or {}) if isinstance(out.get("kv", {}), Mapping) else out.get("kv")
    for field in _fields(CacheConfig):
        if field == "kv":
            continue
        name = ENV_PREFIX + field.upper()
        if name not in environ:
            continue
        value = _parse_env(name, field, environ[name])
        for group in (DEVICE_SIZE_FIELDS, HOST_SIZE_FIELDS):
            if field in group:  # one size option per tier: the variable replaces the file's
                for other in group:
                    out.pop(other, None)
        out[field] = value
    for field in _fields(KVConfig):
        name = f"{ENV_PREFIX}KV_{field.upper()}"
        if name in environ:
            if not isinstance(kv, dict):
                raise TypeError(f"kv: expected a mapping of KV fields, got {type(kv).__name__}")
            kv[field] = _parse_env(name, field, environ[name])
    if kv or "kv" in out:
        out["kv"] = kv
    return out


def config_from_dict(data: Mapping[str, Any], *, env: bool = False) -> CacheConfig:
    """See :meth:`hicache.CacheConfig.from_dict`."""
    if not isinstance(data, Mapping):
        raise TypeError(f"config: expected a mapping of fields, got {type(data).__name__}")
    if env:
        data = apply_env(data)
    known = _fields(CacheConfig)
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"config: unknown field {unknown[0]!r}; expected some of "
                         f"{', '.join(known)}")
    if "kv" not in data:
        raise ValueError("kv: missing; expected a mapping of KV fields "
                         f"({', '.join(_fields(KVConfig))})")
    kv = data["kv"]
    if isinstance(kv, Mapping):
        kv_known = _fields(KVConfig)
        bad = sorted(str(k) for k in kv if k not in kv_known)
        if bad:
            raise ValueError(f"kv: unknown field {bad[0]!r}; expected some of "
                             f"{', '.join(kv_known)}")
        try:
            kv = KVConfig(**kv)
        except TypeError as exc:
            if "required positional argument" in str(exc):
                missing = [f for f, spec in kv_known.items()
                           if f not in data["kv"] and spec.default is dataclasses.MISSING]
                raise ValueError(f"kv: missing {', '.join(missing)}") from None
            raise TypeError(f"kv: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"kv: {exc}") from None
    elif not isinstance(kv, KVConfig):
        raise TypeError(f"kv: expected a mapping of KV fields, got {type(kv).__name__}")
    fields = {k: v for k, v in data.items() if k != "kv"}
    return CacheConfig(kv=kv, **fields)


def config_from_file(path: str | os.PathLike[str], *, env: bool = True) -> CacheConfig:
    """See :meth:`hicache.CacheConfig.from_file`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{path}: expected a .json, .yaml or .yml file, got {suffix!r}")
    text = path.read_text(encoding="utf-8")  # OSError names the file
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml, or the "
                             "package's 'yaml' extra); or write the config as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: invalid YAML ({exc})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of config fields, got "
                         f"{type(data).__name__}")
    try:
        return config_from_dict(data, env=env)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


def config_to_dict(config: CacheConfig) -> dict[str, Any]:
    """See :meth:`hicache.CacheConfig.to_dict`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "kv":
            value = {
                k.name: (str(getattr(value, k.name)).removeprefix("torch.")
                         if k.name == "dtype" else getattr(value, k.name))
                for k in dataclasses.fields(value)
            }
        elif isinstance(value, Enum):
            value = value.value
        elif f.name == "extra":
            value = dict(value)
        out[f.name] = value
    return out
