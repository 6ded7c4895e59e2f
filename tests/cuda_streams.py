"""CUDA in tests: the devices a test runs on (``cuda`` skips without a GPU) and a way to
hold a copy in flight on a stream.
"""

from __future__ import annotations

import pytest
import torch

CUDA_AVAILABLE = torch.cuda.is_available()
# Parametrize a test over the devices its tensors live on: "cpu" always runs; "cuda" is
# marked `cuda` (bench/gpu_suite.sh selects those) and skips without a GPU.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not CUDA_AVAILABLE, reason="needs a CUDA device")]),
]


def stall_stream(stream, seconds: float) -> None:
    """Queue at least ``seconds`` of spinning on a CUDA ``stream``: what is queued after
    it waits.

    Holds a copy in flight on purpose (a CUDA stream has no "pause"). The spin counts
    GPU clock cycles; they are converted at the faster of the measured clock and 2 GHz,
    so a clock still ramping up from idle makes the spin longer, never shorter. Callers
    assert what must still be in flight rather than trust the duration.
    """
    cycles = int(seconds * _cycles_per_s(stream.device))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


_CYCLES_PER_S: dict = {}


def _cycles_per_s(device) -> float:
    if device not in _CYCLES_PER_S:
        cycles = 50_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            torch.cuda._sleep(cycles)  # warm-up: clocks ramp up from idle
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
        measured = cycles / (start.elapsed_time(end) / 1e3)
        _CYCLES_PER_S[device] = max(measured, 2.0e9)
    return _CYCLES_PER_S[device]
