"""CLI: `semcomm fusion`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `fusion` command(s) to the main app."""
