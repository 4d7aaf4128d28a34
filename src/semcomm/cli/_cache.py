"""CLI: `semcomm cache`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `cache` command(s) to the main app."""
