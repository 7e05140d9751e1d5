"""The singular-value picture of Yang et al. (2018, Fig. 2) / the rank study: for each model,
the cumulative share of normalised singular values ``s_i / s_max`` below a threshold, the
threshold on a log-scale x axis. A softmax model's curve jumps to 1 just after its d + 2
leading values; a high-rank head's curve rises late and gradually."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

DEFAULT_RANGE = (1e-8, 1.0)


def cumulative_share(values: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Fraction of ``values / max(values)`` strictly below each threshold."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0 or values.max() <= 0:
        raise ValueError("need at least one positive singular value")
    normalised = np.sort(values / values.max())
    return np.searchsorted(normalised, thresholds, side="left") / normalised.size


def plot_spectrum(
    curves: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    *,
    threshold_range: tuple[float, float] = DEFAULT_RANGE,
    press_thresholds: Mapping[str, float] | None = None,
    resolution: float | None = None,
    title: str = "Normalised singular values of the log-probability matrix",
) -> Path:
    """Write a PNG with one curve per ``label: singular values``; ``press_thresholds``
    (label: threshold / s_max) marks each model's Press threshold with a dotted line, and
    ``resolution`` (a fraction of s_max) greys out the values the method cannot resolve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    low, high = threshold_range
    thresholds = np.logspace(np.log10(low), np.log10(high), 400)
    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, values in curves.items():
        line = axes.plot(thresholds, cumulative_share(values, thresholds), label=label)[0]
        if press_thresholds and label in press_thresholds:
            axes.axvline(press_thresholds[label], color=line.get_color(), linestyle=":", lw=1)
    if resolution is not None and resolution > low:
        axes.axvspan(low, resolution, color="0.85", zorder=0, label="not resolved (noise)")
    axes.set_xscale("log")
    axes.set_xlabel("threshold on s / s_max")
    axes.set_ylabel("share of singular values below")
    axes.set_ylim(0, 1.02)
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
