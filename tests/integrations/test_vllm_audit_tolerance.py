"""The run-time KV audit's comparison (docs/vllm.md, "Run-time KV audit"): a page is
compared plane by plane (one layer's K/V of the block) by relative L2 error, not element
by element. No vLLM needed.

The noise below is shaped like the one measured on SmolLM2 in bfloat16 (KV recomputed
in a prefill against KV written by decode steps, vLLM's CPU backend): every element of
the deeper layers off by a few units in the last place, a quarter of them beyond what an
element-by-element check of 4 units let through, every plane's relative error <= 0.0173
and growing with the layer. Wrong KV is another prefix's (every element), or a single
token's row of one plane.
"""

from __future__ import annotations

import pytest
import torch

from hicache.integrations.vllm.common.audit import TOLERANCES, tolerance
from hicache.integrations.vllm.worker.audit import planes_match

PLANES, TOKENS, ROW = 30, 32, 384  # SmolLM2: 30 layers, 32-token blocks, K and V rows


def _kv(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(PLANES, TOKENS, ROW, generator=g) * 3).to(dtype)


def _recomputed(kv: torch.Tensor, worst: float, seed: int = 1) -> torch.Tensor:
    """``kv`` as a right recomputation returns it: plane p off by ``worst * p / PLANES``
    relative error (layer 0 bit-equal), rounded to ``kv``'s dtype."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0, worst, PLANES).view(PLANES, 1, 1)
    x = kv.double()
    noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
    noise *= scale * x.norm(dim=(1, 2), keepdim=True) / noise.norm(dim=(1, 2), keepdim=True)
    return (x + noise).to(kv.dtype)


def test_tolerances_by_dtype():
    assert tolerance("torch.bfloat16") == tolerance("bfloat16") == 2**-4
    assert tolerance("float16") == 2**-5 and tolerance("float32") == 1e-4
    assert tolerance("int8") is None and tolerance("uint8") is None  # bit for bit
    assert all(0 < t < 1 for t in TOLERANCES.values())


@pytest.mark.parametrize("dtype, worst", [(torch.bfloat16, 0.0173), (torch.float16, 0.0078),
                                          (torch.float32, 1.5e-6)])
def test_a_right_recomputation_matches_though_many_elements_moved(dtype, worst):
    kv = _kv(0, dtype)
    again = _recomputed(kv, worst)
    rtol = tolerance(str(dtype))
    assert rtol is not None
    assert planes_match(again, kv, PLANES, rtol)
    assert not torch.equal(again, kv)
    if dtype is torch.bfloat16:  # an element-by-element check of 4 units would not pass
        a, b = again.float(), kv.float()
        assert not bool(torch.isclose(a, b, rtol=2**-6, atol=2**-8).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_another_prefix_or_one_wrong_token_is_a_mismatch(dtype):
    kv = _kv(0, dtype)
    rtol = tolerance(str(dtype))
    assert rtol is not None
    assert not planes_match(_kv(2, dtype), kv, PLANES, rtol)  # every element another's
    one_token = kv.clone()
    one_token[PLANES - 1, 7] = _kv(3, dtype)[PLANES - 1, 7]  # one row of one plane
    assert not planes_match(one_token, kv, PLANES, rtol)
    # A right recomputation at the edge of the measured noise, with that one wrong row.
    noisy = _recomputed(kv, 0.0173 if dtype is torch.bfloat16 else rtol / 4)
    noisy[PLANES - 1, 7] = _kv(3, dtype)[PLANES - 1, 7]
    assert not planes_match(noisy, kv, PLANES, rtol)


def test_non_finite_elements_must_agree_in_place_and_value():
    kv = _kv(0, torch.bfloat16)
    rtol = tolerance("bfloat16")
    assert rtol is not None
    both = kv.clone()
    both[3, 0, 0] = float("nan")
    both[4, 1, 1] = float("inf")
    assert planes_match(both.clone(), both, PLANES, rtol)
    moved = both.clone()
    moved[3, 0, 0], moved[3, 0, 1] = kv[3, 0, 0], float("nan")
    assert not planes_match(moved, both, PLANES, rtol)
    sign = both.clone()
    sign[4, 1, 1] = float("-inf")
    assert not planes_match(sign, both, PLANES, rtol)
    assert not planes_match(kv, both, PLANES, rtol)  # a NaN where the page has a number


def test_zero_planes_match_only_zero():
    zeros = torch.zeros(PLANES, TOKENS, ROW, dtype=torch.bfloat16)
    assert planes_match(zeros, zeros.clone(), PLANES, 2**-4)
    tiny = zeros.clone()
    tiny[0, 0, 0] = 1e-30
    assert not planes_match(tiny, zeros, PLANES, 2**-4)
