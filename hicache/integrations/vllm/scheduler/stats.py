"""What the scheduler half reports: its counters, and who it tells of host pages.

:class:`SchedulerStats` goes out through vLLM's scheduler-side stats (deltas, see
:mod:`~hicache.integrations.vllm.stats`); :class:`PageListener` is told of every host
page cached and evicted (the KV cache events of :mod:`~hicache.integrations.vllm.scheduler.kv_events`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class SchedulerStats:
    """Counters since start-up, in tokens unless the name says otherwise."""

    lookups: int = 0  # get_num_new_matched_tokens calls
    lookup_tokens: int = 0  # tokens looked up beyond vLLM's own hit
    host_hit_tokens: int = 0  # tokens planned to load from host memory
    storage_hit_tokens: int = 0  # tokens planned to load that came from storage (read or prefetched)
    load_failed_tokens: int = 0  # promised tokens that could not be planned (reported failed)
    saved_tokens: int = 0  # tokens planned to save to host memory
    save_skipped_tokens: int = 0  # not saved: host tier full of pinned pages
    host_evicted_tokens: int = 0
    prefetch_tokens: int = 0  # tokens whose background read from the third tier started
    prefetch_arrived_tokens: int = 0  # of which arrived and went into the host tier
    prefetch_dropped_tokens: int = 0  # of which did not (read failed, or after a reset)
    # served without hicache: an input its KV depends on that hicache cannot key (inputs.py)
    unkeyed_requests: int = 0
    # Hybrid models: host pages of the sliding-window and recurrent-state groups planned
    # to save and to load (one page a group's block)
    window_pages_saved: int = 0
    state_pages_saved: int = 0
    window_pages_loaded: int = 0
    state_pages_loaded: int = 0
    prefetch_declined_tokens: int = 0  # stored, not read: reading would not pay (costs.py)
    # The prefill-to-decode hand-off (handoff.py). Prefill side:
    handoff_offered_tokens: int = 0  # prompt tokens handed off to a decode instance
    # Decode side: tokens handed off that requests could load, and of which served
    handoff_tokens: int = 0
    handoff_served_tokens: int = 0
    handoff_wait_seconds: float = 0.0  # requests waited for handed-off pages, in all
    handoff_served: int = 0  # requests served every page handed off
    # requests that computed some, by reason: another epoch, another key (model, layout,
    # tenant, tokens), not there in time, the tier unreachable, fewer loaded than found
    handoff_epoch: int = 0
    handoff_identity: int = 0
    handoff_timeout: int = 0
    handoff_store: int = 0
    handoff_failed: int = 0  # the prefill's write of a page failed (its marker stored)
    handoff_short: int = 0
    # The run-time KV audit (audit.py): requests whose hit was not served but checked,
    # the hit tokens they computed instead (the audit's cost), pages compared, found
    # wrong, not compared (the page left the tiers first, or could not be read), and
    # host pages taken out of service for a mismatch (the page and what hangs below it)
    audited_requests: int = 0
    audit_computed_tokens: int = 0
    audited_pages: int = 0
    audit_mismatched_pages: int = 0
    audit_skipped_pages: int = 0
    audit_dropped_pages: int = 0


# Stats the connector reports with the counters' deltas that are snapshots (the host
# tier's occupancy): of two reports, the later one holds; they are never summed.
SNAPSHOT_STATS = frozenset({"host_pages_used", "host_pages_free", "host_window_pages",
                            "host_state_pages"})


class PageListener(Protocol):
    """What :attr:`SchedulerHalf.page_listener` is told, as it happens."""

    def cached(self, req_id: str, first_page: int, host_pages: list[int]) -> None:
        """``host_pages`` now hold pages ``first_page, first_page + 1, ...`` of the request."""

    def evicted(self, host_pages: list[int]) -> None:
        """``host_pages`` were evicted (free again)."""

    def cached_component(self, req_id: str, group: int, position: int, page: int) -> None:
        """Hybrid models: ``page`` now holds the request's block ``position`` of KV cache
        group ``group`` (a sliding-window page, or the state checkpoint ending there)."""
