"""AEAD sealing of data at rest: per-scope AES-256-GCM keys derived by HKDF, with rotation.

Envelope (big-endian framing, all of it authenticated)::

    b"SCS1"        4 bytes  magic and envelope format version
    key_version    u32      fingerprint of the master secret the data key came from
    nonce          12 bytes random per seal (96-bit GCM IV)
    ciphertext     n bytes  AES-256-GCM of the plaintext
    tag            16 bytes GCM tag

The data key of a *scope* is ``HKDF-SHA256(ikm=master[key_version], salt="semcomm/seal/v1",
info="semcomm/seal-key/v1" || u32len(scope) || scope)``. A scope names the tenant boundary the
data lives in: a KV namespace digest (which folds in the tenant salt digest) or a semantic scope
string (which starts with the tenant salt digest). Different tenants therefore never share a key.

The associated data binds a sealed blob to where it may be read::

    "semcomm/sealed/v1" || u32len(kind) || kind || u32len(scope) || scope
                        || u32len(context) || context || envelope header (magic + key_version)

``kind`` separates uses ("kv-chunk", "semantic-entry"), ``context`` is the entry's own identity
(its chunk key and header, its entry id). A blob moved to another key, namespace, tenant or kind,
or a blob written by anyone without the server secret, fails the GCM tag: :class:`SealedEntryError`
(an :class:`~semcomm.errors.IntegrityError` that is also a :class:`~semcomm.errors.CorruptEntryError`,
so that a store's corrupt-entry path counts and deletes it). Only holders of the server secret can
produce blobs that readers accept: that is the writer authentication.

Rotation: :meth:`TenantKeyring.rotate` makes a new master current; older versions stay readable
until :meth:`TenantKeyring.retire` drops them (a version is the secret's fingerprint, so the
order in which secrets are configured does not matter). :meth:`Sealer.open_ex` reports ``stale`` so a store
may re-seal an entry under the current version when it reads it.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import CorruptEntryError, IntegrityError
from ._tenancy import load_server_secret

__all__ = [
    "ENVELOPE_MAGIC",
    "ENVELOPE_OVERHEAD",
    "Opened",
    "SealStats",
    "SealedEntryError",
    "Sealer",
    "TenantKeyring",
    "envelope_version",
    "is_sealed",
]

ENVELOPE_MAGIC = b"SCS1"
_HEAD = struct.Struct(">4sI")  # magic, key_version
_NONCE_LEN = 12
_TAG_LEN = 16
ENVELOPE_OVERHEAD = _HEAD.size + _NONCE_LEN + _TAG_LEN
"""Bytes a sealed blob adds to its plaintext (36)."""

_HKDF_SALT = b"semcomm/seal/v1"
_HKDF_INFO = b"semcomm/seal-key/v1"
_AAD_LABEL = b"semcomm/sealed/v1"


class SealedEntryError(IntegrityError, CorruptEntryError):
    """A sealed entry failed authentication (tampered, swapped, forged, or unsealed where sealing
    is required). Never served; stores count and delete it like any corrupt entry."""


def _lp(data: bytes) -> bytes:
    """Length-prefixed framing, so that ("ab", "c") and ("a", "bc") never collide."""
    return struct.pack(">I", len(data)) + data


def is_sealed(blob: bytes | bytearray | memoryview) -> bool:
    """Whether ``blob`` starts like a sealed envelope (cheap; does not authenticate it)."""
    return len(blob) >= ENVELOPE_OVERHEAD and bytes(blob[:4]) == ENVELOPE_MAGIC


def envelope_version(blob: bytes | bytearray | memoryview) -> int:
    """Key version recorded in a sealed envelope (unauthenticated until opened)."""
    if not is_sealed(blob):
        raise SealedEntryError("not a sealed envelope")
    return int(_HEAD.unpack_from(bytes(blob[: _HEAD.size]))[1])


@dataclass(slots=True)
class SealStats:
    """Counters of one :class:`Sealer`; updated under its lock."""

    sealed: int = 0  # blobs produced
    opened: int = 0  # blobs authenticated and decrypted
    rejected: int = 0  # blobs that failed authentication (tampered/swapped/forged/unsealed)
    stale: int = 0  # opened blobs sealed under an older key version
    by_reason: dict[str, int] = field(default_factory=dict)  # rejected, per reason


@dataclass(frozen=True, slots=True)
class Opened:
    """Result of :meth:`Sealer.open_ex`."""

    plaintext: bytes
    key_version: int  # version (secret fingerprint) the blob was sealed under
    stale: bool  # True when a newer key version is current: re-seal to migrate


class TenantKeyring:
    """Master secrets (one per key version) and the per-scope AES-256 keys derived from them.

    A key version is a 32-bit *fingerprint* of its master secret, not a counter: the envelope
    names the secret that sealed it, so a server can list its secrets in any order, add a new one
    (:meth:`rotate`) and drop an old one (:meth:`retire`, or by leaving it out of the config)
    without renumbering what the others sealed.

    Invariant: ``current`` is always a key of ``_masters``; retired versions are gone for good
    (blobs sealed under them become unreadable, which is the point of retiring). Derived keys
    are memoised in a bounded LRU (``max_cached_keys``), so memory stays bounded however many
    tenants and namespaces exist.
    """

    def __init__(self, secret: bytes | str | None = None, *, max_cached_keys: int = 4096) -> None:
        # The master is domain-separated from the salt secret: one server secret serves both.
        master = self._master(load_server_secret(secret))
        self._current = self._fingerprint(master)
        self._masters: dict[int, bytes] = {self._current: master}
        self._cache: OrderedDict[tuple[int, str], bytes] = OrderedDict()
        self._max_cached = max_cached_keys
        self._lock = threading.Lock()

    @classmethod
    def from_secrets(cls, secrets: Sequence[bytes | str], **kw: Any) -> TenantKeyring:
        """A keyring holding every secret of ``secrets``; the last one is current.

        This is how a server keeps reading entries sealed before a rotation: list the old
        secrets and then the new one (``[security] seal_secrets`` in the server config).
        """
        if not secrets:
            raise ValueError("from_secrets needs at least one secret")
        ring = cls(secrets[0], **kw)
        for s in secrets[1:]:
            ring.rotate(s)
        return ring

    @staticmethod
    def _master(secret: bytes) -> bytes:
        return hashlib.sha256(b"semcomm/seal-master/v1\0" + secret).digest()

    @staticmethod
    def _fingerprint(master: bytes) -> int:
        return int.from_bytes(hashlib.sha256(b"semcomm/seal-key-id/v1\0" + master).digest()[:4], "big")

    @property
    def current(self) -> int:
        """The key version (secret fingerprint) new blobs are sealed under."""
        return self._current

    def versions(self) -> list[int]:
        """Readable key versions (fingerprints), current first."""
        with self._lock:
            return [self._current] + [v for v in self._masters if v != self._current]

    def rotate(self, new_secret: bytes | str) -> int:
        """Make ``new_secret`` current and return its version; older ones stay readable."""
        master = self._master(load_server_secret(new_secret))
        fp = self._fingerprint(master)
        with self._lock:
            if fp in self._masters and self._masters[fp] != master:  # pragma: no cover - 2^-32
                raise ValueError("key fingerprint collision; choose another secret")
            self._masters[fp] = master
            self._current = fp
            return fp

    def retire(self, version: int) -> None:
        """Forget an old version: blobs sealed under it are rejected from now on."""
        with self._lock:
            if version == self._current:
                raise ValueError("cannot retire the current key version; rotate first")
            self._masters.pop(version, None)
            for k in [k for k in self._cache if k[0] == version]:
                del self._cache[k]

    def key(self, scope: str, version: int | None = None) -> bytes:
        """The 32-byte AES key of ``scope`` under ``version`` (default: current)."""
        v = self._current if version is None else version
        ck = (v, scope)
        with self._lock:
            hit = self._cache.get(ck)
            if hit is not None:
                self._cache.move_to_end(ck)
                return hit
            master = self._masters.get(v)
        if master is None:
            raise SealedEntryError(f"sealed under unknown or retired key version {v:08x}")
        key = HKDF(
            algorithm=hashes.SHA256(),
            length=32,
            salt=_HKDF_SALT,
            info=_HKDF_INFO + _lp(scope.encode("utf-8")),
        ).derive(master)
        with self._lock:
            self._cache[ck] = key
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return key


class Sealer:
    """Seals and opens blobs of one ``kind`` with keys from a :class:`TenantKeyring`.

    Thread-safe; one per store is typical (several may share a keyring).
    """

    def __init__(self, keyring: TenantKeyring | None = None, *, kind: str = "blob") -> None:
        if not kind:
            raise ValueError("kind must be a non-empty string")
        self.keyring = keyring if keyring is not None else TenantKeyring()
        self.kind = kind
        self._kind_b = _lp(kind.encode("utf-8"))
        self._lock = threading.Lock()
        self._stats = SealStats()

    # -- counters -------------------------------------------------------------------------
    def stats(self) -> SealStats:
        """A snapshot of the counters."""
        with self._lock:
            s = self._stats
            return SealStats(s.sealed, s.opened, s.rejected, s.stale, dict(s.by_reason))

    def _reject(self, reason: str, message: str) -> SealedEntryError:
        with self._lock:
            self._stats.rejected += 1
            self._stats.by_reason[reason] = self._stats.by_reason.get(reason, 0) + 1
        return SealedEntryError(message)

    def count_rejection(self, reason: str) -> None:
        """Count a rejection decided by a caller (e.g. a chunk-level check before decryption)."""
        with self._lock:
            self._stats.rejected += 1
            self._stats.by_reason[reason] = self._stats.by_reason.get(reason, 0) + 1

    # -- sealing --------------------------------------------------------------------------
    def _aad(self, head: bytes, scope: str, context: bytes) -> bytes:
        return _AAD_LABEL + self._kind_b + _lp(scope.encode("utf-8")) + _lp(bytes(context)) + head

    def seal(self, plaintext: bytes | bytearray | memoryview, *, scope: str, context: bytes = b"") -> bytes:
        """Encrypt and authenticate ``plaintext`` for ``scope``, bound to ``context``."""
        return b"".join(self.seal_parts(plaintext, scope=scope, context=context))

    def seal_parts(self, plaintext: bytes | bytearray | memoryview, *, scope: str,
                   context: bytes = b"") -> tuple[bytes, bytes, bytes]:
        """:meth:`seal` as its three pieces (header, nonce, ciphertext+tag), so a caller that
        frames the envelope itself avoids copying a large ciphertext once more."""
        version = self.keyring.current
        head = _HEAD.pack(ENVELOPE_MAGIC, version)
        nonce = os.urandom(_NONCE_LEN)
        ct = AESGCM(self.keyring.key(scope, version)).encrypt(
            nonce, plaintext, self._aad(head, scope, context)
        )
        with self._lock:
            self._stats.sealed += 1
        return head, nonce, ct

    def open_ex(self, blob: bytes | bytearray | memoryview, *, scope: str, context: bytes = b"") -> Opened:
        """Authenticate and decrypt; raises :class:`SealedEntryError` (counted) on any failure."""
        mv = memoryview(blob)  # no copies of the (possibly MiB-sized) ciphertext
        if not is_sealed(mv):
            raise self._reject("unsealed", f"{self.kind}: entry is not sealed (forged or legacy)")
        head = bytes(mv[: _HEAD.size])
        version = int(_HEAD.unpack(head)[1])
        try:
            key = self.keyring.key(scope, version)
        except SealedEntryError as exc:
            raise self._reject("unknown-version", f"{self.kind}: {exc}") from None
        nonce = mv[_HEAD.size : _HEAD.size + _NONCE_LEN]
        try:
            pt = AESGCM(key).decrypt(nonce, mv[_HEAD.size + _NONCE_LEN :], self._aad(head, scope, context))
        except InvalidTag:
            raise self._reject(
                "auth-failed",
                f"{self.kind}: authentication failed (tampered, moved to another key/scope, or forged)",
            ) from None
        stale = version != self.keyring.current
        with self._lock:
            self._stats.opened += 1
            if stale:
                self._stats.stale += 1
        return Opened(plaintext=pt, key_version=version, stale=stale)

    def open(self, blob: bytes | bytearray | memoryview, *, scope: str, context: bytes = b"") -> bytes:
        """Like :meth:`open_ex`, returning the plaintext only."""
        return self.open_ex(blob, scope=scope, context=context).plaintext

    def reseal(self, blob: bytes, *, scope: str, context: bytes = b"") -> bytes:
        """Open ``blob`` and seal it again under the current key version (rotation migration)."""
        return self.seal(self.open(blob, scope=scope, context=context), scope=scope, context=context)


def keyring_from_config(security: Any, default_secret: bytes | str | None = None) -> TenantKeyring:
    """The server's keyring: ``security["seal_secrets"]`` (oldest first, last current) when set,
    else one version from ``default_secret`` (``server.secret`` / ``SEMCOMM_SECRET`` / the file)."""
    secrets_list = security.get("seal_secrets") if hasattr(security, "get") else None
    if secrets_list:
        if isinstance(secrets_list, (str, bytes)):
            secrets_list = [secrets_list]
        return TenantKeyring.from_secrets(list(secrets_list))
    return TenantKeyring(default_secret)
