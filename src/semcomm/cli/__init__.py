"""The ``semcomm`` command line: a thin typer app over the packages.

Each command group lives in its own ``cli/_<group>.py`` module exposing ``register(app)``.
User-facing errors (:class:`semcomm.errors.SemcommError`) become one red line and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

from ..errors import SemcommError

__all__ = ["app", "main"]

app = typer.Typer(
    name="semcomm",
    help="semcomm: KV prefix cache, semantic cache, cache-to-cache fusion and routing for LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_GROUPS = (
    "_quickstart", "_models", "_reference", "_kv", "_cache", "_fusion", "_route", "_serve", "_security",
    "_rag", "_agents",
)

for _name in _GROUPS:
    importlib.import_module(f"{__name__}.{_name}").register(app)


def main() -> None:
    """Console-script entry point."""
    try:
        # transformers' per-load progress bars would drown the CLI's own output
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    try:
        app()
    except SemcommError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
