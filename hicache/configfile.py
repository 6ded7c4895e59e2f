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
the field's declared type, so every field has its variable: integers (``_``
separators allowed), numbers, ``true``/``false``, ``none`` for an optional field,
JSON for ``extra``, the string itself for names (enums, dtypes). Every mistake is a
``ValueError`` or ``TypeError`` naming the field (and the variable or file).

This module knows only configuration: it allocates nothing. It imports nothing of
:mod:`hicache.config` (which calls it): every function takes the config class, and
finds the KV class from its ``kv`` field and the size options of each tier from its
``SIZE_FIELD_GROUPS``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from hicache.checks import parse_text
from hicache.errors import config_errors

ENV_PREFIX = "HICACHE_"



class ConfigClass(Protocol):
    """What this module reads of the config class (:class:`hicache.CacheConfig`, which
    imports this module: it is passed in, never imported)."""

    SIZE_FIELD_GROUPS: ClassVar[tuple[tuple[str, ...], ...]]

    def __init__(self, kv: Any, **fields: Any) -> None: ...


C = TypeVar("C", bound=ConfigClass)  # the config class (hicache.CacheConfig)

def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _kv_class(cls: type) -> type:
    """The class of ``cls``'s ``kv`` field (hicache.KVConfig), from its declared type."""
    return typing.get_type_hints(cls)["kv"]


def _env_kind(cls: type, field: str) -> tuple[type, bool]:
    """How ``HICACHE_*`` strings for ``field`` of ``cls`` parse, from its declared type:
    (kind, optional). ``kind`` is bool, int, float, dict (JSON) or str (strings, enums,
    string literals, dtype names: the config checks the value); ``optional`` when the
    type admits ``None``. A type none of these fits is a ``TypeError`` here, so a new
    field cannot go unparsed."""
    hint = typing.get_type_hints(cls)[field]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members: set[Any] = set()
    for member in typing.get_args(hint) if union else (hint,):
        origin = typing.get_origin(member)
        if origin is typing.Literal:  # a literal parses as its values' type
            members |= {type(v) for v in typing.get_args(member)}
        else:
            members.add(origin or member)  # dict[str, Any] parses as a dict
    optional = type(None) in members
    members.discard(type(None))
    for kind in (bool, int, float, dict):  # bool first: a bool is an int too
        if kind in members:
            return kind, optional
    # A tuple beside str is a value that also has a text form (KVConfig.components).
    if all(m in (str, bytes, torch.dtype) or (m is tuple and str in members)
           or isinstance(m, type) and issubclass(m, Enum) for m in members):
        return str, optional
    raise TypeError(f"{cls.__name__}.{field}: no HICACHE_* parser for its type {hint}")


def _parse_env(name: str, cls: type, field: str, text: str) -> Any:
    kind, optional = _env_kind(cls, field)
    value = text.strip()
    if optional and value.lower() in ("", "none", "null"):
        return None
    if kind is str:
        return value
    return parse_text(f"{name}: {field}", text, kind)


@config_errors
def apply_env(cls: type[ConfigClass], data: Mapping[str, Any],
              environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``data`` with every ``HICACHE_<FIELD>`` / ``HICACHE_KV_<FIELD>`` variable of the
    config class ``cls`` (:class:`hicache.CacheConfig`) applied."""
    environ = os.environ if environ is None else environ
    kv_cls = _kv_class(cls)
    out = dict(data)
    kv = dict(out.get("kv") or {}) if isinstance(out.get("kv", {}), Mapping) else out.get("kv")
    for field in _fields(cls):
        if field == "kv":
            continue
        name = ENV_PREFIX + field.upper()
        if name not in environ:
            continue
        value = _parse_env(name, cls, field, environ[name])
        for group in cls.SIZE_FIELD_GROUPS:
            if field in group:  # one size option per tier: the variable replaces the file's
                for other in group:
                    out.pop(other, None)
        out[field] = value
    for field in _fields(kv_cls):
        name = f"{ENV_PREFIX}KV_{field.upper()}"
        if name in environ:
            if not isinstance(kv, dict):
                raise TypeError(f"kv: expected a mapping of KV fields, got {type(kv).__name__}")
            kv[field] = _parse_env(name, kv_cls, field, environ[name])
    if kv or "kv" in out:
        out["kv"] = kv
    return out


@config_errors
def config_from_dict(cls: type[C], data: Mapping[str, Any], *, env: bool = False) -> C:
    """See :meth:`hicache.CacheConfig.from_dict`."""
    kv_cls = _kv_class(cls)
    if not isinstance(data, Mapping):
        raise TypeError(f"config: expected a mapping of fields, got {type(data).__name__}")
    if env:
        data = apply_env(cls, data)
    known = _fields(cls)
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"config: unknown field {unknown[0]!r}; expected some of "
                         f"{', '.join(known)}")
    if "kv" not in data:
        raise ValueError("kv: missing; expected a mapping of KV fields "
                         f"({', '.join(_fields(kv_cls))})")
    kv = data["kv"]
    if isinstance(kv, Mapping):
        kv_known = _fields(kv_cls)
        bad = sorted(str(k) for k in kv if k not in kv_known)
        if bad:
            raise ValueError(f"kv: unknown field {bad[0]!r}; expected some of "
                             f"{', '.join(kv_known)}")
        try:
            kv = kv_cls(**kv)
        except TypeError as exc:
            if "required positional argument" in str(exc):
                missing = [f for f, spec in kv_known.items()
                           if f not in data["kv"] and spec.default is dataclasses.MISSING]
                raise ValueError(f"kv: missing {', '.join(missing)}") from None
            raise TypeError(f"kv: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"kv: {exc}") from None
    elif not isinstance(kv, kv_cls):
        raise TypeError(f"kv: expected a mapping of KV fields, got {type(kv).__name__}")
    fields = {k: v for k, v in data.items() if k != "kv"}
    return cls(kv=kv, **fields)


@config_errors
def config_from_file(cls: type[C], path: str | os.PathLike[str], *, env: bool = True) -> C:
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
        return config_from_dict(cls, data, env=env)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


def _kv_value(kv: Any, name: str) -> Any:
    """A KV field as plain data: a dtype's name, components as their text."""
    value = getattr(kv, name)
    if name == "dtype":
        return str(value).removeprefix("torch.")
    if name == "components":
        return ",".join(spec.describe() for spec in value)
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """See :meth:`hicache.CacheConfig.to_dict`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "kv":
            value = {k.name: _kv_value(value, k.name) for k in dataclasses.fields(value)}
        elif isinstance(value, Enum):
            value = value.value
        elif f.name == "extra":
            value = dict(value)
        out[f.name] = value
    return out
