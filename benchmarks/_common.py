"""Output helpers shared by the benchmark scripts: the JSON results file and saved charts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["agg_figure", "write_json"]


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
