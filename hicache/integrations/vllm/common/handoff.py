"""The prefill-to-decode hand-off through the third tier: what travels between them.

A prefill instance (``kv_role`` ``kv_producer`` or ``kv_both``) serving a request whose
``kv_transfer_params`` ask for a remote decode (``{"do_remote_decode": true}``, what
vLLM's disaggregation proxies send) writes the request's prompt pages to the third tier
and answers with what it stored, in its output's ``kv_transfer_params``::

    {"hicache": {"handoff": {"pages": N, "epoch": E, "key": "<hex>"}}}

``pages``: the leading whole prompt pages it stored (or is writing); ``epoch``: the
tier's epoch they are keyed under; ``key``: the storage key of the last of them (not
rank-salted). A page key covers every token before it, the tenant, the KV layout, the
model and the epoch, so a decode instance whose own key for that page differs (another
model or revision, another epoch, another namespace, other tokens) would never find
those pages and does not wait for them. vLLM's proxies pass the prefill's output
params on to the decode request, where :mod:`~hicache.integrations.vllm.common.params`
reads them back. This module knows neither vLLM nor the tiers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from hicache.checks import show
from hicache.storage.keys import check_key

HANDOFF_KEY = "handoff"  # kv_transfer_params["hicache"][HANDOFF_KEY]
REMOTE_DECODE_KEY = "do_remote_decode"  # kv_transfer_params[...]: vLLM's P/D proxies
_FIELDS = ("pages", "epoch", "key")


class Handoff(NamedTuple):
    """Pages a prefill instance stored for one request's decode (see the module docstring)."""

    pages: int  # leading whole prompt pages
    epoch: int  # the third tier's epoch they are keyed under
    key: str  # storage key of page ``pages - 1`` (unsalted); "" when pages == 0

    def to_params(self) -> dict[str, Any]:
        return {"pages": self.pages, "epoch": self.epoch, "key": self.key}


def parse_handoff(value: object, where: str) -> Handoff | str:
    """The hand-off in ``value`` (what :meth:`Handoff.to_params` gave), or an error message
    naming ``where``, the field and the value."""
    if not isinstance(value, Mapping):
        return f"{where}: expected a dict, got {type(value).__name__} {show(value)}"
    if not all(isinstance(k, str) for k in value) or sorted(value) != sorted(_FIELDS):
        return f"{where}: expected the keys {list(_FIELDS)}, got {show(sorted(map(show, value)))}"
    pages, epoch, key = value["pages"], value["epoch"], value["key"]
    for name, number in (("pages", pages), ("epoch", epoch)):
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 1 << 63:
            return f"{where}.{name}: expected an int >= 0 (64 bits), got {show(number)}"
    if pages == 0:
        if key != "":
            return f"{where}.key: expected '' with no pages, got {show(key)}"
    else:
        try:
            check_key(key)
        except (TypeError, ValueError) as e:
            return f"{where}.key: {show(str(e))}"
    return Handoff(pages, epoch, key)


def write_failed_key(stored_key: str) -> str:
    """The third-tier key that says "the write of ``stored_key`` (a rank's salted page
    key) failed": a worker whose write stopped short of a page stores a value under it
    (any bytes), and a decode request waiting for that page stops at once instead of
    waiting ``handoff_timeout_s`` for a page that will never come. A page that is
    there is never looked up this way: a marker left behind by an old failure costs at
    most one recompute of a page being written again."""
    return hashlib.blake2b(b"hicache-write-failed|" + stored_key.encode(),
                           digest_size=16).hexdigest()


def asks_remote_decode(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    """The request asks its prefill to hand off to a decode instance (vLLM's proxies send
    ``{"do_remote_decode": true, ...}`` to the prefill instance)."""
    try:
        return isinstance(kv_transfer_params, Mapping) and kv_transfer_params.get(
            REMOTE_DECODE_KEY) is True
    except Exception:  # a mapping that raises: no hand-off (never in vLLM's loop)
        return False
