"""Replica-choice policies, as values in a registry (``POLICIES``).

Every policy sees a :class:`RouteView` (the request's prefix match per replica and the replicas'
load) and returns a replica slot. Policies never touch the index or the load arrays themselves;
the :class:`~semcomm.routing.ReplicaRouter` does the bookkeeping.

=============  ============================================================================
name           rule
=============  ============================================================================
round-robin    next replica in turn (cache- and load-blind baseline)
least-loaded   fewest requests in flight (ties: least predicted prefill backlog)
affinity       longest cached prefix (ties and misses: least loaded); pure prefix affinity
weighted       llm-d: ``3*prefix/total + 2*queue_score + 2*(1 - kv_use)``, max score wins
gated          SGLang: imbalanced (abs and rel) -> least loaded; match > 0.3 -> best match;
               else the replica with the smallest cache
two-choice     DualMap: two candidates from two hashes of the prompt's first chunks; the
               cache-affine one unless its predicted TTFT breaks the SLO, then the faster one
default        least predicted cost: ``backlog + (1 + recompute_weight) * prefill(uncached)``;
               affinity while it is cheap, spreading when a queue builds (see docs/routing.md)
=============  ============================================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from ._cost import CostModel

__all__ = [
    "POLICIES",
    "Policy",
    "RouteView",
    "make_policy",
    "policy_names",
    "predicted_ttft",
]


@dataclass(slots=True)
class RouteView:
    """What a policy may look at for one request (built by the router, read-only to policies)."""

    num_tokens: int  # prompt length in tokens
    keys: Sequence[Hashable]  # chunk keys of the full prompt, first chunk first
    match: dict[int, int]  # replica -> consecutive cached chunks (absent: no match)
    chunk_size: int  # tokens per chunk
    inflight: np.ndarray  # (R,) int64 requests routed and not completed, per replica
    backlog_s: np.ndarray  # (R,) float64 predicted prefill seconds queued, per replica
    sizes: Callable[[], np.ndarray]  # (R,) chunks held per replica (computed on demand)
    capacity_chunks: int  # per-replica KV capacity in chunks
    cost: CostModel  # cost model used for TTFT prediction
    slo_ttft_s: float  # TTFT service-level objective in seconds

    @property
    def num_replicas(self) -> int:
        return int(self.inflight.shape[0])

    def cached_tokens(self, replica: int) -> int:
        """Tokens the replica can restore, priced with at least one token recomputed (a replica
        may lack the prompt's stored last logits; vLLM always computes one block)."""
        m = self.match.get(replica, 0)
        return min(m * self.chunk_size, max(self.num_tokens - 1, 0))


def predicted_ttft(view: RouteView, *, recompute_weight: float = 0.0) -> np.ndarray:
    """(R,) predicted TTFT per replica: queued prefill work plus this prompt's uncached prefill.

    ``recompute_weight`` > 0 charges the recomputed tokens again, as the GPU time they take from
    later requests (the term that keeps prefixes together under load).
    """
    cost = view.cost
    n = view.num_tokens
    slow = 1.0 + cost.prefill_slowdown_per_decode * view.inflight
    full = cost.prefill_s(n, 0)
    own = np.full(view.num_replicas, full)
    for r in view.match:
        c = view.cached_tokens(r)
        own[r] = cost.prefill_s(n - c, c)
    return view.backlog_s + own * slow * (1.0 + recompute_weight)


def _least_loaded(view: RouteView, among: Sequence[int] | None = None) -> int:
    if among is None:
        score = view.inflight * 1e6 + view.backlog_s
        return int(np.argmin(score))
    return min(among, key=lambda r: (int(view.inflight[r]), float(view.backlog_s[r]), r))


class Policy(Protocol):
    """A replica-choice rule. ``name`` is its registry name."""

    name: str

    def choose(self, view: RouteView) -> int: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0  # next slot to use; only ``choose`` changes it

    def choose(self, view: RouteView) -> int:
        r = self._next % view.num_replicas
        self._next = r + 1
        return r


class LeastLoaded:
    name = "least-loaded"

    def choose(self, view: RouteView) -> int:
        return _least_loaded(view)


class Affinity:
    name = "affinity"

    def choose(self, view: RouteView) -> int:
        if not view.match:
            return _least_loaded(view)
        best = max(view.match.values())
        return _least_loaded(view, [r for r, m in view.match.items() if m == best])


class Weighted:
    """llm-d scheduler profile: weighted sum of clamped scorer outputs, max score wins."""

    name = "weighted"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0):
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight

    def choose(self, view: RouteView) -> int:
        total = max(len(view.keys), 1)
        q = view.inflight.astype(np.float64)
        qmin, qmax = float(q.min()), float(q.max())
        queue = np.ones_like(q) if qmax == qmin else (qmax - q) / (qmax - qmin)
        score = self.queue_weight * queue
        if self.kv_weight:
            use = np.clip(view.sizes() / float(view.capacity_chunks), 0.0, 1.0)
            score = score + self.kv_weight * (1.0 - use)
        for r, m in view.match.items():
            score[r] += self.prefix_weight * min(1.0, m / total)
        best = float(score.max())
        ties = np.flatnonzero(score >= best - 1e-12)
        return _least_loaded(view, ties.tolist()) if len(ties) > 1 else int(ties[0])


class Gated:
    """SGLang cache-aware policy (CLI defaults: abs 64, rel 1.5, cache threshold 0.3)."""

    name = "gated"

    def __init__(
        self,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
    ):
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold

    def choose(self, view: RouteView) -> int:
        lo, hi = int(view.inflight.min()), int(view.inflight.max())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return _least_loaded(view)
        total = max(len(view.keys), 1)
        if view.match:
            best = max(view.match.values())
            if best / total > self.cache_threshold:
                return _least_loaded(view, [r for r, m in view.match.items() if m == best])
        sizes = view.sizes()
        return int(np.argmin(sizes * 1e6 + view.inflight))


def _key_u64(key: Hashable, salt: bytes) -> int:
    if isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    elif isinstance(key, int):
        raw = key.to_bytes(16, "little", signed=True)
    else:
        raw = repr(key).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8, key=salt).digest(), "little")


class TwoChoice:
    """DualMap: two candidates from two independent hashes of the prompt's first chunks."""

    name = "two-choice"

    def __init__(self, prefix_chunks: int = 1):
        if prefix_chunks <= 0:
            raise ConfigError(f"two-choice prefix_chunks must be positive, got {prefix_chunks}")
        self.prefix_chunks = prefix_chunks
        # two independent hash functions: keyed BLAKE2b with two fixed domain keys
        self._salts = (b"semcomm/dualmap/h1", b"semcomm/dualmap/h2")

    def candidates(self, keys: Sequence[Hashable], n: int) -> tuple[int, int]:
        if n == 1 or not keys:
            return 0, 0 if n == 1 else 1
        k = keys[min(self.prefix_chunks, len(keys)) - 1]
        c1 = _key_u64(k, self._salts[0]) % n
        c2 = (c1 + 1 + _key_u64(k, self._salts[1]) % (n - 1)) % n  # distinct from c1
        return c1, c2

    def choose(self, view: RouteView) -> int:
        n = view.num_replicas
        if not view.keys:
            return _least_loaded(view)
        c1, c2 = self.candidates(view.keys, n)
        ttft = predicted_ttft(view)
        m1, m2 = view.match.get(c1, 0), view.match.get(c2, 0)
        affine, other = (c1, c2) if m1 >= m2 else (c2, c1)
        if ttft[affine] <= view.slo_ttft_s:
            return affine
        return affine if ttft[affine] <= ttft[other] else other


class Default:
    """semcomm's default: least predicted cost over all replicas.

    cost(r) = backlog(r) + (1 + recompute_weight) x prefill(uncached tokens on r), stretched by
    r's running decodes. At low load the replica holding the prefix wins (its prefill is
    shortest); as its queue grows, the request moves to the replica where the total is lowest.
    Charging recomputed tokens (1 + 4) times keeps prefixes together longer (a recompute also delays
    later requests and duplicates KV), which is what holds the hit rate near pure affinity.
    """

    name = "default"

    def __init__(self, recompute_weight: float = 4.0):
        self.recompute_weight = recompute_weight

    def choose(self, view: RouteView) -> int:
        cost = predicted_ttft(view, recompute_weight=self.recompute_weight)
        best = float(cost.min())
        ties = np.flatnonzero(cost <= best + 1e-12)
        if len(ties) == 1:
            return int(ties[0])
        return _least_loaded(view, ties.tolist())


POLICIES: dict[str, Callable[..., Any]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "affinity": Affinity,
    "weighted": Weighted,
    "gated": Gated,
    "two-choice": TwoChoice,
    "default": Default,
}


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str, **options: Any) -> Policy:
    """Build a policy by registry name; unknown names and options raise :class:`ConfigError`."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; choose one of {policy_names()}") from None
    try:
        policy: Policy = factory(**options)
    except TypeError as exc:
        raise ConfigError(f"bad options {sorted(options)} for policy {name!r}: {exc}") from exc
    return policy
