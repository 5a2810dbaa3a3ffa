"""The benchmarks' --plot: the one place that imports matplotlib, an optional dependency.

matplotlib is not one of kungfu's dependencies, so a benchmark imports it only when asked to
draw, through pyplot() here: with the Agg backend (PNG files, no display needed) or, where it is
not installed, a one-line error that says how to install it. A driver calls pyplot() once
before it measures, so that a missing matplotlib stops it at once rather than after the run.
"""
from __future__ import annotations

import os

MISSING = "--plot needs matplotlib, which is not installed: pip install matplotlib"


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend); SystemExit(MISSING) without it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> None:
    """Writes `fig` to the PNG `path` (making its folder), frees it, and prints where it is."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    print(f"plot: {path}")
