"""The host tier as vLLM KV cache events: ``BlockStored`` / ``BlockRemoved``, medium ``CPU``.

A KV-aware router subscribes to vLLM's KV events publisher (ZMQ) and learns which
prefixes an engine holds from vLLM's block hashes. The connector's scheduler half
tells :class:`HostTierEvents` which host pages it cached for which request (page ``i``
of a request is its ``i``-th block) and which it evicted; this module announces them
with the request's own ``block_hashes``, in the shape vLLM's block pool uses for its
GPU blocks, with ``medium="CPU"`` as vLLM's offloading connector names host memory.
vLLM's scheduler publishes them with its own events (``take_events``).

Contracts: a host page is announced once while it holds a block (stored when cached,
removed when evicted, never twice); a page that could not be named (no block hash for
it yet) is announced neither way. The events carry what vLLM's own events carry for
the same blocks: the hash already folds in the request's ``cache_salt`` (and LoRA and
multimodal keys), so two tenants' identical prefixes get different hashes here as in
vLLM's cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request


class HostTierEvents:
    """Pending KV cache events of the host tier, and which page announced which hash."""

    def __init__(self, block_size: int, requests: Callable[[str], Request | None],
                 hash_block_size: int | None = None, medium: str = MEDIUM_CPU) -> None:
        """``requests``: vLLM's live ``Request`` of a request id (None once unknown)."""
        self._request = requests
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        self.medium = medium
        self._announced: dict[int, Any] = {}  # host page -> the block hash it was stored as
        self._events: list[KVCacheEvent] = []
        # Host page -> its block's own one-block BlockStored (medium None), kept while
        # the page is announced, for the third tier's events (see tier_events.py).
        self.blocks: dict[int, BlockStored] | None = None

    # The scheduler half's PageListener
    def cached(self, req_id: str, first_page: int, host_pages: list[int]) -> None:
        request = self._request(req_id)
        if request is not None:
            self.stored(request, first_page, host_pages)

    def evicted(self, host_pages: list[int]) -> None:
        self.removed(host_pages)

    def stored(self, request: Request, first_block: int, host_pages: Sequence[int]) -> None:
        """``host_pages`` now hold blocks ``first_block, first_block + 1, ...`` of
        ``request``: one ``BlockStored`` for the run (the pages a request caches at once
        continue one chain). Blocks without a hash yet end the run (not announced)."""
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size,
                                      self.block_size)
        n = min(len(host_pages), max(0, len(hashes) - first_block))
        if n == 0:
            return
        pages = [int(p) for p in host_pages[:n]]
        twice = [p for p in pages if p in self._announced]
        assert not twice, f"host pages {twice} announced again before their removal"
        new = [maybe_convert_block_hash(hashes[first_block + i]) for i in range(n)]
        self._announced.update(zip(pages, new, strict=True))
        P = self.block_size
        start, end = first_block * P, (first_block + n) * P
        extra, mm_idx = [], 0
        for i in range(first_block, first_block + n):  # as vLLM's block pool does
            keys, mm_idx = generate_block_hash_extra_keys(request, i * P, (i + 1) * P, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        parent = maybe_convert_block_hash(hashes[first_block - 1]) if first_block else None
        tokens = list(request.all_token_ids[start:end])
        run = functools.partial(
            BlockStored, block_size=P, lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None, group_idx=0,
            session_id=getattr(request, "session_id", None))
        self._events.append(run(block_hashes=new, parent_block_hash=parent, token_ids=tokens,
                                medium=self.medium, extra_keys=to_event_extra_keys(extra)))
        if self.blocks is not None:
            for i, page in enumerate(pages):
                self.blocks[page] = run(
                    block_hashes=[new[i]], parent_block_hash=new[i - 1] if i else parent,
                    token_ids=tokens[i * P:(i + 1) * P], medium=None,
                    extra_keys=to_event_extra_keys(extra[i:i + 1]))

    def removed(self, host_pages: Sequence[int]) -> None:
        """``host_pages`` left the host tier: one ``BlockRemoved`` of the hashes they
        were announced with (pages never announced are skipped)."""
        gone = [self._announced.pop(int(p)) for p in host_pages if int(p) in self._announced]
        if self.blocks is not None:
            for p in host_pages:
                self.blocks.pop(int(p), None)
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=self.medium,
                                             group_idx=0))

    @property
    def num_announced(self) -> int:
        """Host pages announced stored and not yet removed."""
        return len(self._announced)

    def announced_pages(self) -> dict[int, Any]:
        """Host page -> block hash, for every page announced and not removed."""
        return dict(self._announced)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events
