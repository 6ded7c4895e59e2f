"""Fixtures of the integration tests (tests/integrations only)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sched():
    """``vllm_sched``: vLLM's own scheduler driven with the connector. Imported on first
    use, since it imports vLLM: the modules using it skip without vLLM first."""
    import vllm_sched

    return vllm_sched
