"""The scheduler half's per-request bookkeeping: what vLLM scheduled, and what is known.

:class:`ScheduledRequest` is one request of vLLM's scheduler output, in plain
values (the connector converts vLLM's objects); :class:`RequestState` is what
the scheduler half remembers about a live request between calls. Neither knows
the tree, the page allocator or storage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hicache.integrations.vllm.common.handoff import Handoff
from hicache.integrations.vllm.scheduler.inputs import identity_ids
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
    # Hybrid models: every KV cache group's blocks added (new_block_ids is the full-
    # attention group's); None otherwise, or when none were added
    group_block_ids: list[list[int]] | None = None
    num_prompt_tokens: int | None = None  # None: unknown (taken as a prompt chunk)


class RequestState:
    """One live request, from its first lookup (or first scheduling) until it finishes."""

    __slots__ = ("token_ids", "namespace", "block_ids", "num_checked_pages", "key", "keys",
                 "lookup", "vllm_hit_pages", "skip_load", "skip_save", "max_save_pages",
                 "prefetched", "inputs", "tables", "states", "loading", "handoff")

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
        # Pages whose KV depends on more than their tokens (multimodal items, prompt
        # embeddings): page index -> digest of those inputs (inputs.py)
        self.inputs: Mapping[int, bytes] = {}
        # Hybrid models: every KV cache group's block table (block_ids is the full-
        # attention group's), and the recurrent states vLLM handed over that this
        # step's forward computes: boundary token -> {group id: block id}
        self.tables: list[list[int]] | None = None
        self.states: dict[int, dict[int, int]] = {}
        # (first, end) pages of its asynchronous load until vLLM reported it done: its
        # blocks there hold nothing to save yet (a failed one's never will)
        self.loading: tuple[int, int] | None = None
        self.handoff: Handoff | None = None  # pages a prefill instance stored for it

    def identity_ids(self, first: int, end: int, page_size: int) -> np.ndarray:
        """What pages ``first .. end-1`` are keyed by: their token ids, or for a page
        with other inputs, ids derived from both (:func:`~.inputs.identity_ids`)."""
        if not self.inputs:
            return np.asarray(self.token_ids[first * page_size:end * page_size])
        return identity_ids(self.token_ids, self.inputs, first, end, page_size)

    def tree_key(self, num_pages: int, page_size: int) -> bytes:
        """The tree key of the first ``num_pages`` pages. Built once per page: a request's
        token ids only grow (vLLM appends the sampled ones to the same sequence), so the
        key of its leading pages never changes."""
        P = page_size
        have = len(self.key) // (4 * P)  # token_key: 4 bytes (int32) a token
        if num_pages > have:
            self.key += token_key(self.identity_ids(have, num_pages, P), P)
        return self.key[: num_pages * P * 4]

    def follow_tables(self, new: Sequence[Sequence[int]], replace: bool) -> None:
        """vLLM added ``new`` blocks to every group's table (``replace``: they are the
        whole tables now: a new or resumed request)."""
        if replace or self.tables is None:
            self.tables = [list(ids) for ids in new]
        else:
            for table, ids in zip(self.tables, new, strict=True):
                table.extend(ids)

    def set_tokens(self, token_ids: Sequence[int]) -> None:
        """The request's token ids now. vLLM hands the same sequence every time and only
        appends to it, so the keys built from its leading pages stay valid; another
        sequence object may hold other tokens, and the keys are built again."""
        if token_ids is not self.token_ids:
            self.token_ids = token_ids
            self.key = b""
            self.keys = []
