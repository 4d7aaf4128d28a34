"""CLI: `semcomm serve`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `serve` command(s) to the main app."""
