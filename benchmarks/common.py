"""What the benchmarks share: where results and data live, the JSON results file, saved charts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["DATA", "RESULTS", "ROOT", "agg_figure", "write_json"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (benchmarks run from here: ``python -m benchmarks.<area>.<name>``)."""
RESULTS = ROOT / "benchmarks" / "results"
"""One JSON and one PNG per benchmark, overwritten by its next run."""
DATA = ROOT.parent / "shared" / "data"
"""The shared data sets (CLINC150, Quora, MCQA, traces) beside the checkout."""


def write_json(path: Path, results: Any, console: Console) -> None:
    """Write ``results`` to ``path`` as indented JSON and say so."""
    path.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {path}")


@contextmanager
def agg_figure(path: Path, figsize: tuple[float, float]) -> Iterator[Any]:
    """The axes of one matplotlib figure (Agg backend), saved to ``path`` at 110 dpi.

    The caller draws inside the ``with`` block; the layout is tightened and the PNG written when
    the block ends, and the figure is closed either way.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
