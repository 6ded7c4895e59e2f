"""Whether vLLM is usable here (:mod:`optional`'s ``vllm``). Tests of vLLM skip without
it, unless ``HICACHE_REQUIRE_VLLM=1`` (CI), where a failed import fails them instead.
"""

from __future__ import annotations

from optional import available, required

VLLM_REQUIRED = required("vllm")


def vllm_available() -> bool:
    """Whether vLLM imports; with ``HICACHE_REQUIRE_VLLM=1`` a failed import raises."""
    return available("vllm")
