"""Per-request control: ``kv_transfer_params={"hicache": {...}}`` on a vLLM request.

vLLM hands a request's ``kv_transfer_params`` (``SamplingParams.extra_args``, or the
OpenAI server's ``kv_transfer_params`` request field) to the connector. Under the key
``"hicache"`` the connector reads:

=================== ======== =====================================================
key                 type     meaning
=================== ======== =====================================================
``skip_load``       bool     nothing is loaded from hicache's tiers for the request
``skip_save``       bool     nothing the request computes is saved to them
``save_max_tokens`` int >= 0 at most this many leading prompt tokens are saved
                             (whole blocks only)
``namespace``       str      a tenant: pages of two namespaces are never shared
                             (combined with vLLM's ``cache_salt``); at most
                             :data:`MAX_NAMESPACE_BYTES` bytes of UTF-8
``handoff``         dict     pages a prefill instance stored for this request
                             (:mod:`~hicache.integrations.vllm.common.handoff`)
=================== ======== =====================================================

A mistake (an unknown key, a value of the wrong type) fails *closed*: raising in
vLLM's scheduler would stop the engine for every request, so the request is
served by vLLM alone (no load, no save, no namespace shared with anyone) and the
error, which names the key and the value, goes back in the request's output
``kv_transfer_params`` as ``hicache_error`` (and to the log). The same holds for a
``cache_salt`` hicache cannot keep (:func:`check_cache_salt`). Whatever the value
(nested, huge, NaN, lone surrogates, a mapping that raises), parsing never raises.
This module knows neither vLLM nor the tree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from hicache.checks import show
from hicache.integrations.vllm.common.handoff import HANDOFF_KEY, Handoff, parse_handoff

PARAMS_KEY = "hicache"  # kv_transfer_params[PARAMS_KEY]
ERROR_KEY = "hicache_error"  # in the request's output kv_transfer_params
_KEYS = ("skip_load", "skip_save", "save_max_tokens", "namespace", HANDOFF_KEY)
# A namespace or a cache_salt is kept (as a tree root, in third-tier key seeds) while it
# has pages: one longer than this many bytes of UTF-8 is refused (fails closed).
MAX_NAMESPACE_BYTES = 256


class RequestControl(NamedTuple):
    """What a request asked of hicache (the defaults: everything on, no namespace)."""

    skip_load: bool = False
    skip_save: bool = False
    save_max_tokens: int | None = None  # None: no limit
    namespace: str | None = None
    handoff: Handoff | None = None  # a prefill instance stored these pages for the request
    error: str | None = None  # set: the params were refused; load and save are off

    @property
    def is_default(self) -> bool:
        return self == DEFAULT


DEFAULT = RequestControl()


def parse_request_control(kv_transfer_params: Mapping[str, Any] | None) -> RequestControl:
    """The control of one request from its ``kv_transfer_params`` (``None``: defaults).

    Never raises: a mistake gives a control with ``error`` set (the message names the
    key and the value) and loads and saves off. Keys other than ``"hicache"`` belong
    to other connectors and are ignored.
    """
    try:
        return _parse(kv_transfer_params)
    except Exception as exc:  # a mapping whose methods raise, ...: never in vLLM's loop
        return _refused(f"kv_transfer_params: cannot be read ({type(exc).__name__})")


def _parse(kv_transfer_params: Mapping[str, Any] | None) -> RequestControl:
    if kv_transfer_params is None:
        return DEFAULT
    if not isinstance(kv_transfer_params, Mapping):
        return _refused(f"kv_transfer_params: expected a dict, got "
                        f"{type(kv_transfer_params).__name__}")
    params = kv_transfer_params.get(PARAMS_KEY)
    if params is None:
        return DEFAULT
    where = f"kv_transfer_params.{PARAMS_KEY}"
    if not isinstance(params, Mapping):
        return _refused(f"{where}: expected a dict, got {type(params).__name__} {show(params)}")
    unknown = sorted(show(k) for k in params if not (isinstance(k, str) and k in _KEYS))
    if unknown:
        return _refused(f"{where}: unknown key(s) [{', '.join(unknown[:8])}]; expected some "
                        f"of {list(_KEYS)}")
    values: dict[str, Any] = {}
    for name in ("skip_load", "skip_save"):
        if name in params:
            value = params[name]
            if not isinstance(value, bool):
                return _refused(f"{where}.{name}: expected true or false, got {show(value)}")
            values[name] = value
    if "save_max_tokens" in params:
        value = params["save_max_tokens"]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            return _refused(f"{where}.save_max_tokens: expected an int >= 0, got {show(value)}")
        values["save_max_tokens"] = value
    if "namespace" in params:
        value = params["namespace"]
        if value is not None:
            error = check_name(value, f"{where}.namespace", empty=False)
            if error is not None:
                return _refused(error)
        values["namespace"] = value
    if HANDOFF_KEY in params:
        handoff = parse_handoff(params[HANDOFF_KEY], f"{where}.{HANDOFF_KEY}")
        if isinstance(handoff, str):
            return _refused(handoff)
        values[HANDOFF_KEY] = handoff
    return RequestControl(**values)


def _refused(message: str) -> RequestControl:
    return RequestControl(skip_load=True, skip_save=True, error=message)


def check_name(value: object, where: str, *, empty: bool) -> str | None:
    """An error message for a namespace or a ``cache_salt`` hicache cannot keep (None:
    it can): not a str, empty (unless ``empty``), not encodable in UTF-8 (a lone
    surrogate), or longer than :data:`MAX_NAMESPACE_BYTES` bytes of UTF-8."""
    if not isinstance(value, str) or (not value and not empty):
        return f"{where}: expected a non-empty str, got {show(value)}"
    if len(value) > MAX_NAMESPACE_BYTES:
        return f"{where}: longer than {MAX_NAMESPACE_BYTES} bytes ({len(value)} characters)"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{where}: not valid UTF-8 (a lone surrogate), got {show(value)}"
    if size > MAX_NAMESPACE_BYTES:
        return f"{where}: longer than {MAX_NAMESPACE_BYTES} bytes of UTF-8 ({size} bytes)"
    return None


# A tree namespace made of a cache_salt and a hicache namespace starts with NUL; a
# cache_salt that does is refused (parse error), so no salt can name another tenant's pages.
_COMBINED = "\x00"
# The namespace of a request whose params or salt were refused (nothing loaded or saved
# in it): no salt and no combination gives it.
REFUSED_NAMESPACE = _COMBINED + "refused"


def tree_namespace(cache_salt: str | None, control: RequestControl,
                   adapter: str | None = None) -> str | None:
    """The namespace of the request's pages in hicache's tiers: vLLM's ``cache_salt``
    alone (unchanged), or with a hicache ``namespace`` and/or a LoRA ``adapter`` (its
    identity, ``name@digest``) all of them, encoded so that no other combination and no
    salt alone gives the same string (the base model is a namespace of its own)."""
    if adapter is not None:
        return _COMBINED + json.dumps([cache_salt, control.namespace, adapter])
    if control.namespace is None:
        return cache_salt
    return _COMBINED + json.dumps([cache_salt, control.namespace])


def check_cache_salt(cache_salt: object) -> str | None:
    """An error message for a ``cache_salt`` hicache cannot keep (:func:`check_name`;
    the empty salt is vLLM's "no salt" and is kept) or cannot keep apart from combined
    namespaces (one that starts with NUL), else None."""
    if cache_salt is None:
        return None
    error = check_name(cache_salt, "cache_salt", empty=True)
    if error is None and isinstance(cache_salt, str) and cache_salt.startswith(_COMBINED):
        return "cache_salt: expected no leading NUL character (hicache's combined namespaces)"
    return error
