"""CLI: `semcomm security`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the `security` command(s) to the main app."""
