"""The semcomm error tree.

Every error a user can act on derives from :class:`SemcommError`; the CLI turns
them into one line and an exit code. Internal invariants use ``assert``; caller
bugs (wrong types) raise ``TypeError``/``ValueError`` directly.

    SemcommError
    ├── ConfigError              bad configuration (names the key and the problem)
    ├── InvalidInputError        bad request input (empty prompt, too long, bad ids)
    ├── UnsupportedModelError    model family the engine cannot restore exactly
    ├── NamespaceMismatchError   KV data or snapshot from another namespace
    ├── CodecError               unknown codec or bad codec parameters
    ├── StoreError               a store failed in a way the caller must see
    │   └── CorruptEntryError    header, checksum or seal check failed (never served)
    ├── IntegrityError           authenticated data failed verification
    ├── TenantError              unknown tenant, client-chosen salt, bad credentials
    ├── BackendUnavailableError  an external backend (Redis, upstream) is down
    ├── UpstreamError            an upstream model server failed (timeout, 5xx)
    ├── OverloadedError          bounded queue full (maps to 429/503 + Retry-After)
    └── MissingDependencyError   optional extra not installed (says what to install)

Warnings derive from :class:`SemcommWarning`.
"""

from __future__ import annotations

__all__ = [
    "BackendDownWarning",
    "BackendUnavailableError",
    "CodecError",
    "ConfigError",
    "CorruptEntryError",
    "IntegrityError",
    "InvalidInputError",
    "MissingDependencyError",
    "NamespaceMismatchError",
    "OverloadedError",
    "SemcommError",
    "SemcommWarning",
    "StoreError",
    "TenantError",
    "UnsupportedModelError",
    "UpstreamError",
    "require",
]


class SemcommError(Exception):
    """Base of all user-facing semcomm errors."""


class ConfigError(SemcommError, ValueError):
    """Invalid configuration; the message names the key and the problem."""


class InvalidInputError(SemcommError, ValueError):
    """Invalid request input."""


class UnsupportedModelError(SemcommError):
    """The model cannot be served with exact KV reuse."""


class NamespaceMismatchError(SemcommError, ValueError):
    """KV data belongs to another model, tokenizer, codec or tenant namespace."""


class CodecError(SemcommError, ValueError):
    """Unknown codec name or invalid codec parameters."""


class StoreError(SemcommError):
    """A store operation failed."""


class CorruptEntryError(StoreError):
    """Stored bytes failed header, checksum or seal verification; never served."""


class IntegrityError(SemcommError):
    """Authenticated data failed verification (tampered, swapped or forged)."""


class TenantError(SemcommError, PermissionError):
    """Unknown tenant, bad credentials, or a client-chosen salt."""


class BackendUnavailableError(SemcommError):
    """An external backend (Redis, an upstream server) is unreachable."""


class UpstreamError(SemcommError):
    """An upstream model server failed (timeout, 5xx, malformed reply)."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class OverloadedError(SemcommError):
    """A bounded queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MissingDependencyError(SemcommError, ImportError):
    """An optional dependency is missing; the message says which extra to install."""


class SemcommWarning(UserWarning):
    """Base of semcomm warnings."""


class BackendDownWarning(SemcommWarning):
    """A backend is down; the operation degraded to a miss."""


def require(module: str, extra: str):  # type: ignore[no-untyped-def]
    """Import an optional dependency or raise a :class:`MissingDependencyError` with the fix."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            f"{module!r} is not installed; install it with: pip install 'semcomm[{extra}]'"
        ) from exc
