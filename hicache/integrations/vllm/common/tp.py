"""Tensor parallelism: what the ranks of one vLLM engine must agree on.

vLLM shards every layer's KV heads over its tensor-parallel ranks. Each rank's worker
runs its own worker half (host pool, copies, third-tier reads and writes) over the
same block ids and host page ids: the scheduler half plans once for all of them, and
vLLM unions what the workers report (load errors, bad host pages, poisoned blocks)
before the scheduler sees it. What the ranks must agree on, and where it is done:

- **Storage keys.** Each rank stores its shard of a page under keys salted with its
  rank (:func:`~hicache.integrations.vllm.common.keys.rank_salt`); a lookup promises a
  stored page only when every rank's shard is there (the scheduler asks for each salt).
- **Load errors** (:func:`share_load_errors`). A load that fails on one rank leaves
  wrong KV in that rank's blocks, and the step's forward then computes wrong KV on
  *every* rank (attention outputs are all-reduced across ranks). Each rank takes the
  union of the step's load errors, so every rank recomputes the same blocks, drops
  the same saves (their host pages turn bad on every rank) and never writes that KV
  to the third tier, where a later lookup would find every rank's shard.
- **Copy cores** (:func:`assign_copy_cpus`). The cores vLLM keeps free of compute are
  shared out between the ranks, one each, so that no rank's copy thread lands on another
  rank's compute core (nor, while spare cores last, on another rank's copy core).

Pipeline parallelism is refused (:func:`check_parallelism`): a stage holds only some
layers, and the connector's host page is every layer of a block.

This module knows ranks and process groups, not pages or plans.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from hicache.errors import ConfigError


class RankGroup(Protocol):
    """The tensor-parallel ranks of one engine, as the worker half needs them."""

    rank: int  # this rank's index in the group, 0 <= rank < world_size
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order. A collective: every rank of the group
        calls it at the same point of the same step, or all of them hang."""


class TorchRankGroup:
    """A :class:`RankGroup` over a ``torch.distributed`` process group (vLLM's
    tensor-parallel CPU group: gloo, so objects travel without a device)."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def vllm_rank_group() -> TorchRankGroup | None:
    """This worker's tensor-parallel group in vLLM (None with one rank). Call it in a
    worker, after vLLM initialised its distributed state."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp.world_size <= 1:
        return None
    return TorchRankGroup(tp.cpu_group, tp.rank_in_group, tp.world_size)


def check_parallelism(parallel_config: Any) -> None:
    """Refuse, with one ``ConfigError``, what the connector cannot serve: pipeline
    parallelism (one stage holds some layers; a host page is every layer of a block)."""
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if pp != 1:
        raise ConfigError(
            "HiCacheConnector: expected pipeline_parallel_size 1 (tensor parallelism is "
            f"supported, pipeline parallelism is not), got {pp}"
        )


def share_load_errors(group: RankGroup | None, errors: set[int]) -> set[int]:
    """The union of every rank's load errors of this step (``errors`` with one rank).

    Called by every rank in every step that has loads (the plan is the same on every
    rank, so they all call it), after the step's load landed."""
    if group is None:
        return errors
    out: set[int] = set()
    for other in group.all_gather(sorted(errors)):
        out.update(other)
    return out


def assign_copy_cpus(spare_by_rank: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """One copy core for each rank, from the cores each may use (``spare_by_rank[r]``:
    rank ``r``'s candidates, already without any rank's compute cores).

    Rank by rank, the lowest candidate no lower rank took; a rank whose candidates
    were all taken shares one (``candidates[rank % n]``): a busy spare core is still
    better than a compute core. A rank without candidates gets none (it copies
    between forwards)."""
    taken: set[int] = set()
    out: list[frozenset[int]] = []
    for rank, spare in enumerate(spare_by_rank):
        free = sorted(spare - taken)
        if free:
            cpu = free[0]
        elif spare:
            cpu = sorted(spare)[rank % len(spare)]
        else:
            out.append(frozenset())
            continue
        taken.add(cpu)
        out.append(frozenset({cpu}))
    return out


def rank_copy_cpus(group: RankGroup, own: set[int] | None = None,
                   sysfs: Path | None = None) -> frozenset[int]:
    """This rank's copy core(s): every rank's compute cores are exchanged (a
    collective), then :func:`assign_copy_cpus` shares out the cores none of them
    computes on, each rank taking from its own NUMA nodes. Empty where none is free.

    ``own``: this rank's compute cores (default: read from this process's threads, see
    :func:`~hicache.transfer.affinity.bound_cpus`); ``sysfs``: the CPU topology's root
    (tests)."""
    from hicache.transfer import affinity

    if own is None:
        own = (affinity.bound_cpus(affinity.thread_masks())
               if hasattr(os, "sched_getaffinity") else set())
    every = [set(cpus) for cpus in group.all_gather(sorted(own))]
    if not all(every):
        return frozenset()  # some rank's compute threads are unbound: nothing is spare
    kwargs = {} if sysfs is None else {"sysfs": sysfs}
    free = affinity.spare_cpus(set().union(*every), **kwargs)
    spare = [frozenset(affinity.spare_cpus(cpus, **kwargs) & free) for cpus in every]
    return assign_copy_cpus(spare)[group.rank]
