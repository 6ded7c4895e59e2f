"""The reference model's argument checks: tokens, the pool, a page table, a hybrid's pages.

Each check raises one ``ValueError`` / ``TypeError`` naming the argument, what was
expected and what came, before the model touches the pool
(:meth:`hicache.sim.model.Model.forward`). :class:`StateIO` names what a linear
layer reads of a request's state pages (``PrefixHandle.state_pages`` is one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from hicache.config import KVConfig
from hicache.memory import DevicePool
from hicache.sim.modelconfig import ModelConfig


class StateIO(Protocol):
    """Where a linear layer reads and writes one request's state: page ids, one per group."""

    @property
    def read(self) -> torch.Tensor | None: ...  # the checkpoint to start from; None: zeros
    @property
    def write(self) -> torch.Tensor | None: ...  # the running state
    @property
    def checkpoints(self) -> Mapping[int, torch.Tensor]: ...  # tokens -> where that state goes


def check_tokens(cfg: ModelConfig, device: torch.device, token_ids: object) -> torch.Tensor:
    """``token_ids`` as a 1-D int64 tensor of ids in the vocabulary, on ``device``."""
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids: expected an int64 tensor, got {type(token_ids).__name__}")
    if token_ids.dtype != torch.int64:
        raise TypeError(f"token_ids: expected dtype torch.int64, got {token_ids.dtype}")
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(
            f"token_ids: expected a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}"
        )
    vocab = cfg.vocab_size
    bad = token_ids[(token_ids < 0) | (token_ids >= vocab)]
    if bad.numel():
        raise ValueError(
            f"token id {int(bad[0])} is outside the vocabulary [0, {vocab}) "
            f"of model {cfg.name!r}"
        )
    return token_ids.to(device)


def check_pool(cfg: ModelConfig, device: torch.device, pool: DevicePool) -> int:
    """The page size of ``pool``, a pool of this model's KV layout on ``device``."""
    kv = getattr(pool, "kv", None)
    if not isinstance(kv, KVConfig):
        raise TypeError(f"pool: expected a DevicePool, got {type(pool).__name__}")
    want = (cfg.num_full_layers, cfg.num_kv_heads, cfg.head_dim)
    got = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
    if want != got:
        raise ValueError(
            f"pool: expected KV shape (num_layers, num_kv_heads, head_dim)={want} "
            f"of model {cfg.name!r}, got {got}"
        )
    if pool.k_buffers[0].device != device:
        raise ValueError(f"pool: expected device {device}, got {pool.k_buffers[0].device}")
    return kv.page_size


def check_page_table(
    device: torch.device, page_table: object, total_len: int, page_size: int, num_pages: int
) -> torch.Tensor:
    """The pages of ``page_table`` that cover ``total_len`` positions, on ``device``."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int64:
        got = page_table.dtype if isinstance(page_table, torch.Tensor) else type(page_table)
        raise TypeError(f"page_table: expected an int64 tensor, got {got}")
    if page_table.dim() != 1:
        raise ValueError(f"page_table: expected a 1-D tensor, got shape {tuple(page_table.shape)}")
    needed = -(-total_len // page_size)
    if page_table.numel() < needed:
        raise ValueError(
            f"page_table: expected >= {needed} pages to cover {total_len} positions "
            f"(page_size {page_size}), got {page_table.numel()}"
        )
    pages = page_table[:needed]
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= num_pages:
        raise ValueError(
            f"page_table: expected page ids in [0, {num_pages}), got min {lo}, max {hi}"
        )
    return pages.to(device)


def check_components(
    cfg: ModelConfig, components: Sequence[torch.Tensor | StateIO] | None
) -> Sequence[torch.Tensor | StateIO]:
    """A hybrid model's component pages: one per component of its KV layout, a window's
    page table ``(num_pages, width)`` int64, a state's :class:`StateIO` with a running
    state; a single-kind model takes none."""
    specs = cfg.components()
    if not specs:
        if components:
            raise ValueError(f"components: model {cfg.name!r} has no window or linear layers")
        return ()
    if components is None or len(components) != len(specs):
        got = None if components is None else len(components)
        raise ValueError(
            f"components: model {cfg.name!r} has {len(specs)} components "
            f"({', '.join(s.describe() for s in specs)}); expected one entry each, got {got}")
    for c, (entry, spec) in enumerate(zip(components, specs, strict=True)):
        if spec.is_window:
            if (not isinstance(entry, torch.Tensor) or entry.dtype != torch.int64
                    or entry.dim() != 2 or entry.shape[1] != spec.width):
                raise TypeError(
                    f"components[{c}]: expected an int64 (num_pages, {spec.width}) window "
                    f"page table, got {entry!r}")
        elif isinstance(entry, torch.Tensor) or getattr(entry, "write", None) is None:
            raise TypeError(f"components[{c}]: expected state pages with a running state "
                            f"(PrefixHandle.state_pages after alloc), got {entry!r}")
    return components
