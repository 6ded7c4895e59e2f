"""What a vLLM request asks of hicache, resolved once when it arrives.

Its control (``kv_transfer_params``, :mod:`~hicache.integrations.vllm.common.params`,
as the instance's ``kv_role`` allows), its ``cache_salt``, and the inputs besides its
tokens that its KV depends on (:mod:`~hicache.integrations.vllm.scheduler.inputs`:
LoRA adapter, multimodal items, prompt embeddings) make its namespace in hicache's
tiers and its pages' keys. Whatever is wrong or cannot be keyed fails closed: the
request is served by vLLM alone (nothing loaded, nothing saved), never guessed at.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.integrations.vllm.common.params import (
    REFUSED_NAMESPACE,
    RequestControl,
    check_cache_salt,
    parse_request_control,
    tree_namespace,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from hicache.integrations.vllm.scheduler.half import SchedulerHalf
    from hicache.integrations.vllm.scheduler.inputs import InputReader

_log = logging.getLogger("hicache.integrations.vllm.scheduler")


def resolve_request(request: Request, role_control: Callable[[RequestControl], RequestControl],
                    reader: InputReader, block_size: int,
                    half: SchedulerHalf | None) -> tuple[RequestControl, str | None]:
    """``request``'s control and namespace; the scheduler half ``half`` (None on a
    worker) is told both, with its pages' inputs, and counts a request refused for an
    input it cannot key."""
    salt = getattr(request, "cache_salt", None)
    control = role_control(parse_request_control(getattr(request, "kv_transfer_params", None)))
    salt_error = check_cache_salt(salt)
    if control.error is None and salt_error is not None:
        control = control._replace(skip_load=True, skip_save=True, error=salt_error)
    inputs = reader.read(request, block_size)  # LoRA, multimodal, embeddings
    if inputs.refused is not None:  # fail closed (logged once per kind): never a guess
        control = control._replace(skip_load=True, skip_save=True)
        if half is not None:
            half.counters.unkeyed_requests += 1
    # A salt or a namespace hicache cannot keep: none kept, the refused requests' own
    namespace = (REFUSED_NAMESPACE if control.error is not None
                 else tree_namespace(salt, control, inputs.adapter))
    if control.error is not None:
        _log.warning("hicache: request %s served without hicache: %s",
                     request.request_id, control.error)
    if (not control.is_default or inputs.pages) and half is not None:
        half.set_control(request.request_id, request.all_token_ids, namespace, control,
                         request.num_prompt_tokens, inputs.pages)
    return control, namespace
