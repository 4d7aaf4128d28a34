"""CLI: `semcomm reference`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `reference` command(s) to the main app."""
