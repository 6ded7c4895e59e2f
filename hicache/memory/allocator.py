"""Page allocator: a free list of page ids for one tier.

Pages are the unit of caching. The allocator hands out page ids (int64 torch
tensors, on the CPU) and takes them back; it knows nothing of what the pages
hold, of streams, or of the tree. Running out is a normal return (``None``),
never a partial allocation; a double free or a foreign page id is a caller
bug and raises ``ValueError`` without changing any state.

Two backends behave identically (same order, same errors): the free list in
the C++ extension (:mod:`hicache.native.build`; a call costs about a microsecond) and
numpy (the fallback when the extension cannot be built). Both keep the free
stack and the in-use map in numpy-visible arrays, which ``check_integrity``
reads.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.checks import check_int, check_page_tensor
from hicache.native.binding import FreeListBinding

BACKENDS = ("auto", "native", "numpy")


class PageAllocator:
    """Free list of ``num_pages`` page ids ``0 .. num_pages-1``.

    ``alloc`` hands out the most recently freed pages first (a stack), which keeps
    hot pages hot in caches and makes allocation order deterministic for tests.
    ``backend``: ``"native"`` (the C++ free list; raises
    :class:`hicache.native.build.NativeBuildError` if it cannot be built), ``"numpy"``, or
    ``"auto"`` (native when it builds, else numpy).
    """

    def __init__(self, num_pages: int, name: str = "pages", backend: str = "auto") -> None:
        num_pages = check_int("num_pages", num_pages)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.name = name
        self.num_pages = num_pages
        self._native: FreeListBinding | None = None
        if backend != "numpy":
            from hicache.native import build as jit

            if backend == "native" or jit.native_available():
                self._native = jit.load_native().FreeList(name, num_pages)
        self.backend = "native" if self._native is not None else "numpy"
        if self._native is not None:
            # The C++ list owns the arrays and the count (the native lifecycle
            # allocates from it too); these are views of the same memory.
            self._free = self._native.free_stack.numpy()
            self._in_use = self._native.in_use.numpy()
            return
        # free[:num_free] is the stack of free ids; the top is at the end.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages
        self._in_use = np.zeros(num_pages, dtype=np.bool_)
        self._slot = np.zeros(num_pages, dtype=np.int64)  # scratch for the duplicate check

    @property
    def num_free_pages(self) -> int:
        return self._num_free if self._native is None else self._native.num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def can_alloc(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def alloc(self, num_pages: int) -> torch.Tensor | None:
        """Return ``num_pages`` distinct free page ids (int64), or ``None`` if fewer are free."""
        num_pages = check_int("num_pages", num_pages)
        if self._native is not None:
            return self._native.alloc(num_pages)  # None when fewer are free
        if num_pages > self._num_free:
            return None
        start = self._num_free - num_pages
        pages = self._free[start : self._num_free][::-1].copy()
        self._num_free = start
        self._in_use[pages] = True
        return torch.from_numpy(pages)

    def free(self, pages: torch.Tensor) -> None:
        """Return pages to the free list. Every id must be allocated and appear once."""
        if self._native is not None:
            self._native.free(check_page_tensor(self.name, pages))
            return
        ids = self._check_pages(pages)
        if ids.size == 0:
            return
        self._in_use[ids] = False
        end = self._num_free + ids.size
        self._free[self._num_free : end] = ids[::-1]
        self._num_free = end

    def _check_pages(self, pages: torch.Tensor) -> np.ndarray:
        ids = check_page_tensor(self.name, pages).numpy()
        if ids.size == 0:
            return ids
        # One reduction checks both ends: as unsigned, a negative id is huge (and numpy
        # would otherwise wrap a negative index around to the last page).
        if ids.view(np.uint64).max() >= self.num_pages:
            raise ValueError(
                f"{self.name}: page ids must lie in [0, {self.num_pages}), "
                f"got range [{ids.min()}, {ids.max()}]"
            )
        in_use = self._in_use[ids]
        if not in_use.all():
            bad = ids[~in_use][:8].tolist()
            raise ValueError(f"{self.name}: double free or never allocated: pages {bad}")
        if ids.size <= 64:  # a set is cheaper than array ops for the usual small frees
            duplicates = ids.size > 1 and len(set(ids.tolist())) != ids.size
        else:  # a later position overwrites an earlier one's slot
            order = np.arange(ids.size)
            self._slot[ids] = order
            duplicates = not np.array_equal(self._slot[ids], order)
        if duplicates:
            raise ValueError(f"{self.name}: the same page id appears twice in one free")
        return ids

    def check_integrity(self) -> None:
        """Assert that the free stack and the in-use map agree."""
        free = self._free[: self.num_free_pages]
        assert np.unique(free).size == free.size, f"{self.name}: a page is free twice"
        assert not self._in_use[free].any(), f"{self.name}: a free page is marked in use"
        assert int(self._in_use.sum()) == self.num_used_pages, (
            f"{self.name}: in-use map counts {int(self._in_use.sum())}, "
            f"accounting says {self.num_used_pages}"
        )
