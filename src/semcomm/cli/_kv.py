"""CLI: ``semcomm kv stats|verify|clear LOCATION`` for KV chunk stores.

LOCATION is a DiskStore directory or a ``redis://`` URL. Opening a directory here never evicts
(the budget is lifted) and never creates one.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..errors import ConfigError
from ..kv import DiskStore, RedisStore, StoreStats

__all__ = ["kv_app", "register"]

kv_app = typer.Typer(help="KV chunk stores (disk directory or Redis): stats, verify, clear.",
                     no_args_is_help=True)
_out = Console()
_NO_BUDGET = 1 << 62  # inspecting a store must not evict from it

_LOCATION = typer.Argument(..., help="DiskStore directory or redis:// URL.")
_PREFIX = typer.Option("semcomm:kv:", help="Key prefix (Redis only).")


def _open(location: str, prefix: str) -> DiskStore | RedisStore:
    if location.startswith(("redis://", "rediss://", "unix://")):
        store = RedisStore(location, prefix=prefix)
        if not store.ping():
            raise ConfigError(f"cannot reach Redis at {location}")
        return store
    path = Path(location).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{location!r} is not a directory (expected a DiskStore directory "
                          "or a redis:// URL)")
    return DiskStore(path, capacity_bytes=_NO_BUDGET)


def _table(title: str, st: StoreStats) -> Table:
    t = Table(title=title)
    t.add_column("field")
    t.add_column("value", justify="right")
    for name in ("entries", "bytes", "corrupt", "errors"):
        t.add_row(name, str(getattr(st, name)))
    return t


@kv_app.command("stats")
def stats(location: str = _LOCATION, prefix: str = _PREFIX) -> None:
    """Show the chunk count and bytes of a store (opening a directory drops invalid files)."""
    store = _open(location, prefix)
    _out.print(_table(f"{store.name} store {location}", store.stats()))
    store.close()


@kv_app.command("verify")
def verify(location: str = _LOCATION, prefix: str = _PREFIX) -> None:
    """Read and check every chunk (header, key, checksum); corrupt ones are removed."""
    store = _open(location, prefix)
    keys = list(store.scan())
    ok = 0
    with Progress(console=_out, transient=True) as progress:
        task = progress.add_task("verifying", total=len(keys))
        for key in keys:
            ok += store.get(key) is not None
            progress.advance(task)
    st = store.stats()
    _out.print(f"{ok} of {len(keys)} chunks valid; {st.corrupt} corrupt removed")
    store.close()
    if st.corrupt:
        raise typer.Exit(1)


@kv_app.command("clear")
def clear(
    location: str = _LOCATION,
    prefix: str = _PREFIX,
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
) -> None:
    """Delete every chunk of a store."""
    store = _open(location, prefix)
    n = sum(1 for _ in store.scan())
    if not yes and not typer.confirm(f"delete {n} chunks from {location}?"):
        raise typer.Exit(1)
    store.clear()
    _out.print(f"deleted {n} chunks")
    store.close()


def register(app: typer.Typer) -> None:
    app.add_typer(kv_app, name="kv")
