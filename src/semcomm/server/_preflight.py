"""What a configuration needs from the machine, checked before any model loads.

``preflight(config)`` runs first in ``build_gateway`` (so ``semcomm serve`` refuses a bad path
with one line, not a traceback after the models loaded) and in ``semcomm serve --check``
(which creates nothing): every state directory (``server.state_dir``, ``kv.disk_path``, the
SQLite semantic file's directory, ``$SEMCOMM_HOME``) must be a directory or creatable under a
writable one, the server secret must be readable or creatable, and the model router file the config names
(``routing.model_router``) must exist and route to configured models. Each problem is a
:class:`~semcomm.errors.ConfigError` naming the key, the path and how to fix it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ConfigError
from ._config import ServerConfig

__all__ = ["preflight"]


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _directory(key: str, path: Path, *, create: bool) -> None:
    """``path`` is a writable directory, or can be created as one (and is, with ``create``)."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: {path} is not a directory (it is a file); point {key} at "
                              "a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: directory {path} is not writable (read-only mount or "
                              "permissions); point it at a writable directory")
        return
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ConfigError(f"{key}: cannot create {path}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot create {path}: {base} is not writable (read-only "
                          "mount or permissions)")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{key}: cannot create {path}: {exc.strerror or exc}") from None


def _file(key: str, path: Path, *, create: bool) -> None:
    """``path`` is a writable file, or can be created (its directory is checked)."""
    if path.exists():
        if path.is_dir():
            raise ConfigError(f"{key}: {path} is a directory; give a file path")
        if not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(f"{key}: file {path} is not readable and writable")
        return
    _directory(f"{key} (its directory)", path.parent, create=create)


def _secret(config: ServerConfig, *, create: bool) -> None:
    if config.server.secret or os.environ.get("SEMCOMM_SECRET"):
        return
    from ..security import semcomm_home

    home = semcomm_home()
    _directory("SEMCOMM_HOME", home, create=create)
    path = home / "secret"
    if path.exists():
        try:
            bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"the server secret file {path} is unreadable or not hex ({exc}); "
                              "remove it to make a new one (caches sealed with it are lost) or "
                              "set SEMCOMM_SECRET") from None


def _model_router(config: ServerConfig) -> None:
    name = config.routing.model_router
    if not name:
        return
    from ..routing import SHIPPED_ROUTERS

    if name in SHIPPED_ROUTERS:
        return
    path = Path(name).expanduser()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"routing.model_router: {path} does not exist (a file from "
                          f"`semcomm route train`, or a shipped name: {sorted(SHIPPED_ROUTERS)})"
                          ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"routing.model_router: cannot read {path}: {exc}") from None
    models = [m.get("name") for m in doc.get("models", [])] if isinstance(doc, dict) else None
    if not models:
        raise ConfigError(f"routing.model_router: {path} is not a semcomm model router file")
    unknown = [m for m in models if m not in config.models]
    if unknown:
        raise ConfigError(f"routing.model_router: {path} routes to models that are not "
                          f"configured: {unknown}")


def preflight(config: ServerConfig, *, create: bool = True) -> None:
    """Check (and with ``create``, make) what ``config`` needs on this machine; see the module
    docstring. Raises :class:`ConfigError`; with ``create=False`` nothing is written."""
    _secret(config, create=create)
    state = config.state_dir()
    _directory("server.state_dir", state, create=create)
    kv = config.kv
    if kv.enabled and "disk" in kv.tiers:
        path = Path(kv.disk_path).expanduser() if kv.disk_path else state / "kv"
        _directory("kv.disk_path", path, create=create)
    sc = config.semantic
    if sc.enabled and sc.backend == "sqlite":
        path = Path(sc.path).expanduser() if sc.path else state / "semantic.sqlite3"
        _file("semantic.path", path, create=create)
    _model_router(config)
    # a pipeline's missing fuser is not an error: the pipeline hands off by text (noted in
    # /health), as it always has
