"""The errors hicache raises on purpose: one base, :class:`HiCacheError`.

``except HiCacheError`` catches every one of them; each also keeps the built-in type
callers caught before there was a base, so that ``except ValueError`` around a config
or ``except RuntimeError`` around a load still works:

    HiCacheError
    ├── ConfigError       (also ValueError)  a configuration value out of range, malformed
    ├── ConfigTypeError   (also TypeError)   a configuration value of the wrong type
    ├── LoadError         (also RuntimeError) a load a request depends on failed
    ├── NativeBuildError  (also RuntimeError) the native extension cannot be built or loaded
    └── StorageError                          a storage backend failed

Bad arguments to the library's calls (a page id out of range, a tensor of the wrong
dtype) stay plain ``ValueError``/``TypeError`` (see :mod:`hicache.checks`): they are
the caller's bug, not a condition to handle. Nothing here imports the rest of hicache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class HiCacheError(Exception):
    """Base of the errors hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value (``CacheConfig``, ``KVConfig``, a config file, a ``HICACHE_*``
    variable, the vLLM connector's extra config) outside what is allowed; the message
    names the field, what was expected and what was given."""


class ConfigTypeError(HiCacheError, TypeError):
    """A configuration value of the wrong type; the message names the field."""


class LoadError(HiCacheError, RuntimeError):
    """A load this request depends on failed: its tokens past ``prefix_len`` must be recomputed."""


class NativeBuildError(HiCacheError, RuntimeError):
    """The native tree cannot be built or loaded here; the message names why."""


class StorageError(HiCacheError):
    """The backend failed (unreachable, gone, I/O error); the cache counts it and carries on."""


def config_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a function that validates configuration: the ``ValueError`` or
    ``TypeError`` it raises comes out as :class:`ConfigError` or :class:`ConfigTypeError`,
    with the same message and traceback (the validators in :mod:`hicache.checks` raise
    the built-in types, shared with argument checks)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (ConfigError, ConfigTypeError):
            raise
        except ValueError as exc:
            raise ConfigError(*exc.args).with_traceback(exc.__traceback__) from exc.__cause__
        except TypeError as exc:
            raise ConfigTypeError(*exc.args).with_traceback(exc.__traceback__) from exc.__cause__

    return wrapper
