"""The host tier as vLLM KV cache events: ``BlockStored`` / ``BlockRemoved``, medium ``CPU``.

A KV-aware router subscribes to vLLM's KV events publisher (ZMQ) and learns which
prefixes an engine holds from vLLM's block hashes. The connector's scheduler half
tells :class:`HostTierEvents` which host pages it cached for which request (page ``i``
of a request is its ``i``-th block) and which it evicted; this module announces them
with the request's own ``block_hashes``, in the shape vLLM's block pool uses for its
GPU blocks, with ``medium="CPU"`` as vLLM's offloading connector names host memory.
vLLM's scheduler publishes them with its own events (``take_events``).

Hybrid models (several KV cache groups): every event names its group (``group_idx``),
full-attention pages that group's, and each sliding-window tail page or state
checkpoint its own group's (one ``BlockStored`` a page, with the group's
``kv_cache_spec_kind`` and sliding window, as vLLM's offloading connector announces
them), under the hash of the block it holds (a checkpoint: the block it ends).

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

import msgspec
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
                 hash_block_size: int | None = None, medium: str = MEDIUM_CPU,
                 group_idx: int = 0, group_specs: dict[int, tuple[str, int | None]] | None = None
                 ) -> None:
        """``requests``: vLLM's live ``Request`` of a request id (None once unknown).
        ``group_idx``: the full-attention KV cache group's id; ``group_specs``: group id
        -> (``kv_cache_spec_kind``, sliding window) of the others (hybrid models)."""
        self._request = requests
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        self.medium = medium
        self.group_idx = group_idx
        self.group_specs = group_specs or {}
        # host page -> (the block hash it was stored as, its group)
        self._announced: dict[int, tuple[Any, int]] = {}
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

    def cached_component(self, req_id: str, group: int, position: int, page: int) -> None:
        """Host page ``page`` holds block ``position`` of the request in ``group`` (a
        sliding-window page, or the state checkpoint ending there)."""
        request = self._request(req_id)
        hashes = [] if request is None else resolve_block_hashes(
            request.block_hashes, self.hash_block_size, self.block_size)
        if position >= len(hashes) or request is None:
            return
        assert page not in self._announced, f"host page {page} announced again"
        block = maybe_convert_block_hash(hashes[position])
        self._announced[page] = (block, group)
        P = self.block_size
        keys, _ = generate_block_hash_extra_keys(request, position * P, (position + 1) * P, 0)
        kind, window = self.group_specs.get(group, (None, None))
        lora = request.lora_request
        event = BlockStored(
            block_hashes=[block],
            parent_block_hash=maybe_convert_block_hash(hashes[position - 1]) if position else None,
            token_ids=list(request.all_token_ids[position * P:(position + 1) * P]), block_size=P,
            lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
            medium=self.medium, extra_keys=to_event_extra_keys([keys]), group_idx=group,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            session_id=getattr(request, "session_id", None))
        self._events.append(event)
        if self.blocks is not None:  # the third tier's events repeat it
            self.blocks[page] = msgspec.structs.replace(event, medium=None)

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
        self._announced.update((p, (h, self.group_idx)) for p, h in zip(pages, new, strict=True))
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
            lora_name=lora.name if lora else None, group_idx=self.group_idx,
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
        gone: dict[int, list[Any]] = {}  # per group, in order
        for p in host_pages:
            if int(p) in self._announced:
                block, group = self._announced.pop(int(p))
                gone.setdefault(group, []).append(block)
        if self.blocks is not None:
            for p in host_pages:
                self.blocks.pop(int(p), None)
        for group, blocks in gone.items():
            self._events.append(BlockRemoved(block_hashes=blocks, medium=self.medium,
                                             group_idx=group))

    @property
    def num_announced(self) -> int:
        """Host pages announced stored and not yet removed."""
        return len(self._announced)

    def announced_pages(self) -> dict[int, Any]:
        """Host page -> block hash, for every page announced and not removed."""
        return {page: block for page, (block, _) in self._announced.items()}

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events
