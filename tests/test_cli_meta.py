"""Every CLI command has help text and is documented in the README's command table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer.main

from semcomm.cli import app

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _commands() -> list[tuple[str, Any]]:
    root = typer.main.get_command(app)
    out: list[tuple[str, Any]] = []
    for name, cmd in root.commands.items():  # type: ignore[attr-defined]
        out.append((name, cmd))
        if hasattr(cmd, "commands"):  # a command group
            out.extend((f"{name} {sub}", c) for sub, c in cmd.commands.items())
    return out


def test_every_command_has_help_text() -> None:
    missing = [name for name, cmd in _commands() if not (cmd.help or cmd.short_help)]
    assert not missing, f"commands without help text: {missing}"


def test_every_command_group_is_in_the_readme() -> None:
    root: Any = typer.main.get_command(app)
    undocumented = [n for n in root.commands if f"`semcomm {n}" not in README]
    assert not undocumented, f"commands missing from README.md: {undocumented}"


def test_every_subcommand_is_in_the_readme_or_docs() -> None:
    docs = README + "".join(p.read_text() for p in (Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    missing = [n for n, _ in _commands() if " " in n and n.split()[1] not in docs]
    assert not missing, f"subcommands mentioned nowhere in README.md or docs/: {missing}"
