"""CLI: `semcomm route`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `route` command(s) to the main app."""
