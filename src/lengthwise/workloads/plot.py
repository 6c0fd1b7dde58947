"""Pictures of length distributions (matplotlib, imported only when a picture is asked for)."""

from __future__ import annotations

import io

import numpy as np


def histogram_png(lengths: np.ndarray, *, title: str) -> bytes:
    """PNG bytes of log-log histograms of `lengths`, by sequences and by tokens."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only --plot needs it
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5))
    FigureCanvasAgg(fig)
    bins = np.geomspace(max(1, lengths.min()), lengths.max() + 1, 60)
    for ax, weights, label in zip(fig.subplots(1, 2), (None, lengths), ("sequences", "tokens")):
        ax.hist(lengths, bins=bins, weights=weights)
        ax.set_xscale("log")
        ax.set_yscale("log")  # the tail is 1e-4 of the sequences; keep it visible
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
    fig.suptitle(f"{title}: {lengths.size:,} sequences")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
