"""Fixtures of the integration tests (tests/integrations only)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def sched():
    """``vllm_sched``: vLLM's own scheduler driven with the connector. Imported on first
    use, since it imports vLLM: the modules using it skip without vLLM first."""
    import vllm_sched

    return vllm_sched


@pytest.fixture
def engines():
    """A list of ``vllm_sched.Engine``s a test appends to: closed after the test (their
    copy and storage threads end)."""
    started: list = []
    yield started
    while started:
        started.pop().close()
