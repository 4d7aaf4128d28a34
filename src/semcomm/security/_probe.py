"""Detection of prefix-probing patterns per tenant, and rate limiting (CacheSolidarity-like).

A prefix-probing attacker (PromptPeek, InputSnatch, Early Bird) guesses a cached prompt by sending
many requests that are *nearly the same*: one long shared part (a known template or the part
already recovered) and a few varying tokens (the candidate for the next token or field), often
with ``max_tokens`` of 1 because only the time to first token matters. It must send one probe per
candidate, so the pattern is a burst of distinct near-duplicates.

:class:`ProbeDetector` keeps, per tenant, a bounded window of recent prompts summarised by hashes
of their leading and trailing granules (``granule`` tokens each). Two prompts are
*near-duplicates* when, outside one contiguous window of at most ``max_diff_tokens`` tokens, they
are equal, and they share at least ``min_shared_tokens``. When a tenant's new prompt has at least
``near_dup_threshold`` (weighted) distinct near-duplicates in the last ``window_s`` seconds the
tenant is flagged for ``block_s`` seconds: its requests are throttled (429 + Retry-After) or,
with ``action="isolate"``, served without any cross-tenant or public-prefix reuse, so probes carry
no signal. An optional token bucket bounds each tenant's request rate outright.

Invariants: per-tenant history is a deque of at most ``max_history`` items; at most
``max_tenants`` tenants are tracked (least recently seen dropped). Memory is bounded.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["ProbeConfig", "ProbeDetector", "ProbeVerdict", "RateLimiter"]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """Thresholds of :class:`ProbeDetector` (defaults suit chat traffic; see docs/SECURITY.md)."""

    window_s: float = 30.0  # sliding window over which near-duplicates are counted
    granule: int = 8  # tokens per hashed unit; the diff window is measured to +-2 granules
    max_diff_tokens: int = 16  # near-duplicates differ in at most this many contiguous tokens
    min_shared_tokens: int = 48  # ... and share at least this many tokens
    near_dup_threshold: float = 6.0  # weighted near-duplicates in the window that flag a tenant
    short_output_tokens: int = 2  # a request asking for <= this many tokens is "TTFT-only"
    short_output_weight: float = 1.5  # weight of a TTFT-only near-duplicate (plain ones weigh 1)
    block_s: float = 30.0  # how long a flagged tenant stays flagged
    action: Literal["throttle", "isolate"] = "throttle"  # what a flag does
    max_history: int = 256  # prompts remembered per tenant
    max_tenants: int = 10_000  # tenants tracked at once (LRU)
    exempt_tenants: tuple[str, ...] = ()  # trusted tenants never checked (e.g. internal batch jobs)


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """What to do with one request."""

    allowed: bool  # False: refuse with 429 and Retry-After
    isolate: bool  # True: serve, but without cross-tenant/public reuse (no timing signal)
    retry_after_s: float  # seconds until the tenant is unflagged (0 when not flagged)
    score: float  # weighted near-duplicates seen in the window (including this request)
    reason: str  # "" when nothing was detected


@dataclass(slots=True)
class _Sketch:
    """Summary of one prompt: hashes of its first/last j granules, j = 1..n//granule."""

    t: float  # arrival time (clock seconds)
    n: int  # token count
    full: bytes  # hash of the whole prompt (exact duplicates are not probes)
    heads: list[bytes]  # heads[j-1] = H(tokens[: j*g])
    tails: list[bytes]  # tails[j-1] = H(tokens[n - j*g :])
    short_output: bool  # asked for very few output tokens


@dataclass(slots=True)
class _TenantState:
    history: deque[_Sketch]
    flagged_until: float = 0.0
    flags: int = 0  # how many times this tenant was flagged (monotone)


def _prefix_hashes(arr: np.ndarray, g: int) -> list[bytes]:
    h = hashlib.blake2b(digest_size=16)
    out: list[bytes] = []
    for j in range(len(arr) // g):
        h.update(arr[j * g : (j + 1) * g].tobytes())
        out.append(h.copy().digest())
    return out


def _common(a: list[bytes], b: list[bytes]) -> int:
    """Length of the common leading run of two prefix-hash lists (they are monotone: once two
    prefixes differ, every longer one does), found by binary search."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ProbeDetector:
    """Per-tenant probe detection (see the module docstring). Thread-safe."""

    def __init__(self, config: ProbeConfig | None = None, *, clock: Clock = time.monotonic) -> None:
        self.config = config or ProbeConfig()
        if self.config.granule <= 0:
            raise ValueError("granule must be positive")
        self._clock = clock
        self._tenants: OrderedDict[str, _TenantState] = OrderedDict()
        self._lock = threading.Lock()
        self.flags_total = 0  # tenants flagged, ever (for metrics)

    def _sketch(self, tokens: Sequence[int] | np.ndarray, max_tokens: int | None, now: float) -> _Sketch:
        arr = np.asarray(tokens, dtype="<u4")
        g = self.config.granule
        short = max_tokens is not None and max_tokens <= self.config.short_output_tokens
        return _Sketch(
            t=now,
            n=len(arr),
            full=hashlib.blake2b(arr.tobytes(), digest_size=16).digest(),
            heads=_prefix_hashes(arr, g),
            tails=_prefix_hashes(np.ascontiguousarray(arr[::-1]), g),
            short_output=short,
        )

    def _near_duplicate(self, a: _Sketch, b: _Sketch) -> bool:
        c = self.config
        if a.full == b.full or abs(a.n - b.n) > c.max_diff_tokens:
            return False
        shared = (_common(a.heads, b.heads) + _common(a.tails, b.tails)) * c.granule
        shared = min(shared, min(a.n, b.n))
        # granule rounding hides up to (granule - 1) equal tokens on each side of the diff window
        return shared >= c.min_shared_tokens and max(a.n, b.n) - shared <= c.max_diff_tokens + 2 * (
            c.granule - 1
        )

    def _state(self, tenant: str) -> _TenantState:
        st = self._tenants.get(tenant)
        if st is None:
            st = _TenantState(history=deque(maxlen=self.config.max_history))
            self._tenants[tenant] = st
            while len(self._tenants) > self.config.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        return st

    def observe(
        self, tenant: str, tokens: Sequence[int] | np.ndarray, *, max_tokens: int | None = None
    ) -> ProbeVerdict:
        """Record one request of ``tenant`` and decide whether to serve it."""
        c = self.config
        if tenant in c.exempt_tenants:
            return ProbeVerdict(True, False, 0.0, 0.0, "")
        now = self._clock()
        sk = self._sketch(tokens, max_tokens, now)
        with self._lock:
            st = self._state(tenant)
            while st.history and now - st.history[0].t > c.window_s:
                st.history.popleft()
            seen: set[bytes] = {sk.full}
            score = c.short_output_weight if sk.short_output else 1.0
            for old in st.history:
                if old.full in seen or not self._near_duplicate(sk, old):
                    continue
                seen.add(old.full)
                score += c.short_output_weight if old.short_output else 1.0
            st.history.append(sk)
            reason = ""
            if score >= c.near_dup_threshold:
                if st.flagged_until <= now:
                    st.flags += 1
                    self.flags_total += 1
                st.flagged_until = now + c.block_s
                reason = (
                    f"{len(seen)} distinct near-identical prompts in {c.window_s:g}s "
                    "(prefix probing pattern)"
                )
            flagged = st.flagged_until > now
            if flagged and not reason:
                reason = "tenant flagged for prefix probing"
        retry = max(0.0, st.flagged_until - now) if flagged else 0.0
        if not flagged:
            return ProbeVerdict(True, False, 0.0, score, "")
        if c.action == "isolate":
            return ProbeVerdict(True, True, retry, score, reason)
        return ProbeVerdict(False, True, retry, score, reason)

    def is_flagged(self, tenant: str) -> bool:
        with self._lock:
            st = self._tenants.get(tenant)
            return st is not None and st.flagged_until > self._clock()

    def flags(self, tenant: str) -> int:
        with self._lock:
            st = self._tenants.get(tenant)
            return 0 if st is None else st.flags

    def forget(self, tenant: str) -> None:
        """Drop a tenant's history and flag (an operator's unblock)."""
        with self._lock:
            self._tenants.pop(tenant, None)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass
class RateLimiter:
    """Token bucket per tenant: ``rate_per_s`` sustained, ``burst`` at once; bounded tenant map."""

    rate_per_s: float
    burst: int
    max_tenants: int = 10_000
    clock: Clock = time.monotonic
    _buckets: OrderedDict[str, _Bucket] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")

    def acquire(self, tenant: str, cost: float = 1.0) -> float:
        """Take ``cost`` tokens; return 0.0 if allowed, else the seconds to wait (Retry-After)."""
        now = self.clock()
        with self._lock:
            b = self._buckets.get(tenant)
            if b is None:
                b = _Bucket(float(self.burst), now)
                self._buckets[tenant] = b
                while len(self._buckets) > self.max_tenants:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(tenant)
            b.tokens = min(float(self.burst), b.tokens + (now - b.updated) * self.rate_per_s)
            b.updated = now
            if b.tokens >= cost:
                b.tokens -= cost
                return 0.0
            return (cost - b.tokens) / self.rate_per_s

