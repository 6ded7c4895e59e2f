"""The run-time KV audit: what both halves agree on (docs/vllm.md, "Run-time KV audit").

For a sampled share of the requests with a hit (``audit_rate``), the scheduler half does
not serve the hit: vLLM computes those blocks, and after the forward that completes each
one the workers compare it with the page the hit would have served (a host page, or a
third-tier page read into scratch memory). An :class:`AuditOp` is one such comparison,
sent with the step's plan; the workers answer with one outcome per op (:data:`MATCH`,
:data:`SKIPPED`, :data:`MISMATCH`), which vLLM unites over tensor-parallel ranks by
taking the worst (:func:`worst`).

Pages compare plane by plane within the dtype's tolerance (:func:`tolerance`): the
same kernels on the same tokens give the same bits, but another batch shape, thread
count or a prefill instead of decode steps changes the low bits, more in deeper layers;
another prefix's KV differs far beyond it. This module imports neither vLLM
nor the halves.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

AUDIT_ACTIONS = ("count", "stop_loads")

# Outcomes of one comparison, worst last (ranks' outcomes unite by max).
MATCH, SKIPPED, MISMATCH = 0, 1, 2


@dataclass
class AuditOp:
    """Compare vLLM block ``block_id`` (page ``page`` of request ``req_id``, computed by
    the end of this step's forward) with host page ``host_page`` (>= 0), or else with
    the third-tier page stored under ``storage_key`` (unsalted: each rank reads its own)."""

    op_id: int
    req_id: str
    page: int
    block_id: int
    host_page: int = -1
    storage_key: str = ""


def worst(a: int, b: int) -> int:
    """Two ranks' outcomes of one op as one: a mismatch on any rank is a mismatch."""
    return max(a, b)


def sampled(req_id: str, rate: float) -> bool:
    """Whether the request is audited: a hash of its id below ``rate`` (deterministic:
    the same id always decides the same; 1.0 audits every request, 0 none)."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    digest = hashlib.blake2b(req_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < rate


# The largest relative error of one plane (one layer's K/V of one block) per dtype name:
# a page matches when every plane has ||computed - stored|| <= rtol x the larger of the
# two norms (over finite elements; NaN and infinities must sit at the same places with
# the same values). Not element by element: a recomputation that is right moves many
# elements by a few units in the last place, more in the deeper layers. Measured on
# SmolLM2 (30 layers, vLLM's CPU backend), KV recomputed in a prefill against KV written
# by decode steps or in another batch: every plane within 0.0173 in bfloat16 (up to 23%
# of a page's elements beyond 4 units) and 1.5e-6 in float32 (an element-by-element
# check of rtol 1e-4 still failed 12 of 152 clean pages), growing with the layer. The
# bounds leave a margin of 3.6x (bfloat16) and 65x (float32) over that; float16 (not
# measured) and float8 get 64 and 4 units of their rounding. Another prefix's or another
# weight's KV is off by tens of percent, one wrong token's row of 32 by ~35%.
TOLERANCES: dict[str, float] = {
    "float64": 1e-8,
    "float32": 1e-4,
    "float16": 2**-5,
    "bfloat16": 2**-4,
    "float8_e4m3fn": 2**-2,
    "float8_e4m3fnuz": 2**-2,
    "float8_e5m2": 2**-1,
    "float8_e5m2fnuz": 2**-1,
}


def tolerance(dtype_name: str) -> float | None:
    """The relative error a plane of KV of ``dtype_name`` (``"bfloat16"``,
    ``"torch.float32"``) may have, or None: compared bit for bit."""
    return TOLERANCES.get(dtype_name.removeprefix("torch."))
