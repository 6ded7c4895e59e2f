"""A one-request-at-a-time greedy inference engine on top of :class:`HiCache`.

Per request (``generate``)::

    prompt  |<-- device hit -->|<-- host hit -->|<------ computed (prefill) ------>|
            |<------- h.prefix_len (match) ----->|                                   |
    then    greedy decode: one token per forward, its KV written into the request's pages
    finally cache.insert(prompt + generated tokens whose KV exists); cache.release

1. ``cache.match(prompt[:-1])``: the last prompt token is always computed, since
   its logits give the first generated token. The host-only part of the match
   starts loading back at once, layer by layer.
2. ``cache.alloc`` pages for the rest of the sequence (prompt and generated tokens).
3. prefill of the uncached part with ``load_handle=h``: layer ``i`` waits only for
   layer ``i`` of the load, so loading overlaps compute. If a load failed
   (:class:`LoadError`), ``cache.finish_loads`` cuts the prefix back above the
   failed part; the engine allocates again and recomputes from there.
4. decode, insert, release. Backups of the inserted pages (write-through) run on
   the transfer executor while the next request computes.

Modes: ``none`` (no cache: every prompt is computed; a plain paged pool so the
model runs the same code), ``device`` (HiCache, device tier only) and
``hierarchical`` (HiCache with a host tier, optionally over a third storage tier:
``storage="file:DIR"`` or ``"mooncake://HOST:PORT?metadata=URL"``). TTFT is the
time from the call to the first generated token (match, load waits, storage
waits under the prefetch policy, and prefill included).

With a storage tier, a caller that queues requests announces each one on arrival
with :meth:`Engine.prefetch`, so its stored pages move into host memory while
earlier requests compute; under ``best_effort`` the request then uses what has
arrived when it is scheduled. :meth:`Engine.close` waits for the host copies and
storage writes still in flight, so what this engine computed is in storage for
the next process.

A hybrid model (``tiny-hybrid``, ``small-hybrid``: window and linear layers beside
full attention) runs the same way: the cache hands the request its window pages
and its state (``h.window_table``, ``h.state_pages``); the engine asks ``alloc`` for
state checkpoints at the inserted length and at the full-attention match
(``h.full_len``), which the insert gives the tree, so the next turn, and the next
request branching there, start from a checkpoint. A hybrid hit holds more than its
full pages (its window tails and checkpoint): where the pool cannot hold the rest
beside it, the request gives up the checkpoint at the full match, then the hit
(and computes from the start).

This module does not know the radix tree, the pools' layout or how transfers
move bytes: it talks to the cache through its public lifecycle only.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.cache import HiCache, LoadError, PrefixHandle
from hicache.cache.request_components import StatePages
from hicache.config import CacheConfig, EvictionPolicy, KVConfig, PrefetchPolicy, WritePolicy
from hicache.memory import DevicePool, PageAllocator
from hicache.sim.model import Model


class EngineMode(str, Enum):
    NONE = "none"  # no cache: recompute every prompt
    DEVICE = "device"  # radix cache in device memory only
    HIERARCHICAL = "hierarchical"  # device cache backed by a host tier


MODES: tuple[str, ...] = tuple(m.value for m in EngineMode)


def request_pages(kv: KVConfig, num_pages: int) -> int:
    """Device pages one request of ``num_pages`` pages takes: its full pages, and for a
    hybrid model (``kv.components``) its window pages, its state and two checkpoints."""
    return num_pages + sum(
        s.width * (num_pages if s.is_window else 3) for s in kv.component_specs)


class GenerateResult(NamedTuple):
    """One request's outcome. Token counts are prompt tokens; times are seconds."""

    tokens: list[int]  # greedy generated tokens, max_new_tokens of them
    ttft_s: float  # call -> logits of the first generated token
    total_s: float  # call -> last generated token (insert and release excluded)
    device_hit_tokens: int  # prompt tokens whose KV was already on the device
    host_hit_tokens: int  # prompt tokens whose KV was loaded back from the host
    computed_tokens: int  # prompt tokens prefilled (decode steps not counted)
    num_load_failures: int  # loads that failed and were recomputed instead
    logits: torch.Tensor | None  # (max_new_tokens, vocab) float32, with keep_logits=True


class Engine:
    """Runs greedy generation for one request at a time against a paged KV pool.

    ``device_tokens`` is the device pool's capacity (cache plus the running
    request's pages); ``host_tokens`` the host tier's (``hierarchical`` only;
    default 4x ``device_tokens``). ``executor`` is the transfer executor
    (``auto``, ``thread`` or ``cuda``: the engine needs loads that really copy and
    complete on their own). ``storage`` (``hierarchical`` only) adds the third
    tier, with ``prefetch_policy``/``prefetch_timeout_s`` (see
    :class:`~hicache.config.CacheConfig`) and backend ``storage_options`` (see
    :func:`hicache.storage.make_storage`); its keys carry ``model.identity()``
    (preset, config, dtype and a digest of the weights), so engines of different
    models can share one store without reading each other's pages.
    """

    def __init__(
        self,
        model: Model,
        mode: EngineMode | str,
        device_tokens: int,
        host_tokens: int | None = None,
        page_size: int = 16,
        *,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        eviction: EvictionPolicy | str = EvictionPolicy.LRU,
        executor: str = "auto",
        load_threshold_tokens: int = 0,
        storage: str | None = None,
        prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.BEST_EFFORT,
        prefetch_timeout_s: float = 0.05,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model: expected a hicache.sim.model.Model, got {type(model).__name__}")
        try:
            self.mode = EngineMode(mode)
        except ValueError:
            raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}") from None
        if executor not in ("auto", "thread", "cuda"):
            # manual: nothing would complete the engine's loads; immediate: copies nothing,
            # so a host hit would load garbage.
            raise ValueError(f"executor: expected 'auto', 'thread' or 'cuda', got {executor!r}")
        if host_tokens is not None and self.mode is not EngineMode.HIERARCHICAL:
            raise ValueError(
                f"host_tokens: only the 'hierarchical' mode has a host tier, got "
                f"host_tokens={host_tokens} with mode {self.mode.value!r}"
            )
        if storage is not None and self.mode is not EngineMode.HIERARCHICAL:
            raise ValueError(
                f"storage: only the 'hierarchical' mode has a storage tier, got "
                f"storage={storage!r} with mode {self.mode.value!r}"
            )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(
                f"storage_options: expected dict, got {type(storage_options).__name__}"
            )
        self.model = model
        self.page_size = page_size
        kv = model.kv_config(page_size)
        self._kv = kv
        self._specs = kv.component_specs  # hybrid models: window and state components
        device = str(model.device)
        self.cache: HiCache | None = None
        if self.mode is EngineMode.NONE:
            if isinstance(device_tokens, bool) or not isinstance(device_tokens, int):
                raise TypeError(f"device_tokens: expected int, got {type(device_tokens).__name__}")
            if device_tokens < page_size:
                raise ValueError(
                    f"device_tokens: expected >= page_size ({page_size}), got {device_tokens}"
                )
            self.pool = DevicePool(kv, device_tokens // page_size, device)
            self._allocator = PageAllocator(device_tokens // page_size, "device pages")
        else:
            if self.mode is EngineMode.HIERARCHICAL and host_tokens is None:
                host_tokens = 4 * device_tokens
            config = CacheConfig(
                kv,
                device_tokens=device_tokens,
                host_tokens=host_tokens,
                device=device,
                write_policy=write_policy,
                eviction=eviction,
                executor=executor,
                load_threshold_tokens=load_threshold_tokens,
                storage=storage,
                # Storage keys name the model: another model with this KV layout sharing
                # the store (other seed, fine-tune, dtype) never gets these pages.
                model_id=model.identity() if storage is not None else None,
                prefetch_policy=prefetch_policy,
                prefetch_timeout_s=prefetch_timeout_s,
                extra={"storage": dict(storage_options)} if storage_options else {},
            )
            self.cache = HiCache(config)
            assert self.cache.device_pool is not None, "the engine's cache holds KV"
            self.pool = self.cache.device_pool
        self.num_device_pages = self.pool.num_pages

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompt_tokens: list[int] | np.ndarray | torch.Tensor,
        max_new_tokens: int,
        namespace: str | None = None,
        *,
        keep_logits: bool = False,
    ) -> GenerateResult:
        """Greedy-generate ``max_new_tokens`` tokens after ``prompt_tokens``.

        Raises ``ValueError`` when the request cannot fit in the device pool even
        with everything else evicted (the message names the pages it needs).
        """
        start = time.perf_counter()
        prompt = self._check_prompt(prompt_tokens)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens: expected int, got {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        prompt_len = len(prompt)
        # The last generated token is never fed back, so its KV is never needed.
        seq_len = prompt_len + max_new_tokens - 1
        num_pages = request_pages(self._kv, -(-seq_len // self.page_size))
        if num_pages > self.num_device_pages:
            raise ValueError(
                f"request needs {num_pages} device pages ({seq_len} tokens of prompt and "
                f"output, page_size {self.page_size}), but the device pool has only "
                f"{self.num_device_pages}: raise device_tokens to >= {num_pages * self.page_size}"
            )
        if self.cache is None:
            return self._generate_uncached(prompt, max_new_tokens, seq_len, start, keep_logits)
        return self._generate_cached(
            prompt, max_new_tokens, seq_len, namespace, start, keep_logits
        )

    def prefetch(
        self, prompt_tokens: list[int] | np.ndarray | torch.Tensor, namespace: str | None = None
    ) -> bool:
        """Announce a request that arrived but is not scheduled yet.

        Starts reading the part of its prompt that only the storage tier holds
        into host memory (see :meth:`HiCache.prefetch`); :meth:`generate` later
        uses what arrived, as the prefetch policy says. Returns whether a read
        started or was already on its way; ``False`` without a storage tier.
        """
        prompt = self._check_prompt(prompt_tokens)
        if self.cache is None or self.cache.storage is None:
            return False
        # generate() matches prompt[:-1]: the last token is always computed.
        return self.cache.prefetch(prompt[:-1], namespace) is not None

    def stats(self) -> dict[str, Any]:
        """The cache's counters (see :meth:`HiCache.stats`); empty in mode ``none``."""
        return self.cache.stats() if self.cache is not None else {}

    def check_integrity(self) -> None:
        if self.cache is not None:
            self.cache.check_integrity()
        else:
            self._allocator.check_integrity()
            assert self._allocator.num_used_pages == 0, (
                f"{self._allocator.num_used_pages} device pages still allocated between requests"
            )

    def drain(self) -> None:
        """Wait for every background transfer (e.g. before reading final statistics)."""
        if self.cache is not None:
            self.cache.wait_all()

    def close(self) -> None:
        """Wait for backups and storage writes in flight, then stop the cache's workers."""
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _check_prompt(self, prompt_tokens: object) -> torch.Tensor:
        if isinstance(prompt_tokens, torch.Tensor):
            prompt = prompt_tokens.to(torch.int64).cpu()
        elif isinstance(prompt_tokens, np.ndarray):
            if prompt_tokens.dtype.kind not in "iu":
                raise TypeError(
                    f"prompt_tokens: expected an integer array, got dtype {prompt_tokens.dtype}"
                )
            prompt = torch.from_numpy(prompt_tokens.astype(np.int64))
        elif isinstance(prompt_tokens, list | tuple):
            prompt = torch.tensor(prompt_tokens, dtype=torch.int64)
        else:
            raise TypeError(
                f"prompt_tokens: expected a list of ints, an int array or a tensor, "
                f"got {type(prompt_tokens).__name__}"
            )
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"prompt_tokens: expected a non-empty 1-D sequence, got shape "
                f"{tuple(prompt.shape)}"
            )
        return prompt

    def _generate_uncached(
        self, prompt: torch.Tensor, max_new_tokens: int, seq_len: int, start: float,
        keep_logits: bool,
    ) -> GenerateResult:
        num_pages = -(-seq_len // self.page_size)
        held = self._allocator.alloc(request_pages(self._kv, num_pages))
        assert held is not None, "pages of the previous request were not freed"
        pages, comps = held[:num_pages], []
        off = num_pages
        for spec in self._specs:  # hybrid: window pages for every page, one state
            n = spec.width * (num_pages if spec.is_window else 1)
            ids = held[off : off + n]
            off += n
            comps.append(ids.view(num_pages, spec.width) if spec.is_window
                         else StatePages(None, ids, {}))
        try:
            first = self.model.forward(prompt, pages, 0, self.pool, last_only=True,
                                       components=comps or None)
            first_token = int(first[-1].argmax())  # syncs a GPU: TTFT is real
            ttft = time.perf_counter() - start
            comps = [c if isinstance(c, torch.Tensor) else StatePages(c.write, c.write, {})
                     for c in comps]  # decode goes on from the state prefill left
            tokens, logits = self._decode(
                first, first_token, pages, len(prompt), max_new_tokens, keep_logits, comps
            )
            total = time.perf_counter() - start
        finally:
            self._allocator.free(held)
        return GenerateResult(tokens, ttft, total, 0, 0, len(prompt), 0, logits)

    def _components(self, h: PrefixHandle, prefill: bool) -> list[torch.Tensor | StatePages]:
        """A hybrid request's component pages for the model: window page tables, and
        states read from the prefix's checkpoint (``prefill``) or the request's own."""
        out: list[torch.Tensor | StatePages] = []
        for c, spec in enumerate(self._specs):
            if spec.is_window:
                out.append(h.window_table(c))
            else:
                state = h.state_pages(c)
                out.append(state if prefill else StatePages(state.write, state.write,
                                                            state.checkpoints))
        return out

    def _generate_cached(
        self, prompt: torch.Tensor, max_new_tokens: int, seq_len: int,
        namespace: str | None, start: float, keep_logits: bool,
    ) -> GenerateResult:
        cache = self.cache
        assert cache is not None
        prompt_len = len(prompt)
        h = cache.match(prompt[:-1], namespace)
        device_len = h.device_len
        num_failures = 0
        try:
            while True:
                prefix_len = h.prefix_len
                if not self._alloc(h, seq_len):
                    # The prefix h locks (a hybrid model's window tails and checkpoint
                    # with it) leaves too few pages for the rest: compute from the start.
                    held, h = h, cache.match(prompt[:0], namespace)
                    cache.release(held)
                    device_len = 0
                    continue
                # A failed load cuts h.prefix_len back (and frees h's pages) when a
                # call made for h applies it: this alloc, or finish_loads.
                if h.prefix_len < prefix_len:
                    num_failures += 1
                    continue
                error: LoadError | None = None
                try:
                    first = self.model.forward(
                        prompt[prefix_len:], h.page_table(), prefix_len, self.pool,
                        load_handle=h, last_only=True,
                        components=self._components(h, True) if self._specs else None,
                    )
                except LoadError as exc:
                    error = exc
                cache.finish_loads(h)  # lands every load before insert may run
                if h.prefix_len == prefix_len:
                    if error is not None:
                        raise error
                    break
                num_failures += 1
            first_token = int(first[-1].argmax())  # syncs a GPU: TTFT is real
            ttft = time.perf_counter() - start
            pages = h.page_table()
            comps = self._components(h, False) if self._specs else []
            tokens, logits = self._decode(
                first, first_token, pages, prompt_len, max_new_tokens, keep_logits, comps
            )
            total = time.perf_counter() - start
            seq = torch.cat((prompt, torch.tensor(tokens[:-1], dtype=torch.int64)))
            cache.insert(h, seq)
        finally:
            cache.release(h)
        device_hit = min(device_len, prefix_len)
        return GenerateResult(
            tokens, ttft, total, device_hit, prefix_len - device_hit, prompt_len - prefix_len,
            num_failures, logits,
        )

    def _alloc(self, h: PrefixHandle, seq_len: int) -> bool:
        """Make ``h`` own the pages its sequence needs past ``h.prefix_len``; a hybrid
        model's request also its state checkpoints at the length the insert will cache
        and at the full-attention match (that one only where the pool has room for it).

        False: the pool cannot supply them beside the prefix ``h`` holds (a hybrid
        prefix holds its window tails and checkpoint too: the caller computes from the
        start). True also when a failed load cut ``h`` back meanwhile (the caller
        allocates again). Raises ``ValueError`` for an empty prefix."""
        prefix_len = h.prefix_len
        num_pages = -(-(seq_len - prefix_len) // self.page_size) - h.num_owned_pages
        cache = self.cache
        assert cache is not None, "a handle comes from the engine's cache"
        if num_pages <= 0:
            return True
        tries: list[list[int]] = [[]]
        if any(not spec.is_window for spec in self._specs):
            end = seq_len // self.page_size * self.page_size
            marks = [p for p in sorted({end, h.full_len}) if prefix_len < p <= end]
            # Without the checkpoint at the full match, a hit needs no more pages than
            # request_pages counts.
            tries = [marks, [end]] if len(marks) > 1 else [marks]
        for marks in tries:
            if cache.alloc(h, num_pages * self.page_size, checkpoints=marks) is not None:
                return True
            if h.prefix_len != prefix_len:
                return True
        if prefix_len:
            return False
        raise ValueError(
            f"request needs {-(-seq_len // self.page_size)} device pages "
            f"({seq_len} tokens, page_size {self.page_size}); after evicting everything "
            f"evictable the pool of {self.num_device_pages} pages could not supply "
            f"{num_pages} new ones: raise device_tokens"
        )

    def _decode(
        self, first_logits: torch.Tensor, first_token: int, pages: torch.Tensor,
        prompt_len: int, max_new_tokens: int, keep_logits: bool,
        components: list[torch.Tensor | StatePages],
    ) -> tuple[list[int], torch.Tensor | None]:
        kept = [first_logits] if keep_logits else []  # (1, vocab) each
        tokens = [first_token]
        for step in range(1, max_new_tokens):
            ids = torch.tensor(tokens[-1:], dtype=torch.int64)
            logits = self.model.forward(
                ids, pages, prompt_len + step - 1, self.pool, last_only=True,
                components=components or None,
            )
            if keep_logits:
                kept.append(logits)
            tokens.append(int(logits[-1].argmax()))
        return tokens, torch.cat(kept) if keep_logits else None
