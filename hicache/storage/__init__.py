"""Third storage tier: page keys, the backend interface, and the backends.

``make_storage(spec, page_nbytes=...)`` turns a ``--storage`` spec into a backend:

- ``file:DIR``: :class:`FileStorage`, one file per page under DIR (embedded default);
  options ``capacity_nbytes``, ``fsync``, ``low_watermark``, ``shared``, ``adopt``;
- ``mooncake://HOST:PORT?metadata=URL``: :class:`MooncakeStorage` against the
  master at HOST:PORT and the HTTP metadata server at URL; options (keyword or
  query parameters) ``segment_nbytes``, ``local_buffer_nbytes``,
  ``local_hostname``, ``protocol``, ``device_name``, ``connect_timeout_s``,
  ``retry_after_s``, ``epoch_refresh_s``, ``epoch_wait_s``.

Every backend takes ``secret`` (str or bytes): the storage secret that tags and
verifies each page (see ``auth.py``); None falls back to ``$HICACHE_STORAGE_SECRET``.

The Mooncake module is imported only when a mooncake spec is used, so the optional
extra is needed only then.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from hicache.storage.auth import SECRET_ENV, PageAuthenticator
from hicache.storage.base import (
    VALUE_HEADER_NBYTES,
    StorageBackend,
    StorageCounters,
    StorageError,
)
from hicache.storage.file import FileStorage
from hicache.storage.keys import (
    check_key,
    check_model_id,
    extend_keys,
    model_identity,
    page_keys,
    root_key,
)

__all__ = [
    "SECRET_ENV",
    "VALUE_HEADER_NBYTES",
    "FileStorage",
    "PageAuthenticator",
    "StorageBackend",
    "StorageCounters",
    "StorageError",
    "check_key",
    "check_model_id",
    "extend_keys",
    "make_storage",
    "model_identity",
    "page_keys",
    "parse_storage_spec",
    "root_key",
]

SPEC_FORMS = "'file:DIR' or 'mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata'"
_FILE_OPTIONS = {"capacity_nbytes", "fsync", "low_watermark", "shared", "adopt"}
_MOONCAKE_INT_OPTIONS = {"segment_nbytes", "local_buffer_nbytes"}
_MOONCAKE_FLOAT_OPTIONS = {"connect_timeout_s", "retry_after_s", "epoch_refresh_s",
                           "epoch_wait_s"}
_MOONCAKE_STR_OPTIONS = {"local_hostname", "protocol", "device_name"}
_MOONCAKE_OPTIONS = _MOONCAKE_INT_OPTIONS | _MOONCAKE_FLOAT_OPTIONS | _MOONCAKE_STR_OPTIONS


def _check_options(kind: str, options: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"{kind} storage options: expected some of {sorted(allowed)}, got {unknown}"
        )


def parse_storage_spec(spec: object) -> tuple[str, dict[str, Any]]:
    """Check a storage spec's form, opening nothing: ``("file", {"directory": DIR})`` or
    ``("mooncake", {"master": "HOST:PORT", "metadata": URL, **options of its query})``
    (option names checked, numbers parsed). ``TypeError``/``ValueError`` naming the
    expected forms otherwise; callers (the command line) check a spec with it before
    any long work."""
    if not isinstance(spec, str):
        raise TypeError(f"storage spec: expected str ({SPEC_FORMS}), got {type(spec).__name__}")
    if spec.startswith("file:"):
        directory = spec[len("file:") :]
        if not directory:
            raise ValueError(f"storage spec: expected {SPEC_FORMS}, got {spec!r} (no DIR)")
        return "file", {"directory": directory}
    if spec.startswith("mooncake://"):
        parts = urlsplit(spec)
        query = parse_qs(parts.query, keep_blank_values=True)
        metadata = query.pop("metadata", [""])[-1]
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or not metadata or parts.path not in ("", "/"):
            raise ValueError(f"storage spec: expected {SPEC_FORMS}, got {spec!r}")
        merged: dict[str, Any] = {name: values[-1] for name, values in query.items()}
        _check_options("mooncake", merged, _MOONCAKE_OPTIONS)
        for name in _MOONCAKE_INT_OPTIONS & set(merged):
            merged[name] = _parse_number(name, merged[name], int)
        for name in _MOONCAKE_FLOAT_OPTIONS & set(merged):
            merged[name] = _parse_number(name, merged[name], float)
        return "mooncake", {"master": f"{parts.hostname}:{port}", "metadata": metadata,
                            **merged}
    raise ValueError(f"storage spec: expected {SPEC_FORMS}, got {spec!r}")


def make_storage(
    spec: str, *, page_nbytes: int, secret: str | bytes | None = None, **options: Any
) -> StorageBackend:
    """Open the backend named by ``spec`` for pages of ``page_nbytes`` bytes, with the
    storage ``secret`` (None: ``$HICACHE_STORAGE_SECRET``, if set)."""
    kind, target = parse_storage_spec(spec)
    if kind == "file":
        _check_options("file", options, _FILE_OPTIONS)
        return FileStorage(target["directory"], page_nbytes=page_nbytes, secret=secret,
                           **options)
    _check_options("mooncake", options, _MOONCAKE_OPTIONS)
    master, metadata = target.pop("master"), target.pop("metadata")
    target.update(options)
    from hicache.storage.mooncake import MooncakeStorage

    return MooncakeStorage(master, metadata, page_nbytes=page_nbytes, secret=secret, **target)


def _parse_number(name: str, text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}: expected {kind.__name__}, got {text!r}") from None
