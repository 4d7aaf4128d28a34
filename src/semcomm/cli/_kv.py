"""CLI: ``semcomm kv stats|verify|clear LOCATION`` for KV chunk stores.

LOCATION is a DiskStore directory or a ``redis://`` URL. Opening a directory here never evicts
(the budget is lifted) and never creates anything: a directory without the store's
``.semcomm-kv`` marker is refused, so pointing a command at the wrong directory leaves it as
it was.

``verify`` checks every chunk's header, key and checksum, and, for sealed chunks, their seal
(AES-GCM authentication) with the server's keys when they can be found: ``--config``'s
``server.secret`` and ``security.seal_secrets``, else ``SEMCOMM_SECRET``, else the secret file
under ``$SEMCOMM_HOME`` (read, never created). Where no key is found it says so and how many
sealed chunks went unchecked. A chunk whose seal fails is removed only when the same keys open
another chunk of the store (so a wrong secret never empties it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..errors import ConfigError, CorruptEntryError
from ..kv import DiskStore, RedisStore, StoreStats, read_header

__all__ = ["kv_app", "register"]

kv_app = typer.Typer(help="KV chunk stores (disk directory or Redis): stats, verify, clear.",
                     no_args_is_help=True)
_out = Console()
_NO_BUDGET = 1 << 62  # inspecting a store must not evict from it
_MARKER = ".semcomm-kv"  # what makes a directory a DiskStore (kv._disk writes it)

_LOCATION = typer.Argument(..., help="DiskStore directory or redis:// URL.")
_PREFIX = typer.Option("semcomm:kv:", help="Key prefix (Redis only).")
_CONFIG = typer.Option(None, "--config", "-c", help="Server TOML config whose server.secret and "
                       "security.seal_secrets open sealed chunks (default: SEMCOMM_SECRET, "
                       "else the secret file under $SEMCOMM_HOME).")


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
    if not (path / _MARKER).is_file():
        raise ConfigError(f"{location!r} is not a semcomm KV store (no {_MARKER} marker in it); "
                          "nothing was changed")
    return DiskStore(path, capacity_bytes=_NO_BUDGET)


def _chunk_sealer(config: Path | None) -> tuple[Any, str]:
    """The server's chunk sealer, found without creating anything, or (None, why not)."""
    from ..security import ChunkSealer, keyring_from_config, semcomm_home

    secret: str | None = None
    seal_secrets = None
    source = ""
    if config is not None:
        from ..server import load_config

        cfg = load_config(config)
        secret, seal_secrets = cfg.server.secret, cfg.security.seal_secrets
        source = f"{config}"
    if seal_secrets is None and secret is None:
        secret = os.environ.get("SEMCOMM_SECRET")
        source = "SEMCOMM_SECRET"
        if secret is None:
            path = semcomm_home() / "secret"
            if not path.is_file():
                return None, (f"no server secret found (no --config, no SEMCOMM_SECRET, no "
                              f"{path})")
            secret = path.read_text().strip()
            source = str(path)
    keyring = keyring_from_config({"seal_secrets": seal_secrets}, secret)
    return ChunkSealer(keyring), source


def _is_sealed(raw: bytes) -> bool:
    from ..security import SEAL_META_KEY

    return bool(read_header(raw).meta.get(SEAL_META_KEY))  # the header stays readable


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
def verify(location: str = _LOCATION, prefix: str = _PREFIX,
           config: Path | None = _CONFIG) -> None:
    """Read and check every chunk (header, key, checksum, and the seal of sealed chunks where
    the server's keys are found); corrupt and forged ones are removed."""
    sealer, source = _chunk_sealer(config)
    store = _open(location, prefix)
    keys = list(store.scan())
    ok = 0
    sealed: list[tuple[Any, bytes]] = []
    with Progress(console=_out, transient=True) as progress:
        task = progress.add_task("verifying", total=len(keys))
        for key in keys:
            raw = store.get(key)  # header, key and checksum; a bad one is counted and removed
            if raw is not None:
                ok += 1
                if _is_sealed(bytes(raw)):
                    sealed.append((key, bytes(raw)))
            progress.advance(task)
    st = store.stats()
    forged: list[Any] = []
    if sealer is not None:
        for key, raw in sealed:
            try:
                sealer.open(raw)
            except (CorruptEntryError, ValueError):
                forged.append(key)
        if forged and len(forged) == len(sealed):
            store.close()
            _out.print(f"{ok} of {len(keys)} chunks pass their checksum; none of the "
                       f"{len(sealed)} sealed chunks opens with the keys from {source}: the "
                       "wrong secret? Nothing removed.")
            raise typer.Exit(1)
        for key in forged:
            store.delete(key)
    valid = ok - len(forged)
    _out.print(f"{valid} of {len(keys)} chunks valid; {st.corrupt} corrupt removed"
               + (f"; {len(forged)} failed their seal (forged or tampered) removed"
                  if forged else ""))
    if sealed:
        _out.print(f"seals of {len(sealed)} sealed chunks checked with the keys from {source}"
                   if sealer is not None else
                   f"seals NOT checked: {len(sealed)} sealed chunks passed their checksum only; "
                   f"{source}. Pass --config or set SEMCOMM_SECRET to check them.")
    store.close()
    if st.corrupt or forged:
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
