"""What vLLM scheduled this step, in the scheduler half's plain values.

vLLM's ``SchedulerOutput`` lists new requests (every block) and cached ones (the
blocks added this step, or all of them for a resumed request), per KV cache group.
The scheduler half follows the full-attention group's table
(:attr:`ScheduledRequest.new_block_ids`) and, for a hybrid model, every group's
(:attr:`ScheduledRequest.group_block_ids`, :mod:`.common.groups`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hicache.integrations.vllm.scheduler.requests import ScheduledRequest

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from hicache.integrations.vllm.common.groups import KVGroups


def scheduled_requests(scheduler_output: SchedulerOutput, request: Callable[[str], Any],
                       namespace: Callable[[Any], str | None],
                       groups: KVGroups) -> list[ScheduledRequest]:
    """Every request of ``scheduler_output`` the connector knows (``request(req_id)``,
    vLLM's ``Request`` or None), with its namespace (``namespace(request)``)."""
    scheduled: list[ScheduledRequest] = []
    num_tokens = scheduler_output.num_scheduled_tokens
    full, hybrid = groups.full, groups.hybrid
    for new in scheduler_output.scheduled_new_reqs:
        req = request(new.req_id)
        tokens = req.all_token_ids if req is not None else (new.prompt_token_ids or [])
        scheduled.append(ScheduledRequest(
            new.req_id, tokens, list(new.block_ids[full]), True, new.num_computed_tokens,
            num_tokens.get(new.req_id, 0), namespace(req) if req else None,
            [list(ids) for ids in new.block_ids] if hybrid else None,
            req.num_prompt_tokens if req is not None else None,
        ))
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        req = request(req_id)
        if req is None:
            continue
        new_ids = cached.new_block_ids[i]
        scheduled.append(ScheduledRequest(
            req_id, req.all_token_ids, list(new_ids[full]) if new_ids is not None else None,
            req_id in cached.resumed_req_ids, cached.num_computed_tokens[i],
            num_tokens.get(req_id, 0), namespace(req),
            [list(ids) for ids in new_ids] if hybrid and new_ids is not None else None,
            req.num_prompt_tokens,
        ))
    return scheduled
