"""What the scheduler half tells the workers each step (vLLM's connector metadata).

Plain lists of ints and strings: vLLM pickles it to every worker. A *page* is a
hicache host page id; a *block* is a vLLM block id; the two lists of an op are
parallel (``block_ids[j]`` <-> ``host_pages[j]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.integrations.vllm.common.audit import AuditOp


@dataclass
class LoadOp:
    """Host pages -> vLLM blocks for one request, before this step's forward."""

    req_id: str
    block_ids: list[int]
    host_pages: list[int]
    # The last len(storage_keys) pages are read from the third tier into their host
    # pages first (the leading ones are already in host memory).
    storage_keys: list[str] = field(default_factory=list)
    # Blocks the scheduler promised but can no longer fill: reported as load errors.
    failed_block_ids: list[int] = field(default_factory=list)


@dataclass
class SaveOp:
    """vLLM blocks -> host pages for one request, after this step's forward."""

    req_id: str
    block_ids: list[int]
    host_pages: list[int]
    storage_keys: list[str] = field(default_factory=list)  # write-behind to the third tier


@dataclass
class PrefetchOp:
    """Third-tier pages -> host pages, in the background (not tied to a step): the
    workers report how far it got (``WorkerHalf.take_prefetch_progress``)."""

    op_id: int
    storage_keys: list[str]
    host_pages: list[int]  # one per key, allocated to this op until every rank is done


@dataclass
class StepPlan:
    """One step's transfers, and what the step computes (the workers track which blocks
    hold valid KV from it). ``is_empty`` on most decode steps: no copies to make."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    # Saves of blocks computed in earlier steps (a finished request's last blocks, vLLM's
    # own prefix hit copied into the host tier): copied before this step's loads, which
    # may read the same host pages, and before this step's forward reuses a freed block.
    early_saves: list[SaveOp] = field(default_factory=list)
    # Blocks (re)allocated to requests this step: a save still reading one must land
    # before the forward writes it (the block was freed by a preemption or a finish).
    new_block_ids: list[int] = field(default_factory=list)
    # Block table changes, in vLLM's order: (req_id, new block ids, replace the table).
    blocks: list[tuple[str, list[int], bool]] = field(default_factory=list)
    # What the forward computes: (req_id, first token, end token) of every request.
    computes: list[tuple[str, int, int]] = field(default_factory=list)
    # Prefetches started this step (read off the step, see prefetch.py).
    prefetches: list[PrefetchOp] = field(default_factory=list)
    # Requests handed off to a decode instance (scheduler/handoff.py), finished now: vLLM
    # holds their blocks until every worker's third-tier writes of them ended.
    held: list[str] = field(default_factory=list)
    # The run-time KV audit (common/audit.py): blocks this step's forward completes, each
    # compared with the page a hit not served would have loaded, after the forward.
    audits: list[AuditOp] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.early_saves or self.prefetches
                    or self.audits)
