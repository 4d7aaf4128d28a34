"""CLI: `semcomm quickstart`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `quickstart` command(s) to the main app."""
