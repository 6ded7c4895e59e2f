"""The TTFT plots of ``hicache demo --plot`` and ``hicache bench vllm --plot``: one figure routine.

Both commands draw time to first token per configuration, one line each, on a log
axis, into a PNG: the demo per request in trace order, the vLLM bench as a CDF.
:func:`save_ttft_plot` holds what they share (the headless backend, log scale,
labels, grid, legend, file); the two public functions only say which curve.
matplotlib is imported when a plot is drawn (the commands check for it up front
with :func:`hicache.cli.args.require_matplotlib`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np


def save_ttft_plot(
    path: str,
    ttft_ms: Mapping[str, Sequence[float]],
    title: str,
    draw: Callable[[object, str, np.ndarray], None],
    *,
    xlabel: str,
    ylabel: str,
    log_axis: str,
    figsize: tuple[float, float],
) -> None:
    """Write a PNG (120 dpi) with one curve per ``ttft_ms`` entry, labelled by its key.

    ``draw(ax, label, values)`` adds one curve; ``log_axis`` (``"x"`` or ``"y"``) is the
    TTFT axis, drawn on a log scale.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    for label, values in ttft_ms.items():
        draw(ax, label, np.asarray(values, dtype=float))
    (ax.set_xscale if log_axis == "x" else ax.set_yscale)("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft_per_request(path: str, ttft_ms: Mapping[str, Sequence[float]], title: str) -> None:
    """TTFT (ms, log scale) of each request in trace order, one line per configuration."""

    def draw(ax, label: str, values: np.ndarray) -> None:
        ax.plot(range(len(values)), values, marker=".", linewidth=1, label=label)

    save_ttft_plot(path, ttft_ms, title, draw, xlabel="request (trace order)",
                   ylabel="TTFT (ms)", log_axis="y", figsize=(10, 4.5))


def plot_ttft_cdf(path: str, ttft_ms: Mapping[str, Sequence[float]], title: str) -> None:
    """The distribution of TTFT (ms, log scale): fraction of requests at or below each value."""

    def draw(ax, label: str, values: np.ndarray) -> None:
        values = np.sort(values)
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)

    save_ttft_plot(path, ttft_ms, title, draw, xlabel="time to first token (ms)",
                   ylabel="fraction of requests", log_axis="x", figsize=(7, 4.5))
