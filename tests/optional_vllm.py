"""Whether vLLM is usable here. Tests of vLLM skip without it, unless
``HICACHE_REQUIRE_VLLM=1`` (CI), where a failed import fails them instead.
"""

from __future__ import annotations

import os

VLLM_REQUIRED = os.environ.get("HICACHE_REQUIRE_VLLM") == "1"


def vllm_available() -> bool:
    """Whether vLLM imports; with ``HICACHE_REQUIRE_VLLM=1`` a failed import raises."""
    try:
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        if VLLM_REQUIRED:
            raise
        return False
    return True
