"""vLLM's KV cache groups as the connector sees them: full attention, sliding window, state.

With vLLM's hybrid KV cache manager on, a model's layers fall into *KV cache groups*,
each with its own block table: one group of full-attention layers, and as many groups
of sliding-window layers (or of Mamba / linear-attention layers) as the model has of
them per full-attention layer. All groups share one block pool, and their KV tensors
overlay each other: block ``b`` is the same bytes in every group, read as the layers of
whichever group holds it (one group at a time). So one host page holds one block of
one group, whatever the group.

A hit ending at token ``h`` (whole blocks, ``h = n * block_size``) needs, per group::

    full     every block before h
    window   the cdiv(W - 1, block_size) blocks before h (window W); vLLM's table holds
             the null block 0 at every position before them
    state    the block at position n - 1, which holds the recurrent state after exactly
             h tokens (vLLM's Mamba "align" mode); null everywhere before

Block id 0 is vLLM's null block: a hole in a table, never a page to copy. This module
reads vLLM's configs and names what each group is; it copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"
WINDOW = "window"
STATE = "state"
NULL_BLOCK = 0  # vLLM's null block: a hole in a group's block table


@dataclass(frozen=True)
class KVGroup:
    """One vLLM KV cache group: what a hit needs of it (module docstring)."""

    group_id: int
    kind: str  # FULL, WINDOW or STATE
    block_size: int
    window_tokens: int = 0  # WINDOW: the sliding window W
    page_nbytes: int = 0  # bytes of one block of this group (every layer of it)

    def window_pages(self) -> int:
        """Blocks before a hit that the hit reads: cdiv(W - 1, block_size) for a window
        group, 1 (the state's block) for a state group, all of them for full attention
        (-1)."""
        if self.kind == WINDOW:
            return -(-(self.window_tokens - 1) // self.block_size)
        return 1 if self.kind == STATE else -1

    def needed_positions(self, first: int, end: int) -> range:
        """Positions (block indices) in ``[first, end)`` that a hit ending at block
        ``end`` reads from this group."""
        n = self.window_pages()
        return range(first, end) if n < 0 else range(max(first, end - n), end)

    def describe(self) -> str:
        return f"window:{self.window_tokens}" if self.kind == WINDOW else self.kind


@dataclass(frozen=True)
class KVGroups:
    """Every KV cache group of one engine; ``groups[i].group_id == i``."""

    groups: tuple[KVGroup, ...]
    full: int  # the full-attention group's id

    @property
    def hybrid(self) -> bool:
        """More than one group: vLLM's hybrid KV cache manager is on for this model."""
        return len(self.groups) > 1

    @property
    def block_size(self) -> int:
        return self.groups[self.full].block_size

    @property
    def page_nbytes(self) -> int:
        """Bytes of one host page: the largest group's block (vLLM pads them equal)."""
        return max(g.page_nbytes for g in self.groups)

    def others(self) -> tuple[KVGroup, ...]:
        """The groups besides full attention (sliding window, state)."""
        return tuple(g for g in self.groups if g.group_id != self.full)

    def event_specs(self) -> dict[int, tuple[str, int | None]]:
        """Group id -> (vLLM's ``kv_cache_spec_kind``, sliding window) of the groups
        besides full attention, as KV cache events name them."""
        return {g.group_id: ("sliding_window", g.window_tokens) if g.kind == WINDOW
                else ("mamba", None) for g in self.others()}

    def fingerprint(self) -> str:
        """The groups' kinds in order, e.g. ``window:128+full`` (part of the storage
        identity: a hybrid model's pages are not those of the same model without vLLM's
        hybrid manager)."""
        return "+".join(g.describe() for g in self.groups)

    @classmethod
    def from_config(cls, kv_cache_config: KVCacheConfig,
                    write_policy: str = "write_through") -> KVGroups:
        """The groups of ``kv_cache_config``.

        One group is taken as it is (full attention, whatever its spec: vLLM's hybrid
        manager is off). With several: exactly one full-attention group, and sliding
        window (``SlidingWindowSpec``) or Mamba "align" mode (``MambaSpec``) groups, all
        of one block size, and the connector's ``write_policy`` ``write_through``;
        anything else raises ``ValueError`` naming the group (or the option).
        """
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MambaSpec,
            SlidingWindowSpec,
        )

        specs = kv_cache_config.kv_cache_groups
        if not specs:
            raise ValueError("HiCacheConnector: expected at least one KV cache group, got none")
        groups: list[KVGroup] = []
        for i, group in enumerate(specs):
            spec = group.kv_cache_spec
            nbytes = spec.page_size_bytes * len(group.layer_names)
            name = type(spec).__name__
            if len(specs) == 1:
                groups.append(KVGroup(i, FULL, spec.block_size, page_nbytes=nbytes))
                continue
            if getattr(group, "is_eagle_group", False):
                raise ValueError(f"HiCacheConnector: KV cache group {i} holds draft-model "
                                 "(EAGLE/MTP) layers; hybrid models with a drafter are not "
                                 "supported")
            if isinstance(spec, SlidingWindowSpec):
                if type(spec) is not SlidingWindowSpec or spec.extra_retained_tokens:
                    raise ValueError(
                        f"HiCacheConnector: KV cache group {i}: expected a plain "
                        f"SlidingWindowSpec, got {name} (extra_retained_tokens="
                        f"{spec.extra_retained_tokens})")
                groups.append(KVGroup(i, WINDOW, spec.block_size, spec.sliding_window, nbytes))
            elif isinstance(spec, MambaSpec):
                if spec.mamba_cache_mode != "align":
                    raise ValueError(
                        f"HiCacheConnector: KV cache group {i}: expected Mamba cache mode "
                        f"'align' (vLLM's prefix caching on), got {spec.mamba_cache_mode!r}")
                groups.append(KVGroup(i, STATE, spec.block_size, page_nbytes=nbytes))
            elif type(spec) is FullAttentionSpec:
                groups.append(KVGroup(i, FULL, spec.block_size, page_nbytes=nbytes))
            else:
                raise ValueError(
                    f"HiCacheConnector: KV cache group {i}: expected FullAttentionSpec, "
                    f"SlidingWindowSpec or MambaSpec (align mode), got {name}")
        full = [g.group_id for g in groups if g.kind == FULL]
        if len(full) != 1:
            raise ValueError(
                "HiCacheConnector: expected exactly one full-attention KV cache group, got "
                f"{len(full)} ({'+'.join(g.describe() for g in groups)})")
        sizes = {g.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(
                f"HiCacheConnector: expected one block size for every KV cache group, got "
                f"{sorted(sizes)}")
        if len(groups) > 1 and write_policy != "write_through":
            raise ValueError(
                "kv_connector_extra_config.write_policy: expected 'write_through' for a hybrid "
                f"model ({'+'.join(g.describe() for g in groups)}), got {write_policy!r}")
        return cls(tuple(groups), full[0])
