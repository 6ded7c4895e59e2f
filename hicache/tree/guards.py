"""What both radix trees check and refuse alike: page size, key bytes, calls from hooks.

The Python tree (:mod:`hicache.tree.python`) and the native one
(:mod:`hicache.tree.native`, whose C++ side words its errors the same) use these,
so that the same bad input or misplaced call gets the same exception and message
from both. Knows nothing of the trees' structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache.checks import check_page_count

MAX_PAGE_SIZE = 2**24  # far above any real page; keeps every size inside C++'s int64
# What the backup hook may call besides reads (hicache/tree/python/__init__.py docstring).
_BACKUP_MAY = "host_lock, host_unlock, attach_host, set_io_status and evict_host"


def check_page_size(page_size: object) -> int:
    """``page_size`` (tokens per page) as an int in [1, MAX_PAGE_SIZE]."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size: expected int, got {type(page_size).__name__}")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size: expected an int in [1, 2**24], got {page_size}")
    return page_size


def check_key(key: object, page_nbytes: int) -> bytes:
    """``key`` as the bytes of whole pages of int32 tokens (what :func:`hicache.tree.token_key` makes)."""
    if type(key) is not bytes:
        if not isinstance(key, bytes | bytearray | memoryview):
            raise TypeError(f"key: expected bytes (hicache.tree.token_key), got {type(key).__name__}")
        key = bytes(key)
    if len(key) % page_nbytes:
        raise ValueError(
            f"key: expected whole pages of int32 tokens ({page_nbytes} bytes each), "
            f"got {len(key)} bytes"
        )
    return key


def reentry_message(op: str, hook: str) -> str:
    """The error of a call a hook may not make (the native tree's words too)."""
    if hook == "on_split":
        return f"{op}: called from inside the on_split hook, which may only read the tree"
    return f"{op}: called from inside the backup hook, which may only read the tree and call {_BACKUP_MAY}"


def check_component(c: object, num_components: int, op: str) -> int:
    """``c`` as the index of one of the tree's ``num_components`` components."""
    if isinstance(c, bool) or not isinstance(c, int):
        raise TypeError(f"{op}: expected a component index (int), got {type(c).__name__}")
    if not 0 <= c < num_components:
        if not num_components:
            raise ValueError(f"{op}: component {c} asked of a tree without components")
        raise ValueError(f"{op}: expected a component index in [0, {num_components}), got {c}")
    return c


def check_tier(tier: object, op: str) -> str:
    """``tier`` as ``"device"`` or ``"host"``."""
    if tier not in ("device", "host"):
        raise ValueError(f"{op}: expected tier 'device' or 'host', got {tier!r}")
    return str(tier)


def check_component_pages(
    components: Any, widths: Sequence[int], num_pages: int
) -> list[torch.Tensor | None]:
    """``components`` of an insert, checked: one entry per component (``widths`` gives
    each one's ids per page), each None or ``num_pages * width`` int64 ids, ``-1`` or
    ``>= 0``, a page's ids all given or all ``-1``. An empty sequence gives nothing."""
    if isinstance(components, torch.Tensor) or not isinstance(components, Sequence):
        raise TypeError(
            f"components: expected a list or tuple (one entry per component), got "
            f"{type(components).__name__}"
        )
    if not components:
        return [None] * len(widths)
    if len(components) != len(widths):
        raise ValueError(
            f"components: expected one entry per component of the tree ({len(widths)}), "
            f"got {len(components)}"
        )
    out: list[torch.Tensor | None] = []
    for c, (ids, width) in enumerate(zip(components, widths, strict=True)):
        if ids is None:
            out.append(None)
            continue
        name = f"components[{c}]"
        check_page_count(name, ids, num_pages * width)
        if ids.numel():
            if int(ids.min()) < -1:
                raise ValueError(f"{name}: expected page ids >= 0 or -1, got {int(ids.min())}")
            given = (ids >= 0).view(num_pages, width)
            if bool((given.any(1) != given.all(1)).any()):
                raise ValueError(f"{name}: expected each page's {width} ids all given or all -1")
        out.append(ids)
    return out
