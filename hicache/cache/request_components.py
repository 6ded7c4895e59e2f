"""One request's component pages (hybrid models): its window pages and its recurrent state.

A request of a hybrid model (``kv.components``, docs/design.md, "Hybrid models:
components") owns, beside the full-attention pages it computes into:

* per window component, ``width`` pages per page it computes (where its window
  layers write K and V), in step with its full-attention pages;
* per state component, ``width`` pages for its running state (read at the first
  forward from the checkpoint its prefix ends at, written by every forward), and
  ``width`` pages per checkpoint it asked for (the state after that many tokens,
  which an insert hands to the tree).

:class:`RequestComponents` keeps them from ``alloc`` to ``insert`` or
``release``; :class:`PrefixHandle` reads the prefix's part from the tree
(``window_table``, ``state_pages``). All pages come from the device tier's one
allocator: this module only splits and tracks the ids it is given.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hicache.components import ComponentSpec


class StatePages(NamedTuple):
    """Where one state component's layers read and write a request's state."""

    read: torch.Tensor | None  # (width,) the checkpoint at the prefix's end; None: zeros
    write: torch.Tensor | None  # (width,) the request's running state (None before alloc)
    checkpoints: dict[int, torch.Tensor]  # token count -> (width,) ids the state after it goes to


class RequestComponents:
    """A request's component pages (see the module docstring)."""

    def __init__(self, specs: tuple[ComponentSpec, ...], page_size: int) -> None:
        self.specs = specs
        self.page_size = page_size
        # window components: their pages for the request's own pages, in alloc order
        self.windows: dict[int, list[torch.Tensor]] = {
            c: [] for c, s in enumerate(specs) if s.is_window}
        self.states: dict[int, torch.Tensor] = {}  # state components: the running state
        self.checkpoints: dict[int, dict[int, torch.Tensor]] = {
            c: {} for c, s in enumerate(specs) if not s.is_window}

    @property
    def num_pages(self) -> int:
        """Device pages the request owns for its components."""
        return sum(t.shape[0] for t in self.owned())

    def owned(self) -> list[torch.Tensor]:
        """Every page id the request owns for its components."""
        out = [t for ts in self.windows.values() for t in ts]
        out += list(self.states.values())
        out += [t for cps in self.checkpoints.values() for t in cps.values()]
        return out

    def release(self) -> list[torch.Tensor]:
        """Every page the request owns for its components (returned, to free); it owns
        none afterwards."""
        out = self.owned()
        self.windows = {c: [] for c in self.windows}
        self.states = {}
        self.checkpoints = {c: {} for c in self.checkpoints}
        return out

    def check_checkpoints(self, checkpoints: object, low: int, high: int) -> list[int]:
        """``checkpoints`` as the sorted token counts not held yet: multiples of the page
        size in ``(low, high]`` (the request's own pages after this alloc)."""
        if isinstance(checkpoints, int | str | bytes) or not hasattr(checkpoints, "__iter__"):
            raise TypeError(
                f"checkpoints: expected a collection of token counts, got "
                f"{type(checkpoints).__name__}")
        out = sorted({int(x) if isinstance(x, int) and not isinstance(x, bool) else _bad(x)
                      for x in checkpoints})
        if out and not self.checkpoints:
            raise ValueError("checkpoints: the model has no state component to checkpoint")
        for pos in out:
            if pos % self.page_size or not low < pos <= high:
                raise ValueError(
                    f"checkpoints: expected token counts that are multiples of {self.page_size} "
                    f"in ({low}, {high}], got {pos}")
        held = {p for cps in self.checkpoints.values() for p in cps}
        return [pos for pos in out if pos not in held]

    def extra_pages(self, num_pages: int, checkpoints: list[int]) -> int:
        """Component pages an alloc of ``num_pages`` full pages with ``checkpoints`` takes."""
        total = 0
        for c, spec in enumerate(self.specs):
            if spec.is_window:
                total += num_pages * spec.width
            else:
                total += spec.width * (len(checkpoints) + (c not in self.states))
        return total

    def take(self, pages: torch.Tensor, num_pages: int, checkpoints: list[int]) -> None:
        """Keep ``pages`` (:meth:`extra_pages` of them) as the alloc's component pages."""
        off = 0
        for c, spec in enumerate(self.specs):
            w = spec.width
            if spec.is_window:
                if num_pages:
                    self.windows[c].append(pages[off : off + num_pages * w])
                off += num_pages * w
                continue
            if c not in self.states:
                self.states[c] = pages[off : off + w]
                off += w
            for pos in checkpoints:
                self.checkpoints[c][pos] = pages[off : off + w]
                off += w
        assert off == pages.shape[0], "component pages split as extra_pages counted them"

    def window_pages(self, c: int) -> torch.Tensor:
        """The request's own pages of window component ``c``, in page order."""
        parts = self.windows[c]
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def insert_pages(self, num_prefix_pages: int, num_pages: int) -> list[torch.Tensor | None]:
        """Each component's ids along an inserted key of ``num_pages`` pages (the tree's
        ``components`` argument): the request's own pages after its prefix, its
        checkpoints within the key; ``-1`` elsewhere."""
        out: list[torch.Tensor | None] = []
        for c, spec in enumerate(self.specs):
            w = spec.width
            ids = torch.full((num_pages * w,), -1, dtype=torch.int64)
            if spec.is_window:
                own = self.window_pages(c)[: (num_pages - num_prefix_pages) * w]
                ids[num_prefix_pages * w : num_prefix_pages * w + own.shape[0]] = own
            else:
                for pos, cp in self.checkpoints[c].items():
                    if pos <= num_pages * self.page_size:
                        ids[(pos // self.page_size - 1) * w : pos // self.page_size * w] = cp
            out.append(ids)
        return out

    def after_insert(self, num_prefix_pages: int, num_pages: int) -> None:
        """The key's pages are the tree's now (or were freed as unused): forget them."""
        for c, spec in enumerate(self.specs):
            if spec.is_window:
                rest = self.window_pages(c)[(num_pages - num_prefix_pages) * spec.width :]
                self.windows[c] = [rest] if rest.shape[0] else []
            else:
                limit = num_pages * self.page_size
                self.checkpoints[c] = {p: t for p, t in self.checkpoints[c].items() if p > limit}

    def drop_computed(self) -> list[torch.Tensor]:
        """What a failed load made garbage: the window pages and checkpoints (returned,
        to free); the running state stays (the next forward rewrites it)."""
        out = [t for ts in self.windows.values() for t in ts]
        out += [t for cps in self.checkpoints.values() for t in cps.values()]
        for c in self.windows:
            self.windows[c] = []
        for c in self.checkpoints:
            self.checkpoints[c] = {}
        return out


def _bad(value: object) -> int:
    raise TypeError(f"checkpoints: expected int token counts, got {type(value).__name__}")
