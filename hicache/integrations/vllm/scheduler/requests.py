"""The scheduler half's per-request bookkeeping: what vLLM scheduled, and what is known.

:class:`ScheduledRequest` is one request of vLLM's scheduler output, in plain
values (the connector converts vLLM's objects); :class:`RequestState` is what
the scheduler half remembers about a live request between calls. Neither knows
the tree, the page allocator or storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache.integrations.vllm.common.handoff import Handoff
from hicache.tree import token_key


@dataclass
class ScheduledRequest:
    """What one request does this step, from vLLM's scheduler output."""

    req_id: str
    token_ids: Sequence[int]  # every known token of the request (prompt + outputs so far)
    new_block_ids: list[int] | None  # blocks added this step (all its blocks if resumed/new)
    resumed: bool  # True: new_block_ids replace the request's blocks (new or resumed)
    num_computed_tokens: int  # computed before this step
    num_scheduled_tokens: int  # computed by this step
    namespace: str | None = None  # vLLM's cache_salt: pages are shared within one only


class RequestState:
    """One live request, from its first lookup (or first scheduling) until it finishes."""

    __slots__ = ("token_ids", "namespace", "block_ids", "num_checked_pages", "key", "keys",
                 "lookup", "vllm_hit_pages", "skip_load", "skip_save", "max_save_pages",
                 "prefetched", "handoff")

    def __init__(self, token_ids: Sequence[int], namespace: str | None = None) -> None:
        self.token_ids = token_ids
        self.namespace = namespace  # vLLM's cache_salt (tree namespace, storage tenant)
        self.block_ids: list[int] = []
        self.num_checked_pages = 0  # leading pages already saved or found in the tree
        self.key = b""  # tree key of the leading whole pages (built lazily: tree_key)
        self.keys: list[str] = []  # storage keys of the leading pages (computed lazily)
        self.lookup: tuple[int, int, int] | None = None  # (num_computed, host, storage pages)
        self.vllm_hit_pages = 0  # whole pages vLLM's own prefix cache served (last lookup)
        # Per-request control (params.py): no loads, no saves, save at most this many pages
        self.skip_load = False
        self.skip_save = False
        self.max_save_pages: int | None = None
        # (first, end) pages of its prefetch from the third tier (at most one a request)
        self.prefetched: tuple[int, int] | None = None
        self.handoff: Handoff | None = None  # pages a prefill instance stored for it

    def tree_key(self, num_pages: int, page_size: int) -> bytes:
        """The tree key of the first ``num_pages`` pages. Built once per page: a request's
        token ids only grow (vLLM appends the sampled ones to the same sequence), so the
        key of its leading pages never changes."""
        P = page_size
        have = len(self.key) // (4 * P)  # token_key: 4 bytes (int32) a token
        if num_pages > have:
            self.key += token_key(np.asarray(self.token_ids[have * P: num_pages * P]), P)
        return self.key[: num_pages * P * 4]

    def set_tokens(self, token_ids: Sequence[int]) -> None:
        """The request's token ids now. vLLM hands the same sequence every time and only
        appends to it, so the keys built from its leading pages stay valid; another
        sequence object may hold other tokens, and the keys are built again."""
        if token_ids is not self.token_ids:
            self.token_ids = token_ids
            self.key = b""
            self.keys = []
