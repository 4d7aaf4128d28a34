"""The per-request admission check the server runs before any cache lookup.

``RequestGuard.admit`` refuses client-chosen salts (400), applies the per-tenant rate limit and the
probe detector (429 + Retry-After), and returns the tenant's salt digest plus whether the request
must be served in isolation (no reuse of KV or answers written by anyone else).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OverloadedError
from ._probe import ProbeDetector, ProbeVerdict, RateLimiter
from ._tenancy import NO_TENANT_DIGEST, TenantSalter, reject_client_salt

__all__ = ["Admission", "ProbeThrottledError", "RequestGuard", "TenantContext"]


class ProbeThrottledError(OverloadedError):
    """A tenant is rate limited or flagged for prefix probing; the server answers 429."""

    status_code = 429

    def __init__(self, message: str, *, retry_after_s: float, reason: str) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TenantContext:
    """Who a request is served for, decided once by admission and carried with the request.

    Every stage that keys, scopes or routes by tenant reads it from here: the semantic layer
    (scope), the engine (KV namespace), the replica router (chunk keys), so they cannot disagree.
    """

    tenant: str | None  # configured tenant id from the API key (None: single-user server)
    digest: str  # the tenant's salt digest (NO_TENANT_DIGEST when tenant is None)
    isolate: bool = False  # serve without reusing anything: no semantic cache, no KV reuse

    @classmethod
    def public(cls) -> TenantContext:
        """The single-user namespace (no tenant configured)."""
        return cls(None, NO_TENANT_DIGEST, False)


@dataclass(frozen=True, slots=True)
class Admission:
    """Outcome of :meth:`RequestGuard.admit` for a request that may be served."""

    tenant: str | None  # authenticated tenant (None: single-user server)
    salt_digest: str  # goes into KV namespaces and semantic scopes
    isolate: bool  # serve without public/cross-tenant reuse (flagged prober in isolate mode)
    verdict: ProbeVerdict | None  # the detector's verdict (None when detection is off)

    @property
    def context(self) -> TenantContext:
        """The :class:`TenantContext` the rest of the request path is served under."""
        return TenantContext(self.tenant, self.salt_digest, self.isolate)


class RequestGuard:
    """Admission control for tenants: salts, client-salt refusal, rate limit, probe detection."""

    def __init__(
        self,
        salter: TenantSalter | None = None,
        *,
        detector: ProbeDetector | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.salter = salter if salter is not None else TenantSalter()
        self.detector = detector
        self.limiter = limiter
        self.refused = 0  # requests refused (rate limit or probing)

    def admit(
        self,
        tenant: str | None,
        tokens: Sequence[int] | np.ndarray,
        *,
        max_tokens: int | None = None,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Admission:
        """Check one request; raises ``ClientSaltError`` (400) or ``ProbeThrottledError`` (429)."""
        reject_client_salt(body, headers)
        digest = self.salter.digest(tenant) if tenant is not None else NO_TENANT_DIGEST
        key = tenant if tenant is not None else ""
        if self.limiter is not None:
            wait = self.limiter.acquire(key)
            if wait > 0:
                self.refused += 1
                raise ProbeThrottledError(
                    f"tenant {key or '(default)'} exceeded its request rate; retry in {wait:.1f}s",
                    retry_after_s=wait, reason="rate-limit",
                )
        verdict = None
        if self.detector is not None:
            verdict = self.detector.observe(key, tokens, max_tokens=max_tokens)
            if not verdict.allowed:
                self.refused += 1
                raise ProbeThrottledError(
                    f"tenant {key or '(default)'} is throttled: {verdict.reason}; "
                    f"retry in {verdict.retry_after_s:.0f}s",
                    retry_after_s=verdict.retry_after_s, reason="probing",
                )
        return Admission(tenant, digest, bool(verdict and verdict.isolate), verdict)
