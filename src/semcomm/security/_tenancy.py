"""Server-side tenant salts.

A tenant's salt is ``HMAC-SHA256(server_secret, "semcomm/tenant-salt/v{version}/" + tenant_id)``.
Clients never choose it: they present credentials, the server maps them to a tenant id and
derives the salt here. The *digest* of the salt (never the salt itself) goes into every KV
namespace, prefix-index key and semantic scope, so that different tenants can never share a key.

The server secret comes from, in order: the ``secret=`` argument, the ``SEMCOMM_SECRET``
environment variable (hex or text), or a per-user secret file
(``$SEMCOMM_HOME/secret``, default ``~/.cache/semcomm/secret``) created with mode 0600 on first
use, so that processes on one machine agree on keys without configuration. Machines that share
a Redis store must share ``SEMCOMM_SECRET``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType

from ..errors import ConfigError, TenantError

__all__ = [
    "CLIENT_SALT_FIELDS",
    "NO_TENANT_DIGEST",
    "ClientSaltError",
    "TenantId",
    "TenantSalt",
    "TenantSalter",
    "load_server_secret",
    "reject_client_salt",
    "semcomm_home",
]

TenantId = NewType("TenantId", str)
"""A tenant's name as configured on the server; never taken from a client-controlled field."""

NO_TENANT_DIGEST = "public"
"""Salt digest used for data that belongs to no tenant (single-user, or prefixes marked public)."""

_SALT_LABEL = "semcomm/tenant-salt/v{version}/"


def semcomm_home() -> Path:
    """Directory for per-user semcomm state (secret file, default caches)."""
    return Path(os.environ.get("SEMCOMM_HOME", Path.home() / ".cache" / "semcomm"))


def load_server_secret(secret: bytes | str | None = None) -> bytes:
    """Return the server secret (see the module docstring for the lookup order)."""
    if secret is None:
        secret = os.environ.get("SEMCOMM_SECRET")
    if secret is not None:
        if isinstance(secret, str):
            try:
                raw = bytes.fromhex(secret)
            except ValueError:
                raw = secret.encode("utf-8")
        else:
            raw = bytes(secret)
        if len(raw) < 16:
            raise TenantError("the server secret must be at least 16 bytes long")
        return raw
    path = semcomm_home() / "secret"
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        raise _secret_error(path, "SEMCOMM_HOME is a file, not a directory") from None
    new = secrets.token_bytes(32)
    tmp = path.with_name(f"secret.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(new.hex())
        try:
            os.link(tmp, path)  # atomic: the first process to create the file wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return _read_secret(path)
    except OSError as exc:
        raise _secret_error(path, exc.strerror or str(exc)) from None


def _read_secret(path: Path) -> bytes:
    text = path.read_text()
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise _secret_error(path, "its content is not hex") from None


def _secret_error(path: Path, why: str) -> ConfigError:
    return ConfigError(f"cannot read or create the server secret file {path}: {why}; set "
                       "SEMCOMM_SECRET (or server.secret), or point SEMCOMM_HOME at a writable "
                       "directory")


@dataclass(frozen=True, slots=True)
class TenantSalt:
    """A tenant's salt. ``value`` is secret; ``digest`` is what goes into keys and scopes."""

    tenant: str  # the tenant id it was derived for
    version: int  # secret/salt version, bumped on rotation
    value: bytes  # 32 secret bytes; never logged, never stored next to data

    @property
    def digest(self) -> str:
        """Hex SHA-256 of the salt: safe to place in keys and headers."""
        return hashlib.sha256(b"semcomm/salt-digest/" + self.value).hexdigest()


class TenantSalter:
    """Derives tenant salts from the server secret; one per server, passed to every component.

    Versioned: ``rotate(new_secret)`` makes a new version current while older versions stay
    derivable (readers can still find entries written under them).
    """

    def __init__(self, secret: bytes | str | None = None, *, version: int = 1):
        self._secrets: dict[int, bytes] = {version: load_server_secret(secret)}
        self._current = version

    @property
    def version(self) -> int:
        return self._current

    def rotate(self, new_secret: bytes | str) -> int:
        """Install a new secret as the next version and return that version number."""
        self._current = max(self._secrets) + 1
        self._secrets[self._current] = load_server_secret(new_secret)
        return self._current

    def versions(self) -> list[int]:
        return sorted(self._secrets, reverse=True)

    def salt(self, tenant: str, *, version: int | None = None) -> TenantSalt:
        if not isinstance(tenant, str) or not tenant:
            raise TenantError(f"tenant id must be a non-empty string, got {tenant!r}")
        v = self._current if version is None else version
        try:
            secret = self._secrets[v]
        except KeyError:
            raise TenantError(f"unknown salt version {v}; known: {self.versions()}") from None
        label = (_SALT_LABEL.format(version=v) + tenant).encode("utf-8")
        return TenantSalt(tenant=tenant, version=v, value=hmac.new(secret, label, "sha256").digest())

    def digest(self, tenant: str | None, *, version: int | None = None) -> str:
        """Salt digest for ``tenant``; :data:`NO_TENANT_DIGEST` when ``tenant`` is None."""
        if tenant is None:
            return NO_TENANT_DIGEST
        return self.salt(tenant, version=version).digest


CLIENT_SALT_FIELDS = frozenset(
    {"cache_salt", "salt", "cache_salt_map", "salt_regions", "tenant_salt", "cache_namespace"}
)
"""Request fields through which other servers let clients choose a cache salt (vLLM ``cache_salt``,
its proposed ``cache_salt_map``/``salt_regions``). semcomm derives salts itself and refuses them."""

_CLIENT_SALT_HEADERS = frozenset({"x-cache-salt", "x-semcomm-salt", "x-tenant-salt"})
_NESTED = ("extra_body", "metadata", "semcomm")  # containers some clients use for extra fields


class ClientSaltError(TenantError):
    """A client tried to choose its own cache salt; the server answers 400."""

    status_code = 400

    def __init__(self, field: str) -> None:
        super().__init__(
            f"request field {field!r} is not accepted: semcomm derives cache salts on the server "
            "from the authenticated tenant (a client-chosen salt would let one tenant read "
            "another's cache, CVE-2025-46570); remove the field"
        )
        self.field = field


def reject_client_salt(
    body: Mapping[str, Any] | None, headers: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`ClientSaltError` if a request tries to supply a salt.

    Checks the top level of ``body``, the nested containers ``extra_body``/``metadata``/``semcomm``,
    and salt headers. Call it on every request before anything is looked up in a cache.
    """
    if body:
        for name in body:
            if isinstance(name, str) and name.lower() in CLIENT_SALT_FIELDS:
                raise ClientSaltError(name)
        for container in _NESTED:
            inner = body.get(container)
            if isinstance(inner, Mapping):
                for name in inner:
                    if isinstance(name, str) and name.lower() in CLIENT_SALT_FIELDS:
                        raise ClientSaltError(f"{container}.{name}")
    if headers:
        for name in headers:
            if name.lower() in _CLIENT_SALT_HEADERS:
                raise ClientSaltError(f"header {name}")
