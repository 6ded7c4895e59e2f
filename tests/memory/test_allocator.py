"""Page allocator: exact accounting, never partial, clear errors that change nothing.

Every test runs on both backends (the C++ free list and numpy); a random
sequence of allocs and frees, good and bad, gives identical results on both.
"""

from __future__ import annotations

import random

import pytest
import torch

from hicache.memory import PageAllocator
from hicache.native import build as jit

BACKENDS = ["numpy"] + (["native"] if jit.native_available() else [])


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_alloc_free_exact_accounting_and_order(backend):
    a = PageAllocator(4, backend=backend)
    assert a.backend == backend
    p = a.alloc(3)
    assert p.dtype == torch.int64 and p.tolist() == [0, 1, 2]
    assert (a.num_free_pages, a.num_used_pages) == (1, 3)
    a.free(p[1:])
    assert (a.num_free_pages, a.num_used_pages) == (3, 1)
    assert a.alloc(2).tolist() == [1, 2]  # most recently freed first
    a.check_integrity()


def test_short_alloc_is_none_never_partial(backend):
    a = PageAllocator(2, backend=backend)
    assert a.alloc(3) is None
    assert a.num_free_pages == 2
    assert a.alloc(0).tolist() == []
    assert a.alloc(2) is not None and a.alloc(1) is None
    a.check_integrity()


@pytest.mark.parametrize(
    "pages, exc, message",
    [
        (torch.tensor([-1]), ValueError, r"must lie in \[0, 8\), got range \[-1, -1\]"),
        (torch.tensor([8]), ValueError, r"must lie in \[0, 8\), got range \[8, 8\]"),
        (torch.tensor([5, 1, 6]), ValueError, r"never allocated: pages \[5, 6\]"),
        (torch.tensor([0, 0]), ValueError, "appears twice"),
        (torch.tensor([0], dtype=torch.int32), TypeError, "int64"),
        ([0], TypeError, "torch.Tensor"),
        (torch.tensor([[0]]), ValueError, "1-D"),
    ],
)
def test_bad_free_raises_and_changes_nothing(backend, pages, exc, message):
    a = PageAllocator(8, "pages", backend=backend)
    a.alloc(5)
    with pytest.raises(exc, match=message):
        a.free(pages)
    assert (a.num_free_pages, a.num_used_pages) == (3, 5)
    a.check_integrity()
    assert a.alloc(3).tolist() == [5, 6, 7]  # the free stack is untouched


def test_double_free_raises(backend):
    a = PageAllocator(4, backend=backend)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    assert a.num_free_pages == 4
    a.check_integrity()


@pytest.mark.parametrize("n, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_counts(backend, n, exc):
    with pytest.raises(exc):
        PageAllocator(4, backend=backend).alloc(n)
    with pytest.raises(exc):
        PageAllocator(n, backend=backend)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        PageAllocator(4, backend="cuda")


def test_duplicates_in_a_large_free_raise(backend):
    a = PageAllocator(256, backend=backend)
    p = a.alloc(200)
    bad = torch.cat((p[:100], p[50:51]))
    with pytest.raises(ValueError, match="twice"):
        a.free(bad)
    assert a.num_used_pages == 200
    a.free(p[::2])  # a strided view frees the ids it shows
    a.free(p[1::2])
    assert a.num_used_pages == 0
    a.check_integrity()


@pytest.mark.skipif(len(BACKENDS) < 2, reason="native extension unavailable")
@pytest.mark.parametrize("seed", range(5))
def test_backends_agree_on_random_sequences(seed):
    rng = random.Random(seed)
    a, b = (PageAllocator(64, "pages", backend=k) for k in BACKENDS)
    held: list[torch.Tensor] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            n = rng.randrange(0, 20)
            pa, pb = a.alloc(n), b.alloc(n)
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert pa.tolist() == pb.tolist()
                held.append(pa)
        elif op < 0.9 and held:
            pages = held.pop(rng.randrange(len(held)))
            perm = pages[torch.randperm(len(pages), generator=torch.Generator().manual_seed(seed))]
            a.free(perm)
            b.free(perm.clone())
        else:  # a bad free: a used id twice, a free id, or a foreign one
            bad = torch.tensor([rng.randrange(-2, 70) for _ in range(rng.randrange(1, 4))])
            errors = []
            for alloc in (a, b):
                try:
                    alloc.free(bad)
                    errors.append(None)
                except ValueError as exc:
                    errors.append(str(exc))
            assert errors[0] == errors[1]
            if errors[0] is None:  # it was a valid free after all
                held = [p[~torch.isin(p, bad)] for p in held]
        assert a.num_free_pages == b.num_free_pages
        a.check_integrity()
        b.check_integrity()
