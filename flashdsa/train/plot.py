"""Loss curves as a PNG, drawn by matplotlib (the ``train`` extra: ``pip install 'flashdsa[train]'``).

Without matplotlib the PNG is skipped with one logged line; training does not need it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from flashdsa.train.safe_io import atomic_path

logger = logging.getLogger(__name__)

Series = tuple[str, Sequence[tuple[float, float]]]  # label, (step, value) points


def save_loss_png(path: str | Path, series: Sequence[Series]) -> bool:
    """Draw each series as a line over the steps (one point: a marker) and write the PNG to
    ``path`` (in one rename). Returns False, having logged why, when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    except ImportError:
        logger.warning("matplotlib is not installed, so %s is not drawn (pip install 'flashdsa[train]')", path)
        return False
    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    axes = figure.subplots()
    for label, points in series:
        steps, values = zip(*points) if points else ((), ())
        axes.plot(steps, values, label=label, marker="o" if len(points) == 1 else None)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    if series:
        axes.legend()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png")
    return True
