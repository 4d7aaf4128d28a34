"""Tenancy, sealing, integrity and probe detection. Other packages call into this one.

* tenant salts derived on the server (:class:`TenantSalter`), client salts refused
  (:func:`reject_client_salt`);
* AES-256-GCM sealing with per-scope HKDF keys and rotation (:class:`TenantKeyring`,
  :class:`Sealer`), for KV chunks (:class:`ChunkSealer`) and semantic entries (:class:`EntrySealer`);
* prefix-probing detection and rate limits (:class:`ProbeDetector`, :class:`RateLimiter`,
  :class:`RequestGuard`), public prefixes and TTFT padding (:class:`PublicPrefixRegistry`,
  :class:`TimingGuard`).
"""

from ._chunks import SEAL_ALG, SEAL_META_KEY, ChunkSealer
from ._entries import ENTRY_SEAL_ALG, EntrySealer
from ._guard import Admission, ProbeThrottledError, RequestGuard, TenantContext
from ._probe import ProbeConfig, ProbeDetector, ProbeVerdict, RateLimiter
from ._sealing import (
    ENVELOPE_OVERHEAD,
    Opened,
    SealedEntryError,
    Sealer,
    SealStats,
    TenantKeyring,
    is_sealed,
    keyring_from_config,
)
from ._tenancy import (
    CLIENT_SALT_FIELDS,
    NO_TENANT_DIGEST,
    ClientSaltError,
    TenantId,
    TenantSalt,
    TenantSalter,
    load_server_secret,
    reject_client_salt,
    semcomm_home,
)
from ._timing import PublicMatch, PublicPrefixRegistry, TimingGuard

__all__ = [
    "CLIENT_SALT_FIELDS",
    "ENTRY_SEAL_ALG",
    "ENVELOPE_OVERHEAD",
    "NO_TENANT_DIGEST",
    "SEAL_ALG",
    "SEAL_META_KEY",
    "Admission",
    "ChunkSealer",
    "ClientSaltError",
    "EntrySealer",
    "Opened",
    "ProbeConfig",
    "ProbeDetector",
    "ProbeThrottledError",
    "ProbeVerdict",
    "PublicMatch",
    "PublicPrefixRegistry",
    "RateLimiter",
    "RequestGuard",
    "SealStats",
    "SealedEntryError",
    "Sealer",
    "TenantContext",
    "TenantId",
    "TenantKeyring",
    "TenantSalt",
    "TenantSalter",
    "TimingGuard",
    "is_sealed",
    "keyring_from_config",
    "load_server_secret",
    "reject_client_salt",
    "semcomm_home",
]
