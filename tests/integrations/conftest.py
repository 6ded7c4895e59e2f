"""Fixtures of the integration tests (tests/integrations only)."""

from __future__ import annotations

import sys

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


@pytest.fixture(autouse=True)
def _no_engine_outlives_its_test():
    """Every ``vllm_sched.Engine`` a test made is closed after it, closed by the test or
    not: threads left behind would pile up over the suite."""
    yield
    module = sys.modules.get("vllm_sched")
    if module is not None:
        module.close_all()
