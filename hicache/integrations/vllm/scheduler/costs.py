"""Whether a third-tier hit is worth reading: its read time against recomputing its tokens.

A background read of stored pages pays when it takes less time than computing the
tokens it saves, on this model and this tier. Both sides are measured while the
engine runs, from what the workers report each step:

* **read**: seconds per page of the workers' storage reads (prefetch chunks and reads
  in the step), the mean over recent reads;
* **recompute**: seconds per token of vLLM's own forwards, fitted as ``fixed +
  per_token x tokens`` over recent steps; ``per_token`` is what one more token costs
  (the step's fixed part is paid anyway). Where recent steps are too alike in size to
  fit a line, or the fit is not positive, their mean time per token stands in.

"Recent": exponentially weighted, each sample's weight halved after
:data:`HALF_LIFE_SAMPLES` newer ones. A hit of ``n`` pages is read when
``n x read_per_page < tokens_saved x per_token``; until both sides are measured, it
is read (and measured). A hit declined :data:`EXPLORE_EVERY` times in a row is read
anyway, so that a read estimate made while the store was slow is measured again.
SGLang's fixed ``prefetch_threshold`` (tokens) replaces all this when
``prefetch_threshold_tokens`` is set. Nothing here touches the tree or the tiers.
"""

from __future__ import annotations

from collections.abc import Iterable

HALF_LIFE_SAMPLES = 32
EXPLORE_EVERY = 16
_DECAY = 0.5 ** (1 / HALF_LIFE_SAMPLES)
_MIN_SPREAD = 0.1  # coefficient of variation of the sizes below which no line is fitted


class LinearCost:
    """Seconds against a size (tokens, pages), fitted to recent samples."""

    __slots__ = ("_w", "_x", "_y", "_xx", "_xy")

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, size: float, seconds: float) -> None:
        d = _DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + size
        self._y = d * self._y + seconds
        self._xx = d * self._xx + size * size
        self._xy = d * self._xy + size * seconds

    @property
    def measured(self) -> bool:
        return self._x > 0

    @property
    def mean_per_unit(self) -> float:
        """Mean seconds per unit of size (0 before any sample)."""
        return self._y / self._x if self._x > 0 else 0.0

    @property
    def per_unit(self) -> float:
        """Seconds one more unit costs: the fitted slope, or :attr:`mean_per_unit` where no
        line fits (sizes too alike) or the fit is not positive."""
        mean = self.mean_per_unit
        if self._w <= 0:
            return mean
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= (_MIN_SPREAD * mx) ** 2:
            return mean
        slope = (self._xy / self._w - mx * my) / var
        return min(slope, mean) if slope > 0 else mean


class CostModel:
    """The read-or-recompute decision of one scheduler half (see the module docstring)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.read = LinearCost()  # seconds per page read
        self.compute = LinearCost()  # seconds per token computed
        self._declined = 0  # hits declined in a row

    def observe(self, forwards: Iterable[tuple[int, float]],
                reads: Iterable[tuple[int, float]]) -> None:
        """Workers' samples: ``(tokens computed, seconds)`` of forwards and ``(pages
        read, seconds)`` of storage reads."""
        for tokens, seconds in forwards:
            if tokens > 0:
                self.compute.add(tokens, seconds)
        for pages, seconds in reads:
            if pages > 0:
                self.read.add(pages, seconds)

    def read_pays(self, num_read_pages: int, num_saved_pages: int) -> bool:
        """Reading ``num_read_pages`` is expected to take less time than computing the
        ``num_saved_pages`` pages of tokens it spares (an unmeasured side: read)."""
        if num_saved_pages <= 0:
            return False
        if not (self.read.measured and self.compute.measured):
            return True
        read_s = num_read_pages * self.read.mean_per_unit
        compute_s = num_saved_pages * self.page_size * self.compute.per_unit
        if read_s < compute_s:
            self._declined = 0
            return True
        self._declined += 1
        if self._declined >= EXPLORE_EVERY:
            self._declined = 0
            return True
        return False

    def summary(self) -> dict[str, float]:
        """The current estimates (for logs and tests)."""
        return {"read_s_per_page": self.read.mean_per_unit,
                "compute_s_per_token": self.compute.per_unit}
