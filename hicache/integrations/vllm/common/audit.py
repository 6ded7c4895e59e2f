"""The run-time KV audit: what both halves agree on (docs/vllm.md, "Run-time KV audit").

For a sampled share of the requests with a hit (``audit_rate``), the scheduler half does
not serve the hit: vLLM computes those blocks, and after the forward that completes each
one the workers compare it with the page the hit would have served (a host page, or a
third-tier page read into scratch memory). An :class:`AuditOp` is one such comparison,
sent with the step's plan; the workers answer with one outcome per op (:data:`MATCH`,
:data:`SKIPPED`, :data:`MISMATCH`), which vLLM unites over tensor-parallel ranks by
taking the worst (:func:`worst`).

Pages compare within the dtype's tolerance (:func:`tolerance`): the same kernels on the
same tokens give the same bits, but another batch shape or thread count may change the
low bits; another prefix's KV differs far beyond it. This module imports neither vLLM
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


# (atol, rtol) per dtype name: |computed - stored| <= atol + rtol * |stored|, element
# by element (torch.isclose), NaN equal to NaN. float32: the same kernels differ in the
# last bits at most; reduced precision: a few units in the last place (bfloat16 has 8
# significant bits, float16 11, float8 4 or 3). Other dtypes (ints, raw bytes) compare
# exactly.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-8, 1e-6),
    "float32": (1e-5, 1e-4),
    "float16": (2**-10, 2**-6),
    "bfloat16": (2**-8, 2**-6),
    "float8_e4m3fn": (2**-6, 2**-2),
    "float8_e4m3fnuz": (2**-6, 2**-2),
    "float8_e5m2": (2**-6, 2**-1),
    "float8_e5m2fnuz": (2**-6, 2**-1),
}


def tolerance(dtype_name: str) -> tuple[float, float] | None:
    """``(atol, rtol)`` for KV of ``dtype_name`` (``"bfloat16"``, ``"torch.float32"``),
    or None: compared bit for bit."""
    return TOLERANCES.get(dtype_name.removeprefix("torch."))
