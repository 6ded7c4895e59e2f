"""Page allocator: exact accounting, never partial, clear errors that change nothing."""

from __future__ import annotations

import pytest
import torch

from hicache.allocator import PageAllocator


def test_alloc_free_exact_accounting_and_order():
    a = PageAllocator(4)
    p = a.alloc(3)
    assert p.dtype == torch.int64 and p.tolist() == [0, 1, 2]
    assert (a.num_free_pages, a.num_used_pages) == (1, 3)
    a.free(p[1:])
    assert (a.num_free_pages, a.num_used_pages) == (3, 1)
    assert a.alloc(2).tolist() == [1, 2]  # most recently freed first
    a.check_integrity()


def test_short_alloc_is_none_never_partial():
    a = PageAllocator(2)
    assert a.alloc(3) is None
    assert a.num_free_pages == 2
    assert a.alloc(0).tolist() == []
    assert a.alloc(2) is not None and a.alloc(1) is None
    a.check_integrity()


@pytest.mark.parametrize(
    "pages, exc",
    [
        (torch.tensor([-1]), ValueError),  # negative: must not wrap around to the last page
        (torch.tensor([8]), ValueError),  # foreign id
        (torch.tensor([5]), ValueError),  # never allocated
        (torch.tensor([0, 0]), ValueError),  # the same page twice in one free
        (torch.tensor([0], dtype=torch.int32), TypeError),
        ([0], TypeError),
        (torch.tensor([[0]]), ValueError),
    ],
)
def test_bad_free_raises_and_changes_nothing(pages, exc):
    a = PageAllocator(8)
    a.alloc(5)
    with pytest.raises(exc):
        a.free(pages)
    assert (a.num_free_pages, a.num_used_pages) == (3, 5)
    a.check_integrity()


def test_double_free_raises():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    assert a.num_free_pages == 4
    a.check_integrity()


@pytest.mark.parametrize("n, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_counts(n, exc):
    with pytest.raises(exc):
        PageAllocator(4).alloc(n)
    with pytest.raises(exc):
        PageAllocator(n)


def test_duplicates_in_a_large_free_raise():
    a = PageAllocator(256)
    p = a.alloc(200)
    bad = torch.cat((p[:100], p[50:51]))
    with pytest.raises(ValueError, match="twice"):
        a.free(bad)
    assert a.num_used_pages == 200
    a.free(p)
    a.check_integrity()
