"""Third-tier keys per tensor-parallel rank (each rank stores its own shard of a page),
and of a hybrid model's component pages.

Both halves salt a page's key the same way: the scheduler when it asks whether
every rank's shard is stored, each worker when it reads and writes its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def rank_salt(rank: int, world_size: int) -> str | None:
    """The salt of one tensor-parallel rank's storage keys (None with one rank)."""
    return None if world_size <= 1 else f"tp{rank}/{world_size}"


def salt_keys(keys: Sequence[str], salt: str | None) -> list[str]:
    """Per-rank keys: with tensor parallelism each rank stores its own shard of a page."""
    if salt is None:
        return list(keys)
    s = salt.encode()
    return [hashlib.blake2b(s + k.encode(), digest_size=16).hexdigest() for k in keys]


def component_key(page_key: str, tag: str) -> str:
    """The third-tier key of a hybrid model's component page at a page of a request:
    ``page_key`` is that page's chained key (it covers every token up to the page's
    end), ``tag`` names the component and the group in it (``window:128#0``,
    ``state#1``). A window page is keyed by its own page, a state checkpoint by the
    page it ends."""
    return hashlib.blake2b(f"{tag}|{page_key}".encode(), digest_size=16).hexdigest()
